"""What is done to machines that exist: stop, start, hold, down — one by name, or many at once in
one batch call per cloud — and waiting until a launched machine answers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sqlalchemy import select

from providers.base import InstanceRef, MachineState, NotFound, Offer, ProviderError
from providers.retry import wait_until
from provisioner import budget, ledger, permits, planning, team_sql
from provisioner.app import App
from provisioner.crashpoints import crashpoint
from provisioner.errors import OperationFailed, UserError
from provisioner.machines import jobs, volumes
from provisioner.machines.launch import adopt, refuse_by_policy
from provisioner.machines.record import (
    can_stop,
    find,
    find_to_act,
    provider_call,
    record_event,
    ref,
    require_launched,
    transition,
)
from provisioner.models import ACTIVE_EXCLUDED, Event, Machine
from provisioner.money import Money
from provisioner.planner import Candidate
from provisioner.schema import INTENTS, EventKind, MachineStatus
from provisioner.spec import Experiment
from provisioner.state import LockBusy, named_machine
from provisioner.state import machine as machine_row

S = MachineStatus
DOWN_WAIT_SECONDS = 600  # how long `down` waits for an `up` still launching the same intent


def stop(
    app: App, name: str, *, reason: str = "user", detail: dict[str, Any] | None = None
) -> tuple[Machine, bool]:
    """Stop so compute billing ends; disks stay. Returns (machine, changed). Who acts must
    be allowed to act on it (:mod:`provisioner.permits`; the scheduler is)."""
    m = find_to_act(app, name)
    if m.status in (S.STOPPED, S.PREEMPTED):
        return m, False
    require_launched(m)
    if not can_stop(m):
        raise UserError(
            f"{m.name} is a spot machine on {m.cloud}, which cannot stop one (it launches spot "
            f"as one-time requests): `provisioner down {m.name}` ends its billing"
        )
    jobs.keep_before_down(app, m)
    provider_call(app, m, "stop")
    return transition(app, m.id, S.STOPPED, event=EventKind.STOPPED, reason=reason, detail=detail)


def start(app: App, name: str, *, reason: str = "user") -> tuple[Machine, bool]:
    """Start a stopped machine, within policy and budget as ``up`` (same refusal, exit 2).
    Concurrent starts of one machine start it once (the intent's lock); the check and the
    start are serialised with other ``up``s and ``start``s (the ``intents`` lock). Who acts
    must be allowed to act on it (:mod:`provisioner.permits`)."""
    m = find_to_act(app, name)
    if m.status in (S.RUNNING, S.PENDING):
        try:
            _attach(app, m)  # a volume an earlier attach missed
        except NotFound as e:
            raise OperationFailed(str(e)) from None
        return m, False
    require_launched(m)
    try:
        return _start(app, m, reason=reason)
    except NotFound:
        raise OperationFailed(f"{m.name}: the cloud no longer has {m.instance_id}") from None
    except ProviderError as e:
        raise OperationFailed(f"{m.name}: start failed: {e}") from None


def restart(app: App, m: Machine, *, detail: dict[str, Any] | None = None) -> Machine:
    """Start a preempted machine again in place — the same machine with the same disk, where its
    cloud kept it stopped — within policy and budget as :func:`start` (refused: UserError).
    The cloud's own refusal is raised as the adapter gives it (``CapacityError``: no stock to
    start it in its zone now; ``NotFound``: gone), so the caller can launch anew instead.
    Compute bills again from now; the disk billed throughout."""
    started, changed = _start(app, m, reason="preempted", detail=detail)
    if changed:  # `run` starts again if it was killed with the machine; on a cloud once
        experiment = Experiment.model_validate(started.spec)  # it answers SSH
        ended = jobs.ended_itself(jobs.jobs_of(app, started).get(jobs.RUN))
        if (experiment.run or experiment.setup) and not ended:  # a run that ended: not again
            record_event(app, started.id, jobs.DUE, reason="preempted", detail={"job": jobs.RUN})
        jobs.ensure_run(app, started, experiment)
    return started


def _start(
    app: App, m: Machine, *, reason: str, detail: dict[str, Any] | None = None
) -> tuple[Machine, bool]:
    """The one start: under the intent's and the ``intents`` lock, checked as ``up`` checks,
    started by its cloud (a ``ProviderError`` raised as the adapter gives it), recorded."""
    with app.db.lock(f"intent-{m.id}"), app.db.lock("intents"):
        with app.db.session() as s:
            m = machine_row(s, m.id)
        if m.status in (S.RUNNING, S.PENDING):  # a concurrent start did it
            return m, False
        check_start(app, m)
        team_sql.require_may_act(app.db, [m.id])
        _attach(app, m)  # before the boot, which mounts what fstab names
        app.provider(m.cloud or "").start(ref(m))
        crashpoint("after-start")  # the cloud acted, the state does not know yet
        return transition(
            app, m.id, S.RUNNING, event=EventKind.STARTED, reason=reason, detail=detail
        )


def _attach(app: App, m: Machine) -> None:
    """The volumes of the machine's experiment attached to it, if they are not."""
    volumes.attach(app, m.id, Experiment.model_validate(m.spec))


