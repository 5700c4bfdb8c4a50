"""Waiting for capacity: ``up --retry-until-up [--timeout 6h]`` and ``lifecycle.on_no_capacity:
{wait: 6h}``.

When every candidate an ``up`` tried lacked capacity (and nothing failed for another reason:
quota, credentials, settings, a bad request fail at once as before) and a wait was asked, the
intent is queued as ``waiting`` instead of failed: one ``waiting`` event per round says since
when, until when, which round, the next try and what was tried. It bills nothing and budgets
do not count it.

A try (:func:`try_once`: the foreground ``up`` or the scheduler's pass,
:mod:`provisioner.jobs.waiting`) holds the intent's lock, so two never run at once; gives up at
the deadline (``wait-gave-up``); re-checks policy and budget, and a refusal ends the wait
(``wait-refused``, with the refusal's words); then, under the ``intents`` lock as ``up``, makes
the intent ``requested`` again (budgets count it while it launches, at its first candidate's
rate) and walks every candidate with the intent's launch tokens. A try that died midway left
the intent ``requested``: the next one adopts what it launched before anything else, as a
rerun of ``up`` does. Round n+1 is due :func:`backoff` (n) after round n — 1, 2, 4, 8, then
every 15 minutes — counted from the events, so a restart continues the count.

Whoever ends a wait tells the owner by mail, once: launched, given up, or refused (the mail's
outcome is in the ending event). A ``down`` cancels the wait (:func:`provisioner.machines.down`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

from sqlalchemy import select

from provisioner import ledger, mail, notify
from provisioner.app import App
from provisioner.console import plural
from provisioner.errors import OperationFailed, ProvisionerError, UserError
from provisioner.fleet import at_text, failure, waiting_line
from provisioner.machines import launch
from provisioner.machines.attempts import LaunchAttempt
from provisioner.machines.record import provider_call, set_rates, transition
from provisioner.models import Event, Machine
from provisioner.planner import Candidate
from provisioner.schema import INTENTS, AttemptOutcome, EventKind, MachineStatus
from provisioner.spec import Experiment
from provisioner.state import LockBusy, live_machine
from provisioner.state import machine as machine_row

S = MachineStatus
DEFAULT_WAIT = timedelta(hours=6)  # `--retry-until-up` without --timeout or on_no_capacity
BACKOFF = timedelta(minutes=1)  # after the first round without capacity; doubled per round …
BACKOFF_MAX = timedelta(minutes=15)  # … up to this
LOCK_WAIT = 600.0  # how long the foreground waits for another process's try of the intent


def backoff(rounds: int) -> timedelta:
    """The wait after ``rounds`` rounds without capacity before the next: 1, 2, 4, 8, 15 … min."""
    return min(BACKOFF * 2 ** max(rounds - 1, 0), BACKOFF_MAX)


@dataclass(frozen=True)
class Wait:
    """An intent's wait, as its latest ``waiting`` event records it."""

    since: datetime
    until: datetime  # the deadline: given up from then on
    rounds: int  # rounds that found no capacity
    next_try: datetime  # never after ``until``
    detail: dict[str, Any]  # the event's: :func:`provisioner.fleet.waiting_line` reads it


class StillWaiting(OperationFailed):
    """A round found no capacity anywhere: the intent waits (its next try is due later)."""

    def __init__(self, message: str, machine_id: str, wait: Wait) -> None:
        super().__init__(message)
        self.machine_id, self.wait = machine_id, wait


def _utc(at: datetime) -> datetime:
    """SQLite gives back naive UTC date-times."""
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def wait_of(events: list[Event]) -> Wait | None:
    """The wait of an intent with these ``events`` (oldest first); None: it never waited."""
    latest = next((e for e in reversed(events) if e.kind == EventKind.WAITING), None)
    return None if latest is None else _wait(latest.detail or {})


def _wait(d: dict[str, Any]) -> Wait:
    def at(key: str) -> datetime:
        return _utc(datetime.fromisoformat(d[key]))

    return Wait(at("since"), at("until"), int(d["round"]), at("next_try"), d)


def _events(app: App, machine_id: str) -> tuple[Machine, list[Event]]:
    with app.db.session() as s:
        m = machine_row(s, machine_id)
        events = list(
            s.scalars(select(Event).where(Event.machine_id == machine_id).order_by(Event.id))
        )
    return m, events


