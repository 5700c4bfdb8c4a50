"""The clock is the clock: a simulated one (``PROVISIONER_CLOCK``) serves what-ifs and tests.

A state records, when it is made, whether a simulated clock was in force then (``state_meta``
``clock = simulated``: :meth:`provisioner.state.Database.migrate`); a state that exists is never
marked later. On a *real* state — every state made on the wall clock, a team's on PostgreSQL,
whose members cannot write ``state_meta`` — a command on a simulated clock may look (``plan``,
``report``, ``status`` as recorded, ``events``…) but writes nothing and acts on no cloud: a
budget, an event or a ledger row dated in another year would be everyone's. A command that
writes or acts (the CLI marks every one not in ``cli.WHAT_IFS``: a new one acts until listed)
is refused with one line (exit 2) before it reads its input (:func:`refuse_early`) and, in any
case, when it opens the state (:func:`on_real_state`); :func:`require_real_clock` is the one
call for anything else. Whatever a looking command would write or do is refused the same way
at the database (:func:`refuse_writes`) and at the provider (:class:`LookOnly`), so what
nobody listed cannot slip through. On a simulated state — the tests', a throwaway what-if's —
everything runs on its clock, and ``status`` says so.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from provisioner.clock import CLOCK_ENV
from provisioner.errors import UserError

if TYPE_CHECKING:
    from provisioner.state import Database

#: what ``status`` of a simulated state says, whatever the clock (on stderr: its table and JSON
#: stay as they are)
SIMULATED_NOTE = (
    f"this state was made on a simulated clock ({CLOCK_ENV}): its times and money are a"
    " simulation, not a bill"
)


def what_if_note(now: datetime) -> str:
    """What ``status`` on a simulated clock over a real state says: it shows the state as
    recorded, at that instant (reconciling with the clouds would write)."""
    return (
        f"{CLOCK_ENV}: a what-if at {now:%Y-%m-%d %H:%M} UTC: the machines as recorded,"
        " not asked of the clouds (a what-if writes nothing)"
    )


def status_clock(app: Any) -> tuple[str | None, bool]:
    """What ``status`` says of its clock (or None), and whether it may ask the clouds first
    (reconciling writes what they answer)."""
    if app.db.simulated:
        return SIMULATED_NOTE, True
    if app.clock.simulated:
        return what_if_note(app.clock.now()), False
    return None, True


class RealClockOnly(UserError):
    """A command that writes the state or acts on a cloud, on a simulated clock over a real
    state."""


def what_if(app: Any) -> bool:
    """Whether ``app`` runs on a simulated clock over a real state: it may look, not write or
    act. False on the wall clock without opening the state."""
    return bool(app.clock.simulated) and not app.db.simulated


ACTS = "writes the state and acts on a cloud"


def refusal(command: str | None, does: str = ACTS) -> RealClockOnly:
    """The one line that refuses ``command`` (e.g. ``up``, ``token create``)."""
    what = f"`{command}`" if command else "this command"
    return RealClockOnly(
        f"{CLOCK_ENV} moves time for plan and report what-ifs only; {what} {does} on the real"
        f" clock (unset {CLOCK_ENV})"
    )


def require_real_clock(app: Any, command: str | None = None, does: str = ACTS) -> None:
    """Refuse (:class:`RealClockOnly`) a command that writes the state or acts on a cloud
    (or, as ``does`` says, elsewhere) when ``app`` runs on a simulated clock over a real
    state: the one call such a command makes before it does anything (the CLI makes it for
    every command that is not a what-if)."""
    if what_if(app):
        raise refusal(command or app.command, does)


def refuse_early(app: Any) -> None:
    """Refuse a command that acts, on a simulated clock, over a real state, before it reads
    its input; a state not there yet is left to be made (on this clock: a simulated one)."""
    if app.clock.simulated and app.acts and _state_exists(app.settings.database_url):
        app.db  # noqa: B018  (opening it refuses: on_real_state)


def _state_exists(url: str) -> bool:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[1] if "///" in url else ""
        return (
            bool(path)
            and path != ":memory:"
            and Path(path).is_file()
            and bool(Path(path).stat().st_size)
        )
    from provisioner.state import Database

    db = Database(url)
    try:
        return db.revision() is not None
    finally:
        db.dispose()


def on_real_state(app: Any, db: Database) -> None:
    """``app``, on a simulated clock, opened ``db``, a real state: a command that acts is
    refused now, before it writes or acts; one that looks may read, never write."""
    if app.acts:
        raise refusal(app.command)
    refuse_writes(db, app.command)


def refuse_writes(db: Database, command: str | None) -> None:
    """From now on, every statement that would change ``db`` raises :func:`refusal` of
    ``command`` before it reaches the database (its transaction is rolled back)."""
    db.refuse_writes(refusal(command), cause="clock")


#: what a provider and its volumes do to a cloud, rather than ask of it
_ACTS = frozenset(
    {"launch", "stop", "start", "terminate", "stop_many", "terminate_many", "put_files"}
    | {"start_job"}
)
_VOLUME_ACTS = frozenset({"create", "attach", "detach", "delete"})


class LookOnly:
    """A provider (or its volumes) that may be asked but not act: each act raises
    :func:`refusal` of the command, before any call reaches the cloud. What the App gives on a
    simulated clock over a real state (:meth:`provisioner.app.App.provider`)."""

    def __init__(self, inner: Any, command: str | None, acts: frozenset[str] = _ACTS) -> None:
        self._inner, self._command, self._acts = inner, command, acts

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name in self._acts:
            return self._refused
        if name == "volumes" and value is not None:
            return LookOnly(value, self._command, _VOLUME_ACTS)
        if name == "unused_network":
            return self._unused_network
        return value

    def _refused(self, *_: Any, **__: Any) -> Any:
        raise refusal(self._command)

    def _unused_network(self, *, remove: bool = False) -> list[str]:
        if remove:
            raise refusal(self._command)
        found: list[str] = self._inner.unused_network(remove=False)
        return found