def check_start(app: App, m: Machine) -> None:
    """The machine's stored experiment checked as ``up`` checks it, for the machine's own
    offer at its launch-time rate (its disk is already counted: it bills while stopped)."""
    experiment = Experiment.model_validate(m.spec)
    rate = Money(m.rate or Decimal(0), m.currency or app.settings.currency)
    spot = m.market == "spot"
    base = app.settings.money_rates.convert(rate, app.settings.currency)
    cand = Candidate(_own_offer(m, rate, spot), "spot" if spot else "reserved", rate, base)
    plan = planning.check_known(app, experiment, cand)
    refuse_by_policy(plan)
    budget.guard(plan)


def _own_offer(m: Machine, rate: Money, spot: bool) -> Offer:
    """The offer ``m`` was launched from, as far as its row tells: its place, type and GPUs
    at ``rate`` (the spot price when ``spot``)."""
    return Offer(
        cloud=m.cloud or "",
        region=m.region or "",
        zone=m.zone or "",
        instance_type=m.instance_type or "",
        gpu=m.gpu or "",
        gpu_count=m.gpu_count or 0,
        gpu_memory_gb=0,
        vcpus=0,
        memory_gb=Decimal(0),
        price=None if spot else rate.amount,
        spot_price=rate.amount if spot else None,
        currency=rate.currency,
    )


def hold(
    app: App,
    m: Machine,
    why: str,
    detail: dict[str, Any] | None = None,
    *,
    event_id: int | None = None,
) -> Machine:
    """A lost machine whose relaunch policy or budget refuses is held as its cloud left it: a
    preempted machine is already stopped with its disk where its cloud keeps it (GCP STOP,
    Azure Deallocate, Yandex, SberCloud, the sandbox), so nothing is called and its status
    stays ``preempted`` (a ``stopped`` written here the next reconcile would undo, an event
    each time); a cloud that cannot stop a spot machine (AWS) has nothing left to keep, and
    it is terminated. The refusal is one ``relaunch-refused`` event: a retry refused alike
    (``event_id``, that event) updates its numbers in place rather than adding a row."""
    detail = {"refused": why, "why": " ".join(why.split()), **(detail or {})}
    if event_id is None:
        record_event(app, m.id, EventKind.RELAUNCH_REFUSED, reason="preempted", detail=detail)
    else:
        with app.db.session() as s:
            e = s.get(Event, event_id)
            if e is not None:
                e.detail = {**(e.detail or {}), **detail}
    if m.is_live and not can_stop(m):
        why = (
            f"spot machine on {m.cloud} cannot be stopped: terminated with its boot disk "
            "(its volumes survive)"
        )
        return down(app, m.name, reason="relaunch-refused", detail={"why": why})[0]
    with app.db.session() as s:
        return machine_row(s, m.id)


def down(
    app: App, name: str, *, reason: str = "user", detail: dict[str, Any] | None = None
) -> tuple[Machine, bool]:
    """Terminate and close every usage interval. An intent that never launched (requested, or
    waiting for capacity) is closed too. Who acts must be allowed to act on it
    (:mod:`provisioner.permits`)."""
    with app.db.session() as s:
        m = named_machine(s, name)
    if m is None:
        raise UserError(f"no machine named {name!r} (see `provisioner status --all`)")
    permits.check(app, m, m.name)
    if not m.is_live:
        return m, False
    if m.status in INTENTS:
        # an `up` (or a try of a waiting intent) may be launching it right now: it will see
        # this and terminate what it launches; we wait for it on the intent's lock (at once
        # if no `up` runs)
        record_event(app, m.id, EventKind.CANCEL_REQUESTED, reason=reason)
        try:
            with app.db.lock(f"intent-{m.id}", timeout=DOWN_WAIT_SECONDS):
                with app.db.session() as s:
                    m = machine_row(s, m.id)
                if not m.is_live:  # the launching `up` settled it
                    return m, True
                if m.status in INTENTS:
                    adopted = adopt(app, m, lambda _: None)
                    if adopted is None:
                        return transition(
                            app, m.id, S.FAILED, event=EventKind.CANCELLED, reason=reason
                        )
                    m = adopted
                provider_call(app, m, "terminate")
                return transition(
                    app,
                    m.id,
                    S.TERMINATED,
                    event=EventKind.TERMINATED,
                    reason=reason,
                    detail=detail,
                )
        except LockBusy:
            raise OperationFailed(
                f"{name}: an `up` is still launching it after {DOWN_WAIT_SECONDS} s; it will "
                f"terminate what it launches (see `provisioner status --all`)"
            ) from None
    jobs.keep_before_down(app, m)
    provider_call(app, m, "terminate")
    return transition(
        app, m.id, S.TERMINATED, event=EventKind.TERMINATED, reason=reason, detail=detail
    )


