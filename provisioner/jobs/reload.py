"""Policy and settings edits reach the running scheduler: before each pass (and on SIGHUP) the
files are compared with those last read — size and mtime first, then a SHA-256 of the contents —
and a changed set is validated as a fresh process would read it. A valid set is swapped in and
what changed is logged (``budget nlp-research: budget.amount.amount 1000 → 20``); a broken one
leaves the old set in force, and its one-line error is logged and alerted (a ``policy-error``
notice, mailed to the budgets' recipients) once per broken version, not every pass.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from provisioner.app import App
from provisioner.errors import ConfigError, ProvisionerError
from provisioner.location import default_config_path
from provisioner.schema import NoticeKind

if TYPE_CHECKING:
    from policies.schema import Policy
    from provisioner.settings import Settings

log = logging.getLogger("provisioner.scheduler")

NOTICE_POLICY = "(policy files)"  # the budget_notices row of a broken set: not a policy's name
NOTICE_KIND = NoticeKind.POLICY_ERROR
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: settings a running scheduler cannot take up: they need a restart
RESTART = (
    "state_url",
    "home",
    "scheduler.listen",
    "scheduler.max_connections",
    "scheduler.metrics_token",
    "scheduler.sweep_interval_seconds",  # the jobs' intervals are set when they are scheduled
    "scheduler.recover_interval_seconds",
    "scheduler.reconcile_interval_seconds",
)


def config_path(config: str | Path | None) -> Path | None:
    """The settings file ``load_settings(config)`` reads (None: none, defaults only)."""
    path = config or os.environ.get("PROVISIONER_CONFIG")
    file = Path(path) if path else default_config_path()
    return file if path or file.exists() else None


def _files(paths: Iterable[str | Path]) -> list[Path]:
    """The files a policy list names (a directory: its ``*.yaml``/``*.yml``, as the loader)."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            out.extend(sorted(f for f in p.iterdir() if f.suffix in (".yaml", ".yml")))
        else:
            out.append(p)
    return out


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _digest(paths: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(str(p).encode() + b"\0")
        try:
            h.update(p.read_bytes() if p.is_file() else b"<not a file>")
        except OSError as e:
            h.update(f"<{e.strerror}>".encode())
        h.update(b"\0")
    return h.hexdigest()


@dataclass
class Change:
    """What one reload did: ``changes`` applied, or ``error`` (the old set kept)."""

    changes: list[str] = field(default_factory=list)
    error: str | None = None
    alerted: bool = False


class Watcher:
    """The files behind ``app.settings`` and ``app.policies``, and what they were when read."""

    def __init__(self, app: App, config: str | Path | None = None) -> None:
        self.app = app
        self.config = config_path(config)
        app.policies  # noqa: B018  (the set in force: read now, compared with later edits)
        self._lock = threading.Lock()
        self._stats = self._stat_all()
        self._digest = _digest(self._watched())
        self._broken: str | None = None  # the digest of the broken set last reported

    def _watched(self) -> list[Path]:
        files = _files(self.app.settings.policies)
        return ([self.config] if self.config else []) + files

    def _stat_all(self) -> dict[Path, tuple[int, int] | None]:
        return {p: _stat(p) for p in self._watched()}

    def check(self, why: str = "pass") -> Change | None:
        """Reload when the files changed since last read; None when they did not."""
        with self._lock:
            if self.app.refresh_rules():  # an admin applied new team rules: read on next use
                log.warning("reload (%s): the team's rules changed in the state", why)
            stats = self._stat_all()
            if stats == self._stats:
                return None
            self._stats = stats
            digest = _digest(stats)
            if digest == self._digest:  # touched, or put back as it was
                self._broken = None
                return None
            try:
                settings, policies = self._read()
            except (ConfigError, ProvisionerError, OSError, ValueError) as e:  # file:line: field
                return self._broken_set(digest, str(e), why)
            old_settings, old_policies = self.app.settings, self.app.policies
            changes = diff_settings(old_settings, settings) + diff_policies(old_policies, policies)
            self.app.settings = settings
            self.app.__dict__["policies"] = policies  # the cached property's value, swapped
            if old_settings.model_dump(include={"clouds"}) != settings.model_dump(
                include={"clouds"}
            ):
                self.app._providers.clear()  # adapters are built from the clouds' options
            self._digest, self._broken = digest, None
            self._stats = self._stat_all()  # a new policy directory's files
            for line in changes or ["files rewritten, nothing in effect changed"]:
                log.warning("reload (%s): %s", why, line)
            return Change(changes)

    def _read(self) -> tuple[Settings, list[Policy]]:
        from policies import loader
        from provisioner.settings import load_settings

        settings = load_settings(self.config) if self.config else self.app.settings
        local = loader.load(settings.policies) if settings.policies else []
        return settings, self.app.with_team_rules(local)  # the team's rules, files narrowing

    def _broken_set(self, digest: str, error: str, why: str) -> Change:
        one_line = " | ".join(line.strip() for line in error.splitlines() if line.strip())
        if digest == self._broken:
            return Change(error=one_line)
        self._broken = digest
        log.error("reload (%s): the edited files are broken, the old ones stay: %s", why, one_line)
        return Change(error=one_line, alerted=alert(self.app, digest, one_line))


def alert(app: App, digest: str, error: str) -> bool:
    """Record a broken set once (by its digest, across schedulers sharing the state) and mail
    the budgets' recipients; False when it was recorded already."""
    from provisioner.jobs.notices import claim
    from provisioner.ledger import Period

    recipients = sorted({r for p in app.policies if p.budget for r in p.budget.recipients})
    send = None
    if recipients:

        def send() -> None:
            from provisioner import mail

            smtp = app.settings.smtp
            mail.send(
                smtp,
                mail.compose(
                    sender=smtp.sender,
                    to=recipients,
                    subject="provisioner: edited policy files are broken; the old ones stay",
                    text=f"{error}\n\nThe scheduler keeps acting on the policies it read last. "
                    "Fix the files; it reads them again at its next pass.\n",
                ),
            )

    try:
        return claim(
            app,
            NOTICE_POLICY,
            Period(EPOCH, EPOCH, "-"),
            [(NOTICE_KIND, digest[:40])],
            app.clock.now(),
            send,
            {"error": error[:2000]},
        )
    except Exception as e:  # the mail failed: logged; the next broken version tries again
        log.error("reload: the alert could not be sent: %s", e)
        return False


def diff_settings(old: Settings, new: Settings) -> list[str]:
    a, b = _flat(old.model_dump(mode="json")), _flat(new.model_dump(mode="json"))
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            later = " (takes effect after a restart)" if key.startswith(RESTART) else ""
            out.append(f"settings {key}: {_show(a.get(key))} → {_show(b.get(key))}{later}")
    return out


def diff_policies(old: list[Policy], new: list[Policy]) -> list[str]:
    """``policy X added``, ``policy Y removed``, ``policy Z: field a → b`` for each field."""
    a = {p.name: _flat(p.model_dump(mode="json")) for p in old}
    b = {p.name: _flat(p.model_dump(mode="json")) for p in new}
    out = [f"policy {n} added" for n in b if n not in a]
    out += [f"policy {n} removed" for n in a if n not in b]
    for n in (n for n in b if n in a):
        for key in sorted(set(a[n]) | set(b[n])):
            if a[n].get(key) != b[n].get(key):
                out.append(f"policy {n}: {key} {_show(a[n].get(key))} → {_show(b[n].get(key))}")
    return out


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted field names to values; an amount with its currency is one value (``20 USD``)."""
    if isinstance(data, dict) and set(data) == {"amount", "currency"}:
        return {prefix: f"{data['amount']} {data['currency']}"}
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: data}


def _show(v: Any) -> str:
    """A value as read in a log line; secrets stay masked (SecretStr dumps as ``**********``,
    and a URL's password, e.g. in ``state_url``, is starred out)."""
    return "(unset)" if v is None else re.sub(r"(://[^:/@\s]+:)\S+@", r"\1***@", str(v))