def state(app: App, machine_id: str) -> tuple[Machine, Wait | None]:
    """The intent and its wait, read now."""
    m, events = _events(app, machine_id)
    return m, wait_of(events)


def queued(app: App) -> list[tuple[Machine, Wait]]:
    """Every waiting intent, and every intent whose try stopped midway (``requested`` after a
    ``waiting`` event: its process died, or still runs — the intent's lock tells), with its
    wait; oldest first."""
    with app.db.session() as s:
        in_wait = select(Event.machine_id).where(Event.kind == EventKind.WAITING)
        ids = list(
            s.scalars(
                select(Machine.id)
                .where(
                    (Machine.status == S.WAITING)
                    | ((Machine.status == S.REQUESTED) & Machine.id.in_(in_wait))
                )
                .order_by(Machine.created_at, Machine.name)
            )
        )
    out = []
    for mid in ids:
        m, w = state(app, mid)
        if w is not None:
            out.append((m, w))
    return out


# --- the end of a round: waiting (again), or given up ------------------------------------------


def settle(app: App, wait: timedelta | None) -> launch.NoCapacity:
    """:data:`provisioner.machines.launch.NoCapacity` for a wait of ``wait`` from the intent's
    request (a later round keeps the deadline its first round set)."""

    def no_capacity(m: Machine, attempts: list[LaunchAttempt]) -> NoReturn:
        now = app.clock.now()
        _, w = state(app, m.id)
        since = w.since if w else _utc(m.created_at)
        until = w.until if w else since + (wait or DEFAULT_WAIT)
        rounds = (w.rounds if w else 0) + 1
        full = [a.where for a in attempts if a.outcome == AttemptOutcome.CAPACITY]
        if now >= until:
            _give_up(app, m, since, until, rounds)
        nxt = min(now + backoff(rounds), until)
        detail: dict[str, Any] = {
            "since": since.isoformat(),
            "until": until.isoformat(),
            "round": rounds,
            "next_try": nxt.isoformat(),
            "tried": full,
        }
        detail["why"] = (
            f"no capacity in {plural(len(full), 'candidate')} tried ({', '.join(full[:6])}"
            f"{', …' if len(full) > 6 else ''}); {waiting_line(detail, now)}"
        )
        transition(
            app, m.id, S.WAITING, event=EventKind.WAITING, reason="no-capacity", detail=detail
        )
        raise StillWaiting(f"{m.name}: round {rounds}: {detail['why']}", m.id, _wait(detail))

    return no_capacity


def _give_up(app: App, m: Machine, since: datetime, until: datetime, rounds: int) -> NoReturn:
    """The deadline passed: the intent fails (``wait-gave-up``) and its owner is told."""
    now = app.clock.now()
    why = (
        f"gave up waiting for capacity at {at_text(until, now)}: no capacity in "
        f"{plural(rounds, 'round')} since {at_text(since, now)}; nothing was launched"
    )
    detail = {"why": why, "since": since.isoformat(), "until": until.isoformat(), "rounds": rounds}
    detail.update(
        _tell(
            app,
            m,
            f"provisioner: {m.name} not launched: no capacity until {until:%H:%M} UTC",
            f"{m.name} (project {m.project}) was not launched: {why}. Nothing of it bills.\n\n"
            "To try again, run `provisioner up` with its experiment file"
            + (f" ({m.spec_path})" if m.spec_path else "")
            + ", perhaps with more clouds, regions or GPU types allowed.\n",
        )
    )
    transition(
        app, m.id, S.FAILED, event=EventKind.WAIT_GAVE_UP, reason="no-capacity", detail=detail
    )
    raise OperationFailed(f"{m.name}: {why}; nothing bills")


def _refused(app: App, m: Machine, err: UserError) -> NoReturn:
    """Policy or budget (or the catalog) no longer allows the intent: the wait ends, failed
    (``wait-refused``), its owner told."""
    words = " ".join(str(err).split())
    head = words.split(":", 1)[0]
    by = "policy" if "by policy" in head else "budget" if "by budget" in head else "no-offer"
    why = f"the wait for capacity ended: {words}"
    detail: dict[str, Any] = {"why": why, "refused": str(err)}
    detail.update(
        _tell(
            app,
            m,
            f"provisioner: {m.name} not launched: "
            + ("no offer fits" if by == "no-offer" else f"refused by {by}"),
            f"{m.name} (project {m.project}) waited for capacity and was not launched:\n"
            f"{err}\n\nNothing of it bills.\n",
        )
    )
    transition(app, m.id, S.FAILED, event=EventKind.WAIT_REFUSED, reason=by, detail=detail)
    raise UserError(f"{m.name}: {why}")