@dataclass
class Outcome:
    """What a batch stop or terminate did to one machine."""

    machine: Machine
    changed: bool = False  # False: it already was stopped / gone
    error: str | None = None


def stop_many(
    app: App, names: Iterable[str], *, reason: str = "user"
) -> dict[str, Outcome | UserError]:
    """`stop` of many names, one batch call per cloud and region and one transaction per
    batch: name → its outcome, or why the name does not say which machine."""
    return _by_name(app, names, lambda ms: act_many(app, ms, "stop", reason=reason))


def down_many(
    app: App, names: Iterable[str], *, reason: str = "user"
) -> dict[str, Outcome | UserError]:
    """`down` of many names, batched as :func:`stop_many`. An intent that never launched is
    settled one by one, as :func:`down` does."""

    def terminate(ms: list[Machine]) -> dict[str, Outcome]:
        out = {}
        for m in [m for m in ms if m.status in INTENTS]:
            try:
                done, changed = down(app, m.name, reason=reason)
                out[m.id] = Outcome(done, changed)
            except (UserError, OperationFailed) as e:
                out[m.id] = Outcome(m, error=str(e))
        rest = [m for m in ms if m.status not in INTENTS]
        return {**out, **act_many(app, rest, "terminate", reason=reason)}

    return _by_name(app, names, terminate)


def _by_name(
    app: App, names: Iterable[str], act: Callable[[list[Machine]], dict[str, Outcome]]
) -> dict[str, Outcome | UserError]:
    wanted = list(dict.fromkeys(names))
    with app.db.session() as s:
        rows = s.scalars(
            select(Machine).where(Machine.name.in_(wanted), Machine.status.not_in(ACTIVE_EXCLUDED))
        )
        found = {m.name: m for m in rows}
    mine, _ = permits.sort_out(app, found.values())
    done = act(mine)
    return {n: _named_outcome(app, n, found.get(n), done) for n in wanted}


def _named_outcome(
    app: App, name: str, m: Machine | None, done: dict[str, Outcome]
) -> Outcome | UserError:
    if m is None:
        return UserError(f"no machine named {name!r} (see `provisioner status`)")
    if m.id in done:
        return done[m.id]
    try:  # left out: who acts may not act on it, in the refusal's words
        permits.check(app, m, m.name)
    except permits.NotOwner as e:
        return e
    return UserError(f"{name}: not acted on")  # allowed, yet left out: never expected


def act_many(
    app: App,
    machines: Iterable[Machine],
    op: str,
    *,
    reason: str = "user",
    details: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Outcome]:
    """Stop (``op="stop"``) or terminate ``machines``: one batch call per cloud (the adapter
    groups by region and splits at its cloud's limit), then every change recorded in one
    transaction. One machine's failure is its own: machine id → outcome. A machine who acts
    may not act on is refused as its own failure (:mod:`provisioner.permits`)."""
    out: dict[str, Outcome] = {}
    by_cloud: dict[str, list[Machine]] = {}
    for m in machines:
        if (settled := _settled(m, op) or _refused(app, m)) is not None:
            out[m.id] = settled
        else:
            by_cloud.setdefault(m.cloud or "", []).append(m)
    status, event = (
        (S.STOPPED, EventKind.STOPPED) if op == "stop" else (S.TERMINATED, EventKind.TERMINATED)
    )
    for cloud, ms in by_cloud.items():
        done = _acted(_batch(app, cloud, ms, op), op, out)
        crashpoint(f"after-{op}")  # the cloud acted, the state does not know yet
        if not done:
            continue
        now = app.clock.now()
        with app.db.session() as s:  # one transaction for the batch
            rows = list(s.scalars(select(Machine).where(Machine.id.in_([m.id for m in done]))))
            changed = ledger.record_transitions(
                s, rows, status, now, event=event, reason=reason, details=details
            )
            for row in rows:
                out[row.id] = Outcome(row, changed[row.id])
    return out


