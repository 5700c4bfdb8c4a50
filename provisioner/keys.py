"""SSH keys and reaching machines by name.

``up`` launches with the experiment's ``ssh_public_key``, else the user's own key
(``~/.ssh/id_ed25519.pub``, then ``id_rsa.pub``), else a pair generated once in the provisioner
home; it records which private key goes with the machine (its path and fingerprint, never the
key), so ``provisioner ssh`` and the OpenSSH config written here use that key. An address that
does not answer is reported within :func:`probe_seconds`, saying what to check, not left to
OpenSSH's two-minute TCP timeout.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import DBAPIError

from provisioner import permits, secretfile
from provisioner.app import App
from provisioner.errors import OperationFailed, state_refusal
from provisioner.models import Event, Machine, TeamKey
from provisioner.schema import MachineStatus as S
from provisioner.spec import Experiment

log = logging.getLogger("provisioner.keys")

#: How long `provisioner ssh` waits for a machine's SSH port before saying what to check;
#: ``$PROVISIONER_SSH_PROBE_SECONDS`` shortens it (tests).
SSH_PROBE_SECONDS = 15.0
#: The user's own keys, in the order ``up`` looks for them (in ``~/.ssh``).
USER_KEYS = ("id_ed25519", "id_rsa")
#: Documentation ranges (RFC 5737) never route: the sandbox's simulated addresses are here.
TEST_NETS = tuple(
    ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")
)
#: Where the launched-event detail keeps the key (a path and a fingerprint, never the key).
DETAIL = "ssh_key"


@dataclass(frozen=True)
class Key:
    public_key: str | None  # the OpenSSH public key line the cloud installs
    source: str  # experiment | user | generated | none
    public_path: Path | None = None
    private_path: Path | None = None  # what `ssh -i` uses, when it is a file we know
    pull_key: str | None = None  # the team's pull key (:func:`pull_public_key`), restricted

    def detail(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "public_path": str(self.public_path) if self.public_path else None,
            "private_path": str(self.private_path) if self.private_path else None,
            "fingerprint": fingerprint(self.public_key) if self.public_key else None,
        }


def fingerprint(public_key: str) -> str | None:
    """``SHA256:…`` as ``ssh-keygen -l`` prints it (None for a line that is not a key)."""
    try:
        blob = base64.b64decode(public_key.split()[1], validate=True)
    except (IndexError, ValueError):
        return None
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def tilde(path: Path) -> str:
    """``path`` with the user's home written as ``~``."""
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)


def generated_path(app: App) -> Path:
    return app.settings.home / "keys" / "id_ed25519"


def choose(app: App, experiment: Experiment, say: Callable[[str], None]) -> Key:
    """The key ``up`` launches with, said in one line, with the team's pull key beside it."""
    key = _choose(app, experiment, say)
    try:
        pull = pull_public_key(app)
    except OperationFailed as e:  # no ssh-keygen: the machine is launched, not pulled
        say(f"pull key: none ({e}); the scheduler reads this machine's idle only by heartbeats")
        pull = None
    return Key(key.public_key, key.source, key.public_path, key.private_path, pull)


def _choose(app: App, experiment: Experiment, say: Callable[[str], None]) -> Key:
    if experiment.ssh_public_key:
        say("key: the experiment's ssh_public_key (your agent or ~/.ssh/config picks the key)")
        return Key(experiment.ssh_public_key.strip(), "experiment")
    for name in USER_KEYS:
        pub = Path.home() / ".ssh" / f"{name}.pub"
        text = _read_key(pub)
        if text:
            private = pub.with_suffix("")
            say(f"key: {tilde(pub)}")
            return Key(text, "user", pub, private if private.is_file() else None)
    path = generated_path(app)
    try:
        made = _generate(app, path)
    except OperationFailed as e:
        say(f"key: none ({e}); set ssh_public_key in the experiment to reach the machine")
        return Key(None, "none")
    text = _read_key(path.with_name(path.name + ".pub"))
    say(f"key: {'generated' if made else 'the one generated earlier,'} {path} (none in ~/.ssh)")
    return Key(text, "generated", path.with_name(path.name + ".pub"), path)