def _launched(app: App, m: Machine, w: Wait) -> None:
    """The wait ended with a launch: its owner is told (the event says whether the mail went)."""
    now = app.clock.now()
    why = (
        f"launched on {m.cloud} {m.zone or m.region} after waiting for capacity since "
        f"{at_text(w.since, now)} ({plural(w.rounds + 1, 'round')})"
    )
    rate = f"{m.rate} {m.currency}/h" if m.rate is not None else "its rate"
    detail: dict[str, Any] = {"why": why}
    detail.update(
        _tell(
            app,
            m,
            f"provisioner: {m.name} launched after waiting for capacity",
            f"{m.name} (project {m.project}) was {why}: {m.instance_type}, "
            f"{m.gpu_count}×{m.gpu} {m.market}, at {rate} from {now:%Y-%m-%d %H:%M} UTC.\n\n"
            f"Connect with `provisioner ssh {m.name}`; remove it with "
            f"`provisioner down {m.name}`.\n",
        )
    )
    with app.db.session() as s:
        s.add(
            Event(
                machine_id=m.id, at=now, kind=EventKind.WAIT_ENDED, reason="launched", detail=detail
            )
        )
    key = f"launched:{m.id}"
    notify.record_mail(
        app, key, "launched", [m.owner], f"{m.name} launched after waiting for capacity",
        detail.get("mail_error"), retried=False, machine=m.name,
    )  # fmt: skip
    notice = notify.Notice(
        "launched",
        key,
        notify.texts(
            "launched",
            machine=m.name,
            project=m.project,
            where=f"{m.cloud} {m.zone or m.region}",
            since=f"{w.since:%Y-%m-%d %H:%M} UTC",
        ),
        machine=m.name,
        link=f"/machine/{m.name}",
    )
    notify.tell(app, notice, m.project, m.owner)


def _tell(app: App, m: Machine, subject: str, text: str) -> dict[str, str]:
    """Mail the owner; a mail that cannot be sent never stops the wait's end: what happened
    goes in the event (``to``, or ``mail_error``)."""
    try:
        if "@" not in m.owner:
            raise UserError(f"owner {m.owner!r} is not an email address")
        smtp = app.settings.smtp
        mail.send(smtp, mail.compose(sender=smtp.sender, to=[m.owner], subject=subject, text=text))
    except ProvisionerError as e:
        return {"mail_error": str(e)}
    return {"to": m.owner}


# --- a try --------------------------------------------------------------------------------------


def try_once(
    app: App,
    machine_id: str,
    *,
    progress: launch.Progress = lambda _: None,
    lock_timeout: float = 0.0,
) -> launch.UpResult | None:
    """One try of a queued intent, when due: the launch, or None (not due yet, another process
    holds the intent — a try, or a `down` — or it is no longer queued). Raises
    :class:`StillWaiting` (no capacity this round), :class:`OperationFailed` (given up,
    cancelled) or :class:`UserError` (refused by policy or budget)."""
    held = ExitStack()
    try:
        held.enter_context(app.db.lock(f"intent-{machine_id}", timeout=lock_timeout))
    except LockBusy:
        return None
    with held:
        return _try(app, machine_id, progress)


def _try(app: App, machine_id: str, progress: launch.Progress) -> launch.UpResult | None:
    m, w = state(app, machine_id)
    if m.status not in INTENTS or w is None:
        return None  # launched or ended meanwhile
    if launch.cancel_requested(app, m.id):
        _cancelled(app, m, progress)
    if m.status == S.REQUESTED:  # a try that stopped midway: what it launched comes first
        adopted = launch.adopt(app, m, progress)
        if adopted is not None:
            _launched(app, adopted, w)
            return launch.UpResult(adopted)
    now = app.clock.now()
    if now >= w.until:
        _give_up(app, m, w.since, w.until, w.rounds)
    if m.status == S.WAITING and now < w.next_try:
        return None
    experiment = Experiment.model_validate(m.spec)
    with app.db.lock("intents"):  # as `up`: the limits read and the intent counted at once
        try:
            plan = launch.check(app, experiment)
        except UserError as e:
            _refused(app, m, e)
        if m.status == S.WAITING:
            m = _requested(app, m, plan.candidates[0], w)
    result = launch.launch_intent(app, m, experiment, plan, progress, settle(app, None))
    _launched(app, result.machine, w)
    return result


