"""Recover: a preempted spot machine → relaunched per its spec's ``on_preemption``, within policy
and budget, with backoff. Where its cloud kept it stopped with its disk
(``Capabilities.restart_preempted`` and the cloud still has it) it is started again in place:
the same machine, the same disk. Only when the cloud has no room to start it (CapacityError), or
no longer has it, is a new machine launched: its zone and region first, then the planner's next
candidates.

Tries are counted from the machine's events since its last preemption (so a restart or another
scheduler continues the count): each capacity failure is a ``recover-failed`` event; a refusal by
policy or budget is one ``relaunch-refused`` event, whose numbers a retry refused alike updates
in place (see :func:`provisioner.machines.hold`). Try n+1 waits ``backoff(n)`` after try n; after
``MAX_ATTEMPTS`` tries one ``relaunch-gave-up`` event ends the retries and the machine stays held.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from sqlalchemy import select
from sqlalchemy.orm import Session

import providers
from providers.base import CapacityError, MachineState, NotFound, ProviderError
from provisioner import machines, notify
from provisioner.app import App
from provisioner.crashpoints import crashpoint
from provisioner.errors import ProvisionerError, UserError
from provisioner.jobs.lease import HOLDER, Held, run_pass
from provisioner.jobs.passes import Action, Pass, act
from provisioner.machines import workdirs
from provisioner.models import ACTIVE_EXCLUDED, Event, Machine
from provisioner.schema import EventKind as K
from provisioner.schema import MachineStatus as S
from provisioner.spec import Experiment
from provisioner.state import machine as machine_row
from provisioner.tries import MAX_ATTEMPTS, Tries, backoff, events, tries, utc

GONE = "the cloud no longer has it"
ENDED = (S.TERMINATED.value, S.FAILED.value)


def refused_by(error: str) -> str:
    """What refused a relaunch, from the refusal's first words: ``policy for NAME``, ``budget
    NAME (PERIOD)`` or ``no offer fits NAME``. The same refuser on the next try is the same
    refusal (its numbers, which move as the disk bills, are updated)."""
    head = error.split(":", 1)[0].strip()
    return head.removeprefix("refused by ").strip() or error


def held_line(t: Tries, now: datetime, zone: ZoneInfo | None = None) -> str | None:
    """``status NAME``'s and the dashboard's "held" line for a machine held after a refused
    relaunch (None: not held): what refused it, the numbers, and the next try or the give-up;
    times in ``zone`` (UTC)."""
    if t.refusal is None:
        if t.gave_up is None:
            return None
        return f"relaunch gave up after {_times(t.attempts)} at {_at(t.gave_up.at, now, zone)}"
    d = t.refusal.detail or {}
    error = " ".join(str(d.get("refused", "")).split())
    numbers = error.partition(":")[2]
    text = f"relaunch refused by {refused_by(error)}"
    if numbers.strip():
        text += f": {numbers.strip()}"
    if t.gave_up is not None:
        return f"{text}; gave up after {_times(t.attempts)} at {_at(t.gave_up.at, now, zone)}"
    text += f"; {t.attempts} of {MAX_ATTEMPTS} tries"
    nxt = t.next_try
    return text + (f", next try {_at(nxt, now, zone)}" if nxt is not None else "")


def _times(n: int) -> str:
    return "1 try" if n == 1 else f"{n} tries"


def _at(at: datetime, now: datetime, zone: ZoneInfo | None = None) -> str:
    from provisioner.clock import zoned

    return zoned(utc(at), now, zone or ZoneInfo("UTC"))


def stored_experiment(m: Machine) -> Experiment:
    """The experiment a machine was launched from, read back from the state."""
    return Experiment.model_validate(m.spec)


def run(
    app: App, now: datetime | None = None, *, dry_run: bool = False, holder: str = HOLDER
) -> Pass:
    when = now or app.clock.now()
    app.policies  # noqa: B018

    def body(lease: Held) -> Pass:
        result = Pass("recover", dry_run=dry_run)
        todo = []
        for m, t in _to_recover(app):
            result.checked += 1
            if not dry_run and t.replaced_by is not None and t.replacement in ENDED:
                t = _replacement_ended(app, m, t)
            action = _decide(m, t, when)
            if action is not None:
                result.actions.append(action)
                todo.append((action, m, t))
        if dry_run:
            return result
        # a relaunch can take minutes: the lease is kept before each machine
        for action, m, t in lease.each(todo, lambda x: [x[0]]):
            if action.action == "terminate":
                act(app, action)
                _restore_name(app, m)  # one kept for its replacement: its name back, ended
                continue
            if action.action in ("start", "relaunch"):
                _recover(app, m, action, t, when)
                if action.done or t.attempts + 1 < MAX_ATTEMPTS:
                    continue
            _give_up(app, m, action, when)
        return result

    return run_pass(app, "recover", when, body, holder=holder, dry_run=dry_run)


def _decide(m: Machine, t: Tries, now: datetime) -> Action | None:
    """What recovery does to a lost machine now: per its spec's ``on_preemption``, with the
    backoff of its failed tries; None: nothing (left, given up, or waiting)."""
    mode = stored_experiment(m).lifecycle.on_preemption
    if mode == "leave" or t.gave_up is not None:
        return None
    if mode == "terminate":
        return Action(m.name, "terminate", "preempted", "on_preemption: terminate")
    if t.replaced_by is not None and t.replacement not in ENDED:
        if t.replacement == S.RUNNING:  # its replacement runs: now its disk may go
            why = (
                f"kept with its disk until its replacement ran: {t.replaced_by} runs; "
                "terminated now"
            )
            return Action(m.name, "terminate", "preempted", why)
        return None  # its replacement is launching: it keeps its disk until that one runs
    if t.attempts >= MAX_ATTEMPTS:  # the last try's pass ended before it could give up
        return Action(m.name, "give-up", "preempted", f"{t.attempts} tries")
    if t.next_try is not None and now < t.next_try:
        return None
    return _try_again(m, t)


def _try_again(m: Machine, t: Tries) -> Action:
    """The next try of ``on_preemption: relaunch``: start in place where the cloud keeps the
    machine (a relaunch, near it first, if it has no room), else relaunch near it first."""
    near = m.zone or m.region or "?"
    try_n = f"(try {t.attempts + 1} of {MAX_ATTEMPTS})"
    if _restartable(m):
        why = (
            f"on_preemption: relaunch, start in place in {near} (same machine, same disk); "
            f"relaunch, {near} first, if it has no room {try_n}"
        )
        return Action(m.name, "start", "preempted", why)
    return Action(m.name, "relaunch", "preempted", f"on_preemption: relaunch, {near} first {try_n}")


def _restartable(m: Machine) -> bool:
    """Whether ``m`` is a preempted machine its cloud keeps, stopped with its disk, and can
    start again (per the cloud's capabilities; whether it still has it, ``get`` says)."""
    return (
        m.status == S.PREEMPTED
        and m.cloud in providers.REGISTRY
        and providers.spec(m.cloud).capabilities.restart_preempted
    )


def _kept(app: App, m: Machine) -> bool:
    """Whether the cloud still has the preempted machine (stopped, or already started again):
    not deleted, not terminated. An error other than NotFound is left to the start to meet."""
    try:
        inst = app.provider(m.cloud or "").get(machines.ref(m))
    except NotFound:
        return False
    except (ProviderError, UserError):
        return True
    return inst.state is not MachineState.TERMINATED


def _give_up(app: App, m: Machine, action: Action, now: datetime) -> None:
    """One ``relaunch-gave-up`` event with the numbers; the machine stays held as it is."""
    with app.db.session() as s:
        t = tries(events(s, m.id))
    if t.gave_up is not None:
        return
    last = action.error or ""
    refused = (t.refusal.detail or {}).get("refused") if t.refusal is not None else None
    detail = {
        "why": f"gave up relaunching after {t.attempts} tries ({MAX_ATTEMPTS} at most); "
        "no more retries, the machine stays as it is",
        "attempts": t.attempts,
        "last_try": (t.last or now).isoformat(),
        "error": " ".join(last.split()),
        **({"refused": refused} if refused else {}),
    }
    machines.record_event(app, m.id, K.RELAUNCH_GAVE_UP, reason="preempted", detail=detail)
    _tell(app, m, "relaunch-gave-up", f"relaunch-gave-up:{m.id}", why=detail["why"])
    action.why += f"; gave up after {t.attempts} tries"
    action.done = action.done or action.action == "give-up"


def _to_recover(app: App) -> list[tuple[Machine, Tries]]:
    """Preempted machines, and those lost after a try (terminated to be relaunched, or held
    where the cloud could not keep them) with no machine of that name since; each with its
    tries. Given-up machines are left out: they are no longer retried."""
    with app.db.session() as s:
        preempted = {
            m.id: m for m in s.scalars(select(Machine).where(Machine.status == S.PREEMPTED))
        }
        out: list[tuple[Machine, Tries]] = []
        for mid in sorted(set(preempted) | _lost(s), key=lambda i: (i not in preempted, i)):
            m = preempted.get(mid) or machine_row(s, mid)
            evs = events(s, mid)
            t = tries(evs)
            if t.gave_up is not None or not evs:
                continue
            if m.status == S.PREEMPTED:
                _note_replacement(s, t)
                out.append((m, t))
            elif m.status == S.TERMINATED and _awaits_relaunch(s, m, evs[-1]):
                out.append((m, t))
        return out


_LOST = (K.RECOVER_FAILED, K.RELAUNCH_REFUSED)  # a try's events that leave a machine lost


def _lost(s: Session) -> set[str]:
    """The ids of machines a try left lost (a failed recovery, a refused relaunch) or that
    were terminated after a preemption."""
    return set(s.scalars(select(Event.machine_id).where(Event.kind.in_(_LOST)).distinct())) | set(
        s.scalars(
            select(Event.machine_id)
            .where(Event.kind == K.TERMINATED, Event.reason == "preempted")
            .distinct()
        )
    )


def _note_replacement(s: Session, t: Tries) -> None:
    """Set the status of the machine a try launched to replace a preempted one (failed when
    its row is gone) on ``t``."""
    if t.replaced_by is not None:
        new = s.get(Machine, t.replaced_by)
        t.replacement = new.status if new is not None else S.FAILED.value


def _awaits_relaunch(s: Session, m: Machine, latest: Event) -> bool:
    """A terminated machine whose last event (``latest``) leaves it to be relaunched — a try
    lost it, a relaunch was interrupted or refused — with no live machine of its name since
    (one still "requested" is a relaunch killed mid-`up`: resuming it finishes the job)."""
    interrupted = latest.kind == K.TERMINATED and (latest.detail or {}).get("relaunching")
    held = latest.kind == K.TERMINATED and latest.reason == "relaunch-refused"
    if not (latest.kind in _LOST or interrupted or held):
        return False
    live = s.scalars(
        select(Machine.status).where(Machine.name == m.name, Machine.status.not_in(ACTIVE_EXCLUDED))
    ).first()
    return live in (None, S.REQUESTED)


def _near(m: Machine) -> Callable[[Any], int]:
    def rank(c: Any) -> int:
        o = c.offer
        if o.cloud == m.cloud and o.zone and o.zone == m.zone:
            return 0
        return 1 if (o.cloud, o.region) == (m.cloud, m.region) else 2

    return rank


def _recover(app: App, m: Machine, action: Action, t: Tries, now: datetime) -> None:
    """Start the machine in place where its cloud kept it (``start``); relaunch it where the
    cloud did not, or no longer has it, or has no room to start it."""
    if m.status == S.PREEMPTED and m.name != stored_experiment(m).name:
        _restore_name(app, m)  # set aside by a try that ended before its `up` did anything
        with app.db.session() as s:
            m = machine_row(s, m.id)
    instead = None
    if action.action == "start":
        instead = _start_in_place(app, m, action, t, now)
        if instead is None:
            return
        action.action, action.why = "relaunch", f"{action.why}; {instead}"  # what is done
    _relaunch(app, m, stored_experiment(m), action, t, now, instead)


def _start_in_place(app: App, m: Machine, action: Action, t: Tries, now: datetime) -> str | None:
    """Start the preempted machine again where its cloud keeps it, stopped with its disk: the
    same machine, within policy and budget for its own offer at its rate. None: settled here
    (started, held by a refusal, or a failed try); else why a new machine is launched instead."""
    gone = GONE
    try:
        if not _kept(app, m):
            return gone
        machines.restart(app, m, detail={"why": "started in place after its preemption"})
    except UserError as e:
        _hold(app, m, action, t, e, now)
        return None
    except CapacityError as e:
        return "no room to start it in place: " + " ".join(str(e).split())
    except NotFound:  # gone between the look and the start
        return gone
    except (ProviderError, ProvisionerError) as e:
        _failed(app, m, action, t.attempts + 1, e)
        return None
    action.done = True
    action.why += " → started in place"
    return None


def _relaunch(
    app: App,
    m: Machine,
    exp: Experiment,
    action: Action,
    t: Tries,
    now: datetime,
    instead: str | None = None,
) -> None:
    """Check the relaunch against policy and budget first (refused: the lost machine is held,
    see :func:`machines.hold`); then free the name (the lost machine is terminated: its disk
    still bills) and ``up`` with the lost zone and region first. ``instead``: why the machine
    was not started in place."""
    attempt = t.attempts + 1
    try:  # before anything is terminated: a refused relaunch keeps the machine and disk
        machines.check(app, exp)
    except UserError as e:
        _hold(app, m, action, t, e, now)
        return
    keep = False
    try:
        if m.status == S.PREEMPTED:
            keep = _keeps_disk(app, m, exp, instead)
            if keep:  # its name for the replacement; the machine and its disk stay as they are
                m = _set_aside(app, m)
            else:
                _release(app, m, exp, instead)
                crashpoint("recover-after-down")
        with workdirs.relaunching(m.id):  # the workdir as `up` took it, not as it is now
            result = machines.up(app, exp, spec_path=m.spec_path, prefer=_near(m))
    except (ProvisionerError, ProviderError) as e:
        if keep:
            _restore_name(app, m)
        _failed(app, m, action, attempt, e)
        return
    _relaunched(app, m, result.machine, action, instead, keep)


def _relaunched(
    app: App, m: Machine, new: Machine, action: Action, instead: str | None, keep: bool
) -> None:
    """Record the relaunch of ``m`` as ``new`` (on both, and in the action's words), tell its
    owner; a kept machine whose replacement runs already is retired now."""
    where = f"{new.cloud}/{new.zone or new.region}"
    action.done = True
    action.why += f" → relaunched, {where}" if instead else f" → {where}"
    detail: dict[str, Any] = {"machine": new.id, "where": where}
    if instead:
        detail["why"] = instead
    if keep:
        detail["kept"] = True
        detail["until"] = f"kept stopped with its disk until {new.id} runs"
        action.why += f"; {m.name} keeps its disk until the new machine runs"
    machines.record_event(app, m.id, K.RELAUNCHED, reason="preempted", detail=detail)
    machines.record_event(
        app, new.id, K.RECOVERED, reason="recovered", detail={"replaces": m.id, "lost_zone": m.zone}
    )
    _tell(app, m, "relaunched", f"relaunched:{m.id}:{new.id}", where=where)
    if keep and new.status == S.RUNNING:  # it runs already: the old machine's disk may go
        _retire(app, m, new)


def _keeps_disk(app: App, m: Machine, exp: Experiment, instead: str | None) -> bool:
    """Whether the preempted machine is kept, stopped with its disk, until its replacement
    runs: where its cloud still has it (not when the cloud deleted it, or ended it as AWS
    ends a one-time spot instance) and its owner did not say ``on_preemption_disk:
    release``."""
    if exp.lifecycle.on_preemption_disk == "release":
        return False
    if instead is not None and instead.startswith(GONE):
        return False
    return _restartable(m) and _kept(app, m)  # AWS ends a one-time spot instance itself


def _release(app: App, m: Machine, exp: Experiment, instead: str | None) -> None:
    """The preempted machine ended before the relaunch: where its cloud no longer has it, only
    in the state (nothing to call: its disk is gone already); where its owner said
    ``on_preemption_disk: release``, terminated in its cloud with its disk."""
    detail: dict[str, Any] = {"relaunching": True}
    if exp.lifecycle.on_preemption_disk == "release" and (
        instead is None or not instead.startswith(GONE)
    ):
        detail["why"] = "on_preemption_disk: release: terminated with its disk before the relaunch"
        machines.down(app, m.name, reason="preempted", detail=detail)
        return
    detail["why"] = "its cloud no longer has it (nor its disk): nothing to terminate"
    machines.transition(
        app, m.id, S.TERMINATED, event=K.TERMINATED, reason="preempted", detail=detail
    )


def _retire(app: App, m: Machine, new: Machine) -> None:
    """The replacement runs: the preempted machine kept for it is terminated now, its disk
    with it; the ledger bills that disk until this moment."""
    why = f"kept with its disk until its replacement ran: {new.id} runs; terminated now"
    act(app, Action(m.name, "terminate", "preempted", why))
    _restore_name(app, m)


def _replacement_ended(app: App, m: Machine, t: Tries) -> Tries:
    """The replacement ended before it ran (failed, or taken down): the preempted machine,
    still kept with its disk, takes its name back and is tried again."""
    machines.record_event(
        app,
        m.id,
        K.REPLACEMENT_ENDED,
        reason="preempted",
        detail={"machine": t.replaced_by, "why": "its replacement ended before it ran"},
    )
    _restore_name(app, m)
    with app.db.session() as s:
        return tries(events(s, m.id))


def _tell(app: App, m: Machine, topic: str, key: str, **values: Any) -> None:
    """The owner's and policies' channels told what became of a preempted machine."""
    where = values.pop("where", f"{m.cloud} {m.zone or m.region}")
    notice = notify.Notice(
        topic,
        key,
        notify.texts(topic, machine=m.name, where=where, **values),
        machine=m.name,
        link=f"/machine/{m.name}",
        extra=values,
    )
    notify.tell(app, notice, m.project, m.owner)


def _hold(app: App, m: Machine, action: Action, t: Tries, e: UserError, now: datetime) -> None:
    """Policy or budget refused the try: the machine is held (one ``relaunch-refused`` event, a
    refusal alike updating it in place), with the next try's time."""
    action.error = str(e)
    attempt = t.attempts + 1
    before = (t.refusal.detail or {}) if t.refusal is not None else {}
    same = t.refusal if refused_by(before.get("refused", "")) == refused_by(str(e)) else None
    detail: dict[str, Any] = {
        "by": refused_by(str(e)),
        "attempts": int(before.get("attempts", 1)) + 1 if same is not None else 1,
        "last_try": now.isoformat(),
    }
    if attempt < MAX_ATTEMPTS:
        detail["next_try"] = (now + backoff(attempt)).isoformat()
    machines.hold(app, m, str(e), detail, event_id=same.id if same is not None else None)
    _tell(app, m, "relaunch-refused", f"relaunch-refused:{m.id}:{detail['by']}", why=str(e))


def _failed(
    app: App, m: Machine, action: Action, attempt: int, e: ProviderError | ProvisionerError
) -> None:
    """A try that failed (no room anywhere, the cloud refused): one ``recover-failed`` event; the
    next try waits the backoff."""
    action.error = str(e)
    machines.record_event(
        app,
        m.id,
        K.RECOVER_FAILED,
        reason="preempted",
        detail={"attempt": attempt, "error": str(e)},
    )
    why = " ".join(str(e).split())
    _tell(app, m, "relaunch-failed", f"relaunch-failed:{m.id}:{attempt}", why=why, attempt=attempt)


def aside_name(m: Machine) -> str:
    """The name a preempted machine kept for its replacement goes by meanwhile (a ``.``, which
    no experiment's name has, so it never meets one): ``NAME.preempted-ID``."""
    return f"{stored_experiment(m).name}.preempted-{m.id[:8]}"


def _set_aside(app: App, m: Machine) -> Machine:
    """The preempted machine gives its name to its replacement (one live machine per name) and
    stays as it is, stopped with its disk, billed for that disk (``preempted``)."""
    name = aside_name(m)
    with app.db.session() as s:
        row = machine_row(s, m.id)
        if row.name != name:
            row.name = name
    machines.record_event(
        app,
        m.id,
        K.KEPT_FOR_RELAUNCH,
        reason="preempted",
        detail={
            "as": name,
            "why": "kept stopped with its disk until a replacement runs; its name goes to the "
            "replacement",
        },
    )
    with app.db.session() as s:
        return machine_row(s, m.id)


def _restore_name(app: App, m: Machine) -> None:
    """The preempted machine takes its own name back: once it ended (its history under its
    name, as every relaunched machine's), or while live if no live machine has it meanwhile."""
    own = stored_experiment(m).name
    with app.db.session() as s:
        row = machine_row(s, m.id)
        if row.name == own:
            return
        if not row.is_live:
            row.name = own
            return
        taken = s.scalars(
            select(Machine.id).where(Machine.name == own, Machine.status.not_in(ACTIVE_EXCLUDED))
        ).first()
        if taken is None:
            row.name = own
