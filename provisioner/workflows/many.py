"""``stop``, ``start`` and ``down`` of one machine or many: named, or every machine the action
applies to (in one project); several are confirmed once (``confirm``), each is acted on in turn
and reported as it goes (``progress``); one machine's failure is its own.

Who may act on which (:mod:`provisioner.permits`): a named machine of someone else's is that
name's failure, in the refusal's words (exit 2); machines chosen by what they are are only
those who acts may act on, and :attr:`Many.left_out` counts the others'."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from sqlalchemy import select

from provisioner import keys, machines, permits
from provisioner.app import App
from provisioner.errors import ProvisionerError
from provisioner.models import Machine
from provisioner.schema import MachineStatus
from provisioner.state import live_machine

S = MachineStatus
Op = Literal["stop", "start", "down"]
#: the statuses each action applies to, when the machines are chosen by --all or --project
APPLIES: dict[Op, tuple[MachineStatus, ...]] = {
    "stop": (S.RUNNING, S.PENDING),
    "start": (S.STOPPED,),
    "down": (S.REQUESTED, S.WAITING, S.PENDING, S.RUNNING, S.STOPPING, S.STOPPED, S.PREEMPTED),
}


@dataclass(frozen=True)
class ManyRequest:
    op: Op
    names: list[str] = field(default_factory=list)  # none: every machine ``op`` applies to
    project: str | None = None  # ...in this project


@dataclass(frozen=True)
class Acted:
    name: str
    machine: Machine
    changed: bool  # False: it already was stopped / running / gone
    before: str | None = None  # a ``down``'s status before: a cancelled intent says so

    @property
    def cancelled(self) -> str | None:
        """``waiting`` or ``requested``: an intent never launched, cancelled (None: not)."""
        if self.machine.status == S.FAILED and self.before in (S.WAITING, S.REQUESTED):
            return self.before
        return None


@dataclass(frozen=True)
class Failed:
    name: str
    error: str
    exit_code: int


@dataclass
class Many:
    chosen: list[str]  # empty: no machine to act on
    results: list[Acted | Failed] = field(default_factory=list)
    warning: str | None = None  # the ssh-config could not be rewritten
    left_out: int = 0  # machines of others the selection applied to, left out: not theirs

    @property
    def left_out_line(self) -> str | None:
        """One line saying how many machines of others were left out (None: none)."""
        return permits.left_out(self.left_out)

    @property
    def exit_code(self) -> int:
        """0; else the failures' highest when every one failed, else 1."""
        failed = [r.exit_code for r in self.results if isinstance(r, Failed)]
        if not failed:
            return 0
        return max(failed) if len(failed) == len(self.results) else 1


def act(
    app: App,
    request: ManyRequest,
    *,
    confirm: Callable[[list[str]], None] = lambda _: None,
    progress: Callable[[Acted | Failed], None] = lambda _: None,
) -> Many:
    """``request.op`` on each chosen machine in turn. ``confirm`` is asked (it raises to
    refuse) before acting on several or on machines chosen by what they are."""
    left_out = 0
    chosen = list(dict.fromkeys(request.names))
    if not chosen:
        chosen, left_out = _select(app, request.project, APPLIES[request.op])
    if not chosen:
        return Many([], left_out=left_out)
    if not request.names or len(chosen) > 1:
        confirm(chosen)
    done = Many(chosen, left_out=left_out)
    for name in chosen:
        result = _one(app, request.op, name)
        done.results.append(result)
        progress(result)
    done.warning = keys.refreshed(app)
    return done


def _one(app: App, op: Op, name: str) -> Acted | Failed:
    try:
        before = _status_of(app, name) if op == "down" else None
        do = {"stop": machines.stop, "start": machines.start, "down": machines.down}[op]
        m, changed = do(app, name)
    except ProvisionerError as e:
        return Failed(name, str(e), e.exit_code)
    return Acted(name, m, changed, before)


def _select(
    app: App, project: str | None, applies: tuple[MachineStatus, ...]
) -> tuple[list[str], int]:
    """The names of the machines ``applies`` to (in ``project``) that who acts may act on,
    and how many of others' were left out."""
    q = (
        select(Machine)
        .where(Machine.status.in_(applies))
        .order_by(Machine.created_at, Machine.name)
    )
    if project:
        q = q.where(Machine.project == project)
    with app.db.session() as s:
        mine, others = permits.sort_out(app, s.scalars(q))
    return list(dict.fromkeys(m.name for m in mine)), others


def _status_of(app: App, name: str) -> str | None:
    with app.db.session() as s:
        m = live_machine(s, name)
    return None if m is None else m.status