def _acted(
    answers: list[tuple[Machine, ProviderError | None]], op: str, out: dict[str, Outcome]
) -> list[Machine]:
    """The machines the cloud stopped or terminated (one gone from it is terminated); each
    other's failure put in ``out``."""
    done = []
    for m, err in answers:
        if err is None or (op == "terminate" and isinstance(err, NotFound)):
            done.append(m)
        elif isinstance(err, NotFound):
            out[m.id] = Outcome(m, error=f"{m.name}: the cloud no longer has {m.instance_id}")
        else:
            out[m.id] = Outcome(m, error=f"{m.name}: {op} failed: {err}")
    return done


def _settled(m: Machine, op: str) -> Outcome | None:
    """``m``'s outcome when its cloud need not or cannot be asked; None: ask it."""
    if (op == "stop" and m.status in (S.STOPPED, S.PREEMPTED)) or not m.is_live:
        return Outcome(m)
    if m.status == S.WAITING:
        return Outcome(m, error=f"{m.name} is waiting for capacity: nothing is launched")
    if m.status == S.REQUESTED or not m.instance_id:
        return Outcome(m, error=f"{m.name} is still being launched")
    if op == "stop" and not can_stop(m):
        return Outcome(
            m,
            error=f"{m.name} is a spot machine on {m.cloud}, which "
            "cannot stop one: `provisioner down` ends its billing",
        )
    return None


def _refused(app: App, m: Machine) -> Outcome | None:
    """``m``'s outcome when who acts may not act on it (the refusal's words); None: they may."""
    try:
        permits.check(app, m, m.name)
    except permits.NotOwner as e:
        return Outcome(m, error=str(e))
    return None


def _batch(
    app: App, cloud: str, ms: list[Machine], op: str
) -> list[tuple[Machine, ProviderError | None]]:
    """One batch call of ``op`` for ``ms`` on ``cloud``: each machine with its error, if any."""
    refs = {m.id: ref(m) for m in ms}
    try:
        provider = app.provider(cloud)
        batch = provider.stop_many if op == "stop" else provider.terminate_many
        results: dict[InstanceRef, ProviderError | None] = batch(list(refs.values()))
    except (ProviderError, UserError) as e:
        results = dict.fromkeys(refs.values(), ProviderError(str(e)))
    return [(m, results.get(refs[m.id], ProviderError("no answer for it"))) for m in ms]


def _accepts_ssh(provider: Any, inst: Any) -> bool:
    """The machine's SSH port answers: its cloud's, or the ``-p`` of $PROVISIONER_SSH_COMMAND
    (what ``provisioner ssh`` and the job runner connect to)."""
    from providers.base import port_open
    from provisioner.machines.remote import ssh_port

    port = ssh_port(provider)
    if port == provider.ssh_port or not inst.public_ip:
        return bool(provider.accepts_ssh(inst))
    return port_open(inst.public_ip, port, 3)


def wait_ready(
    app: App,
    name: str,
    *,
    timeout: float,
    interval: float = 2,
    progress: Callable[[str], None] = lambda _: None,
) -> Machine:
    """Wait (bounded) until the cloud says the machine runs, it has a public address and its
    SSH port answers; record the boot and the address. Raises OperationFailed at ``timeout``,
    naming what it was still waiting for; the machine is left as it is (it may still boot)."""
    m = find(app, name)
    provider = app.provider(m.cloud or "")
    deadline = time.monotonic() + timeout
    progress(f"waiting for {m.name} to run and get an address…")
    inst, up = wait_until(
        lambda: provider.get(ref(m)),
        lambda i: i.state is MachineState.RUNNING and bool(i.public_ip),
        timeout=timeout,
        interval=interval,
    )
    if up:
        with app.db.session() as s:
            mm = machine_row(s, m.id)
            mm.public_ip = inst.public_ip
            ledger.record_transition(
                s, mm, S.RUNNING, app.clock.now(), event=EventKind.BOOTED, reason="launched"
            )
        progress(f"{m.name} runs at {inst.public_ip}; waiting for SSH…")
        left = max(deadline - time.monotonic(), 0)
        _, up = wait_until(
            lambda: _accepts_ssh(provider, inst), bool, timeout=left, interval=interval
        )
        waiting_for = "SSH to answer"
    else:
        waiting_for = f"it to run with an address (it is {inst.state.value})"
    if not up:
        raise OperationFailed(
            f"{m.name}: still waiting for {waiting_for} after {timeout:g} s; it is not "
            f"stopped — see `provisioner status {m.name}`, or `provisioner down {m.name}`"
        )
    return find(app, name)