def _read_key(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text if fingerprint(text) else None


def _generate(app: App, path: Path) -> bool:
    """An ed25519 pair at ``path`` (private 0600, its folder 0700), made once; True when made
    now. Concurrent ``up``s make one: the check and the write are under a lock. A private key
    that is not as made (empty, a symlink, not a regular file, another user's, readable by
    others: :func:`provisioner.secretfile.why_not`) is said in one log line and made anew,
    never used (OpenSSH itself refuses a key others may read)."""
    with app.db.lock("ssh-key"):
        why = secretfile.why_not(path)
        if why is None and path.with_name(path.name + ".pub").is_file():
            return False
        if why not in (None, "missing"):
            log.warning("%s: %s; replaced with a new key pair", path, why)
        _keygen(path, "provisioner")
        return True


def _keygen(path: Path, comment: str) -> None:
    """A fresh ed25519 pair at ``path`` (private 0600, its folder 0700)."""
    keygen = shutil.which("ssh-keygen")
    if keygen is None:
        why = "no key in ~/.ssh and " if comment == "provisioner" else ""
        raise OperationFailed(f"{why}ssh-keygen is not installed")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    for stale in (path, path.with_name(path.name + ".pub")):
        stale.unlink(missing_ok=True)  # half of a pair: ssh-keygen would ask to overwrite
    done = subprocess.run(
        [keygen, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise OperationFailed(f"ssh-keygen failed: {done.stderr.strip() or done.returncode}")
    path.chmod(0o600)


def private_key(app: App, m: Machine) -> Path | None:
    """The private key recorded for ``m`` at launch, when that file still exists (an
    experiment's own ``ssh_public_key`` records none: the user's agent or config decides)."""
    with app.db.session() as s:
        details = s.scalars(
            select(Event.detail).where(Event.machine_id == m.id).order_by(Event.id.desc())
        ).all()
    for d in details:
        if isinstance(d, dict) and isinstance(d.get(DETAIL), dict):
            p = d[DETAIL].get("private_path")
            return Path(p) if p and Path(p).is_file() else None
    return None


# --- the team's pull key -----------------------------------------------------------------------

PULL = "pull"  # its name in the team_keys table
#: Where the launch event records the pull key's fingerprint: the machine can be pulled.
PULL_DETAIL = "pull_key"
#: The line the startup data writes to the login user's authorized_keys: the key can run the
#: agent's report and nothing else (``restrict``: no pty, no forwarding of any kind).


def pull_path(app: App) -> Path:
    """The pull key's private half, in this host's provisioner home (0600)."""
    return app.settings.home / "keys" / "pull_ed25519"


def published_pull_key(app: App) -> str | None:
    with app.db.session() as s:
        row = s.get(TeamKey, PULL)
        return row.public_key if row is not None else None


def pull_public_key(app: App) -> str | None:
    """The team's pull key as published in the state; the first caller that finds none (an
    ``up``, a sweep, a scheduler pass, on any host) makes the pair here (the private half in
    this home) and publishes the public half. Raises :class:`OperationFailed` when it must make
    one and cannot (no ssh-keygen)."""
    if (known := published_pull_key(app)) is not None:
        return known
    path = pull_path(app)
    with app.db.lock("pull-key"):
        if (known := published_pull_key(app)) is not None:
            return known  # another host published it meanwhile
        pub = path.with_name(path.name + ".pub")
        text = _read_key(pub) if path.is_file() else None
        if text is None:  # a pair left from an earlier state is published again, else made
            _keygen(path, "provisioner-pull")
            text = _read_key(pub)
        if text is None:
            raise OperationFailed(f"ssh-keygen made no readable key at {pub}")
        try:
            with app.db.session() as s:
                s.add(
                    TeamKey(
                        name=PULL,
                        public_key=text,
                        fingerprint=fingerprint(text) or "",
                        created_at=app.clock.now(),
                        created_by=app.actor,
                    )
                )
        except DBAPIError as e:  # a team's member: its scheduler or an admin publishes it
            if (refused := state_refusal(e)) is None:
                raise
            raise OperationFailed(f"{refused} (the scheduler or an admin publishes it)") from None
        return text


def pull_private(app: App) -> Path | None:
    """The private half of the published pull key, when this host holds it (the file exists
    and its public half is the one published)."""
    published = published_pull_key(app)
    path = pull_path(app)
    if published is None or not (path.is_file() or path.is_symlink()):
        return None
    if (why := secretfile.why_not(path)) is not None:  # the machines hold its public half:
        log.warning("%s: %s; not used", path, why)  # not replaced here, never trusted
        return None
    pub = _read_key(path.with_name(path.name + ".pub"))
    if pub is not None and pub.split()[:2] != published.split()[:2]:
        return None  # another pair: the machines hold the published one
    return path


# --- reaching the address -----------------------------------------------------------------------


def probe_seconds() -> float:
    return float(os.environ.get("PROVISIONER_SSH_PROBE_SECONDS") or SSH_PROBE_SECONDS)


def simulated(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in TEST_NETS)


def check_reachable(app: App, m: Machine) -> None:
    """Raise :class:`OperationFailed` (exit 1) saying what to check unless ``m``'s SSH port
    accepts a TCP connection within :func:`probe_seconds`."""
    from providers.base import port_open

    provider = app.provider(m.cloud or "")
    address, port = m.public_ip or "", provider.ssh_port
    if simulated(address):
        raise OperationFailed(
            f"{m.name}'s address {address} is simulated: "
            + (
                "sandbox machines have a simulated address (198.51.100.x, TEST-NET); set "
                "clouds.sandbox.public_ip/ssh_port to reach a real sshd"
                if m.cloud == "sandbox"
                else "a documentation address (TEST-NET) that never routes"
            )
        )
    wait = probe_seconds()
    if port_open(address, port, wait):
        return
    cidrs = getattr(provider.options, "ssh_cidrs", None)
    where = (
        f"clouds.{m.cloud}.public_ip/ssh_port in the settings (is an sshd listening there?)"
        if m.cloud == "sandbox"
        else f"the {m.cloud} firewall / security group admits TCP {port} from your address"
        + (f" (clouds.{m.cloud}.ssh_cidrs in the settings: {', '.join(cidrs)})" if cidrs else "")
    )
    raise OperationFailed(
        f"{m.name} at {address}:{port} did not answer SSH within {wait:g} s. Check: the "
        f"machine's state (`provisioner status {m.name}`; it may still be booting), and {where}"
    )


# --- an OpenSSH config for plain `ssh NAME` ------------------------------------------------------


def config_path(app: App) -> Path:
    return app.settings.home / "ssh_config"


def known_hosts(app: App) -> Path:
    return app.settings.home / "known_hosts"


def host_alias(m: Machine) -> str:
    """The name a machine's host key is kept under: a cloud reuses addresses, machines differ."""
    return f"provisioner-{m.id}"


def _quoted(path: Path) -> str:
    return f'"{path}"' if " " in str(path) else str(path)


def ssh_config(app: App) -> str:
    """One ``Host NAME`` block per machine with an address, running or starting, that who
    acts may act on (:mod:`provisioner.permits`: logging in is acting); a comment says how
    many of others' were left out."""
    with app.db.session() as s:
        running, others = permits.sort_out(
            app,
            s.scalars(
                select(Machine)
                .where(Machine.status.in_((S.PENDING, S.RUNNING)), Machine.public_ip.is_not(None))
                .order_by(Machine.name)
            ).all(),
        )
    lines = [
        "# Written by provisioner: one Host per running machine. Rewritten by up, start, stop",
        "# and down once `provisioner ssh-config --install` made it; do not edit.",
    ]
    if (left := permits.left_out(others, "log in to")) is not None:
        lines.append(f"# {left}")
    for m in running:
        provider = app.provider(m.cloud or "")
        lines += [
            "",
            f"Host {m.name}",
            f"    HostName {m.public_ip}",
            f"    User {provider.ssh_user}",
            f"    Port {provider.ssh_port}",
        ]
        key = private_key(app, m)
        if key is not None:
            lines += [f"    IdentityFile {_quoted(key)}", "    IdentitiesOnly yes"]
        lines += [
            "    StrictHostKeyChecking accept-new",
            f"    UserKnownHostsFile {_quoted(known_hosts(app))}",
            f"    HostKeyAlias {host_alias(m)}",
        ]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    """``text`` at ``path`` (0600), replaced whole: a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def install(app: App) -> list[str]:
    """Write the config to the home and include it from ``~/.ssh/config`` (once, at the top:
    an ``Include`` after a ``Host`` line would apply to that host only). What was done."""
    path = config_path(app)
    _write(path, ssh_config(app))
    said = [f"wrote {path}"]
    user_dir = Path.home() / ".ssh"
    user_config = user_dir / "config"
    include = f"Include {_quoted(path)}"
    if not user_dir.exists():
        user_dir.mkdir(mode=0o700, parents=True)
    try:
        old = user_config.read_text()
    except FileNotFoundError:
        old = None
    if old is not None and any(line.strip() == include for line in old.splitlines()):
        said.append(f"{tilde(user_config)} already includes it")
    elif old is None:
        _write(user_config, include + "\n")
        said.append(f"created {tilde(user_config)} (0600) with `{include}`")
    else:
        mode = user_config.stat().st_mode & 0o777
        _write(user_config, f"{include}\n\n{old}")
        user_config.chmod(mode)
        said.append(f"added `{include}` at the top of {tilde(user_config)}")
    return said


def refresh(app: App) -> None:
    """Rewrite the installed config (it exists only once ``--install`` made it)."""
    if config_path(app).exists():
        _write(config_path(app), ssh_config(app))


def refreshed(app: App) -> str | None:
    """:func:`refresh` after a machine came, went or moved; when the file cannot be written,
    why (a warning: the command's own work is done)."""
    try:
        refresh(app)
    except OSError as e:
        return f"could not rewrite {config_path(app)}: {e}"
    return None