def _cancelled(app: App, m: Machine, progress: launch.Progress) -> NoReturn:
    """`down` was asked (it waits for this lock, or gave up waiting): the intent ends here as
    `down` ends it — what a stopped try launched is terminated, else it fails — and the `down`
    then finds it done."""
    adopted = launch.adopt(app, m, progress) if m.status == S.REQUESTED else None
    if adopted is None:
        transition(app, m.id, S.FAILED, event=EventKind.CANCELLED, reason="down")
        raise OperationFailed(f"{m.name}: taken down before it was launched")
    provider_call(app, adopted, "terminate")
    transition(app, m.id, S.TERMINATED, event=EventKind.TERMINATED, reason="down")
    raise OperationFailed(f"{m.name}: taken down; {adopted.instance_id} is terminated")


def _requested(app: App, m: Machine, first: Candidate, w: Wait) -> Machine:
    """Waiting → requested for a try, at the rate of its plan's first candidate (what budgets
    count until the launch fixes the real one)."""
    with app.db.session() as s:
        row = machine_row(s, m.id)
        row.rate, row.currency = first.price.amount, first.price.currency
        set_rates(app, row, first.offer.cloud, first.price.currency)
        ledger.record_transition(
            s,
            row,
            S.REQUESTED,
            app.clock.now(),
            event=EventKind.WAIT_TRY,
            reason="no-capacity",
            detail={"round": w.rounds + 1, "why": f"try {w.rounds + 1} of the wait for capacity"},
        )
        return row


# --- the foreground: `up --retry-until-up` -------------------------------------------------------


def up_until_up(
    app: App,
    experiment: Experiment,
    *,
    wait: timedelta,
    spec_path: str | None = None,
    progress: launch.Progress = lambda _: None,
    sleep: Callable[[float], None] | None = None,
) -> launch.UpResult:
    """``up``; while every candidate lacks capacity, the intent waits (``wait`` from its
    request) and is tried again here with :func:`backoff`, one ``progress`` line per round —
    or by the scheduler, whichever comes first. An intent already waiting (an earlier run
    interrupted) is followed. Ctrl-C leaves the intent queued for the scheduler."""
    with app.db.session() as s:
        queued_before = live_machine(s, experiment.name)
    if queued_before is not None and state(app, queued_before.id)[1] is not None:
        return follow(app, queued_before.id, progress=progress, sleep=sleep)
    try:
        result = launch.up(
            app,
            experiment,
            spec_path=spec_path,
            progress=progress,
            on_no_capacity=settle(app, wait),
        )
    except StillWaiting as e:
        progress(str(e))
        return follow(app, e.machine_id, progress=progress, sleep=sleep)
    if result.already and result.machine.status in INTENTS:
        return follow(app, result.machine.id, progress=progress, sleep=sleep)
    return result


def follow(
    app: App,
    machine_id: str,
    *,
    progress: launch.Progress = lambda _: None,
    sleep: Callable[[float], None] | None = None,
) -> launch.UpResult:
    """Try the queued intent whenever its next try is due, until it is launched (here or by
    the scheduler) or its wait ends (:class:`OperationFailed`, :class:`UserError`). ``sleep``
    (seconds; default :func:`time.sleep`) waits for the next try."""
    sleep = sleep or time.sleep
    while True:
        m, events = _events(app, machine_id)
        w = wait_of(events)
        if m.status not in INTENTS:
            if m.is_live:
                return launch.UpResult(m)
            raise OperationFailed(f"{m.name}: {failure(events) or m.status}")
        if w is None:
            raise OperationFailed(
                f"{m.name} is being launched by another `up`; see `provisioner status {m.name}`"
            )
        now = app.clock.now()
        due = min(w.next_try, w.until)
        if m.status == S.WAITING and now < due:
            sleep((due - now).total_seconds())
            continue
        try:
            result = try_once(app, machine_id, lock_timeout=LOCK_WAIT)
        except StillWaiting as e:
            progress(str(e))
            continue
        if result is not None:
            return result
        sleep(1.0)  # another process has the intent (a try, a `down`): look again shortly
