"""``up``: plan, write the intent, adopt or launch, record.

It reads top to bottom: plan, check the limits and write the intent (one at a time, under the
``intents`` lock, so concurrent ``up``s cannot overrun ``max_machines`` or a budget) → holding
the intent's own lock, adopt a machine an interrupted run already launched → walk the
candidates, launching each with a token derived from the intent and blocking a zone, region or
cloud by the kind of failure; a launch whose answer was lost (throttled, timed out, dropped,
5xx) is looked up by our machine tag before moving on → record the machine and open its usage
intervals at the launch-time rate.

``down`` of an intent still launching wins: it records ``cancel-requested`` (a second ``up`` of
the name is refused meanwhile), the launching ``up`` sees it and terminates what it launched,
and ``down`` waits for that on the intent's lock.

When every candidate tried lacked capacity and the caller asked to wait (``on_no_capacity``),
the intent is settled by :mod:`provisioner.machines.waiting` (queued as ``waiting``) rather
than failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from decimal import ROUND_DOWN, Decimal
from typing import Any, NoReturn

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from policies.evaluate import Decision
from providers.base import (
    TAG_MACHINE,
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    TAG_OWNER,
    TAG_PROJECT,
    AuthError,
    CapacityError,
    Instance,
    InvalidRequest,
    LaunchRequest,
    MachineState,
    NotFound,
    ProviderError,
    QuotaError,
)
from providers.retry import call_with_retry
from provisioner import boot, budget, fits, identity, keys, ledger, planning, startup
from provisioner.app import App
from provisioner.crashpoints import crashpoint
from provisioner.errors import OperationFailed, UserError
from provisioner.machines import jobs, volumes, workdirs
from provisioner.machines.attempts import Blocklist, LaunchAttempt, launch_token
from provisioner.machines.record import provider_call, record_event, set_rates, transition
from provisioner.models import Event, Machine, new_id
from provisioner.money import Rates
from provisioner.planner import Candidate, Plan
from provisioner.schema import AttemptOutcome, EventKind, MachineStatus
from provisioner.spec import Experiment
from provisioner.state import live_machine
from provisioner.state import machine as machine_row

log = logging.getLogger("provisioner")
Progress = Callable[[str], None]
#: Settles an intent every tried candidate of which lacked capacity (waiting, or given up): it
#: raises, so the launch ends there.
NoCapacity = Callable[[Machine, list[LaunchAttempt]], NoReturn]
S = MachineStatus


@dataclass
class UpResult:
    machine: Machine
    already: bool = False
    attempts: list[LaunchAttempt] = field(default_factory=list)
    plan: Plan | None = None


def resource_name(experiment: Experiment, machine_id: str) -> str:
    return f"{experiment.name}-{machine_id[:6]}"


def up(
    app: App,
    experiment: Experiment,
    *,
    spec_path: str | None = None,
    progress: Progress = lambda _: None,
    prefer: Callable[[Candidate], Any] | None = None,
    on_no_capacity: NoCapacity | None = None,
) -> UpResult:
    """``prefer`` reorders the candidates (stable): recovery tries the lost machine's zone and
    region first. ``on_no_capacity``: see :data:`NoCapacity` (None: such an intent fails)."""
    taken = None  # the workdir taken now, before anything is written (a bad one: UserError)
    if experiment.workdir and workdirs.replacing() is None:
        files = jobs.workdir_files(app, experiment.workdir)[0]
        taken = (experiment.workdir, len(files), workdirs.pack(experiment.workdir, files))
    # The limits (max_machines, budgets) are read and the intent written under one lock:
    # otherwise six concurrent `up`s each count the same machines and all go ahead.
    with app.db.lock("intents"):
        plan = check(app, experiment, spec_path)
        machine, already = _write_intent(app, experiment, spec_path, plan.candidates[0])
    if already:
        return UpResult(machine, already=True, plan=plan)
    workdirs.at_up(app, machine, taken)  # kept with the state: every later copy restores it
    if prefer is not None:
        plan.candidates.sort(key=prefer)
    # one launching process per intent; a second `up` of it waits here, then finds it done
    with app.db.lock(f"intent-{machine.id}"):
        with app.db.session() as s:
            current = machine_row(s, machine.id)
        if current.status != S.REQUESTED:
            if not current.is_live:
                raise OperationFailed(f"{experiment.name}: taken down while it was launched")
            return UpResult(current, already=True, plan=plan)
        return launch_intent(app, machine, experiment, plan, progress, on_no_capacity)


def check(app: App, experiment: Experiment, spec_path: str | None = None) -> Plan:
    """The plan, refused (exit 2) as ``up`` refuses it: by policy, by budget (with the numbers;
    failover keeps only candidates every budget can afford), or for want of an offer, or
    when its owner is not who runs it and no policy grants ``act_as``, or when the startup
    data fits no cloud offered (:func:`provisioner.fits.drop_unfit`)."""
    plan = planning.plan(app, experiment)
    fits.drop_unfit(app, experiment, plan, spec_path)
    refuse_by_policy(plan)
    budget.guard(plan)
    volumes.check_free(app, experiment)
    if not plan.candidates:
        reasons = "; ".join(f"{r} ({n})" for r, n in plan.summary_reasons()[:6])
        raise UserError(f"no offer fits {experiment.name}: {reasons or 'the catalog is empty'}")
    identity.check_owner(app.policies, experiment, app.actor)
    return plan


def refuse_by_policy(plan: Plan) -> None:
    """No flag bypasses a policy: every violated rule is listed, exit 2."""
    for check in plan.checks:
        if isinstance(check, Decision) and not check.allowed:
            rules = "\n  ".join(check.reasons)
            raise UserError(f"refused by policy for {plan.experiment.name}:\n  {rules}")


def _write_intent(
    app: App, experiment: Experiment, spec_path: str | None, first: Candidate
) -> tuple[Machine, bool]:
    """The intent is written before anything is launched, with the rate of the ``first``
    candidate (budgets count it until the launch fixes the real one). Returns (machine,
    already_running)."""
    now = app.clock.now()
    with app.db.session() as s:
        m = live_machine(s, experiment.name)
    if m is not None:
        _refuse_cancelled(app, m)
        return m, m.status != S.REQUESTED  # requested: an interrupted up, resume it
    try:
        with app.db.session() as s:
            m = Machine(
                id=new_id(),
                name=experiment.name,
                project=experiment.project,
                owner=experiment.owner,
                status=S.REQUESTED,
                spec=experiment.to_json(),
                spec_path=spec_path,
                created_at=now,
                disk_gb=experiment.resources.disk_gb,
                autostop_seconds=_seconds(experiment.lifecycle.autostop),
                rate=first.price.amount,
                currency=first.price.currency,
            )
            set_rates(app, m, first.offer.cloud, first.price.currency)
            s.add(m)
            s.flush()
            s.add(
                Event(
                    machine_id=m.id,
                    at=now,
                    kind=EventKind.REQUESTED,
                    detail={"spec_path": spec_path},
                )
            )
        return m, False
    except IntegrityError:  # another `up` of this name won the race
        with app.db.session() as s:
            m = live_machine(s, experiment.name)
        if m is None:
            raise UserError(
                f"{experiment.name} changed while this `up` wrote it; run `provisioner up` again"
            ) from None
        return m, True


def _seconds(d: timedelta | None) -> int | None:
    """``lifecycle.autostop`` as ``machines.autostop_seconds``: the machine's initial one."""
    return None if d is None else round(d.total_seconds())


def launch_intent(
    app: App,
    machine: Machine,
    experiment: Experiment,
    plan: Plan,
    progress: Progress,
    on_no_capacity: NoCapacity | None = None,
) -> UpResult:
    """Launch the intent ``machine`` (its lock held): adopt, else walk the candidates."""
    crashpoint("after-intent")
    _unless_cancelled_before(app, machine)

    key = keys.choose(app, experiment, progress)  # an interrupted run chose the same
    adopted = adopt(app, machine, progress, key)
    if adopted is not None:
        return UpResult(_finish(app, adopted, experiment), plan=plan)

    # the agent's token, once per launch (never logged or recorded)
    token = startup.issue_token(app, machine.id) if app.settings.scheduler.endpoint_url else None
    attempts: list[LaunchAttempt] = []
    blocked = Blocklist()
    for cand in plan.candidates:
        _unless_cancelled_before(app, machine)
        attempt = LaunchAttempt.of(cand, launch_token(machine.id, cand))
        if why := blocked.reason(cand):
            attempts.append(attempt.ended(AttemptOutcome.SKIPPED, why))
            continue
        o = cand.offer
        progress(f"trying {cand.where} {o.instance_type} {cand.market} at {cand.price}/h")
        try:
            ready = volumes.prepare(app, machine, experiment, cand)
        except ProviderError as err:
            attempts.append(_failed(app, machine, attempt, blocked.add(cand, err), err))
            progress(f"  {attempts[-1].outcome}: volume: {err}")
            continue
        provider = app.provider(o.cloud)
        user_data = boot.startup_for(
            app,
            experiment,
            o.cloud,
            volumes.mounts(app, ready),
            token=token,
            machine_id=machine.id,
            ssh_user=provider.ssh_user,
            pull_key=key.pull_key,
        )
        request = _launch_request(
            machine, experiment, cand, user_data, app.settings.money_rates, key.public_key
        )
        request = replace(
            request, guard=boot.guard_of(app, machine.id, experiment, provider.ssh_user)
        )
        record_event(app, machine.id, EventKind.LAUNCH_ATTEMPT, detail=attempt.to_json())
        crashpoint("before-launch")
        try:
            instance = app.provider(o.cloud).launch(request)
        except ProviderError as err:
            found = _launched_after_all(app, machine, cand, err, progress)
            if found:
                attempts.append(attempt.ended(AttemptOutcome.LAUNCHED))
                adopted = _record(app, machine.id, found[0], attempt, EventKind.ADOPTED, key)
                _end_duplicates(app, adopted, found[1:])
                return UpResult(_finish(app, adopted, experiment), attempts=attempts, plan=plan)
            attempts.append(_failed(app, machine, attempt, blocked.add(cand, err), err))
            progress(f"  {attempts[-1].outcome}: {err}")
            for left in volumes.discard(app, ready):  # not stranded in a zone left behind
                progress(f"  could not remove the new {left}")
            continue
        crashpoint("after-launch")
        attempts.append(attempt.ended(AttemptOutcome.LAUNCHED))
        launched = _record(app, machine.id, instance, attempt, EventKind.LAUNCHED, key)
        return UpResult(_finish(app, launched, experiment), attempts=attempts, plan=plan)

    tried = [a for a in attempts if a.outcome != AttemptOutcome.SKIPPED]
    if on_no_capacity and tried and all(a.outcome == AttemptOutcome.CAPACITY for a in tried):
        on_no_capacity(machine, attempts)
    with app.db.session() as s:
        m = machine_row(s, machine.id)
        ledger.record_transition(s, m, S.FAILED, app.clock.now(), reason="no-candidate-launched")
    summary = "; ".join(f"{a.where} {a.instance_type}: {a.outcome}" for a in tried[:8])
    raise OperationFailed(
        f"could not launch {experiment.name} on any of {len(tried)} "
        f"{'candidate' if len(tried) == 1 else 'candidates'} tried: {summary}"
    )


def _failed(
    app: App, machine: Machine, attempt: LaunchAttempt, outcome: AttemptOutcome, err: Exception
) -> LaunchAttempt:
    """A failed attempt, with the cloud's words, recorded as a ``launch-failed`` event."""
    failed = attempt.ended(outcome, str(err))
    record_event(
        app,
        machine.id,
        EventKind.LAUNCH_FAILED,
        reason=failed.outcome,
        detail={**failed.to_json(), "error": str(err), "code": getattr(err, "code", None)},
    )
    return failed


def _finish(app: App, m: Machine, experiment: Experiment) -> Machine:
    """A machine launched or adopted: terminated if `down` came meanwhile, else its volumes
    attached (the startup data waits for them) and its job started (``run:``)."""
    m = _unless_cancelled(app, m)
    try:
        volumes.attach(app, m.id, experiment)
    except OperationFailed as e:
        raise OperationFailed(
            f"{e}; {m.name} runs without it: `provisioner start {m.name}` attaches it again"
        ) from None
    except NotFound as e:  # gone right after its launch: reconcile records its end
        raise OperationFailed(str(e)) from None
    jobs.ensure_run(app, m, experiment)  # adopted after a crash: started already, maybe
    return m


# --- cancellation: `down` of an intent still launching ----------------------------------------


def _refuse_cancelled(app: App, m: Machine) -> None:
    if m.status == S.REQUESTED and cancel_requested(app, m.id):
        raise UserError(
            f"{m.name} is being taken down while an earlier `up` launches it; run `provisioner "
            f"up` again once `provisioner status --all` shows it terminated or failed"
        )


def cancel_requested(app: App, machine_id: str) -> bool:
    """Whether `down` was asked of this intent (re-read from the state, never cached)."""
    with app.db.session() as s:
        return (
            s.scalars(
                select(Event.id).where(
                    Event.machine_id == machine_id, Event.kind == EventKind.CANCEL_REQUESTED
                )
            ).first()
            is not None
        )


def _unless_cancelled_before(app: App, m: Machine) -> None:
    if cancel_requested(app, m.id):
        transition(app, m.id, S.FAILED, event=EventKind.CANCELLED, reason="down")
        raise OperationFailed(f"{m.name}: taken down before it was launched")


def _unless_cancelled(app: App, m: Machine) -> Machine:
    """After recording a launch: if `down` was asked meanwhile, terminate what was launched
    (the `down` waiting on the intent's lock then finds it done)."""
    if not cancel_requested(app, m.id):
        return m
    provider_call(app, m, "terminate")
    transition(
        app,
        m.id,
        S.TERMINATED,
        event=EventKind.TERMINATED,
        reason="down",
        detail={"while": "launching"},
    )
    raise OperationFailed(
        f"{m.name}: taken down while it was launched; {m.instance_id} is terminated"
    )


# --- adoption: a machine launched but never recorded ------------------------------------------

_DEFINITE = (CapacityError, QuotaError, AuthError, InvalidRequest, NotFound)


def _launched_after_all(
    app: App, machine: Machine, cand: Candidate, err: ProviderError, progress: Progress
) -> list[Instance]:
    """A launch that failed without a definite answer (throttled, timed out, connection dropped,
    5xx) may have happened all the same: ask the cloud for a machine carrying this intent's tag
    in that region before moving on with another token. When even that cannot be answered, stop
    here (the intent stays ``requested``: a rerun of `up` adopts, `down` cleans up) rather than
    risk a second machine."""
    if isinstance(err, _DEFINITE):
        return []
    o = cand.offer
    provider = app.provider(o.cloud)
    try:
        found = call_with_retry(
            lambda: provider.list_managed([o.region], machine_id=machine.id), provider.options
        )
    except ProviderError as e:
        record_event(
            app, machine.id, EventKind.LAUNCH_UNKNOWN, detail={"where": cand.where, "error": str(e)}
        )
        raise OperationFailed(
            f"{machine.name}: the launch in {cand.where} got no clear answer ({err}) and the "
            f"cloud could not say whether it happened ({e}); nothing else was launched: run "
            f"`provisioner up` again to finish (it adopts the machine if there is one), or "
            f"`provisioner down {machine.name}`"
        ) from None
    live = [i for i in found if i.state is not MachineState.TERMINATED]
    if live:
        progress(f"  {err}; {live[0].id} was launched all the same: adopting it")
    return live


def adopt(
    app: App, machine: Machine, progress: Progress, key: keys.Key | None = None
) -> Machine | None:
    """Find a machine that an interrupted run of this intent launched but never recorded: the
    ``launch-attempt`` events say where to look and what each attempt was."""
    with app.db.session() as s:
        tried = [
            LaunchAttempt.from_json(e.detail)
            for e in s.scalars(
                select(Event).where(
                    Event.machine_id == machine.id, Event.kind == EventKind.LAUNCH_ATTEMPT
                )
            )
        ]
    by_cloud: dict[str, set[str]] = {}
    for a in tried:
        by_cloud.setdefault(a.cloud, set()).add(a.region)
    for cloud, regions in by_cloud.items():
        try:
            found = app.provider(cloud).list_managed(sorted(regions), machine_id=machine.id)
        except ProviderError:
            continue
        live = [i for i in found if i.state is not MachineState.TERMINATED]
        for inst in live:
            attempt = next(
                (
                    a
                    for a in reversed(tried)
                    if a.cloud == cloud
                    and a.zone in (inst.zone, "")
                    and a.instance_type == inst.instance_type
                ),
                None,
            )
            if attempt is None:
                continue
            progress(f"found {inst.id} launched by an interrupted run; adopting it")
            adopted = _record(app, machine.id, inst, attempt, EventKind.ADOPTED, key)
            _end_duplicates(app, adopted, [i for i in live if i.id != inst.id])
            return adopted
    return None


def _end_duplicates(app: App, m: Machine, extra: list[Instance]) -> None:
    """More than one machine carries this intent's tag: the adopted one is kept, the others
    are terminated; the event names each and whether it still runs (the terminate failed)."""
    for inst in extra:
        try:
            app.provider(m.cloud or "").terminate(inst.ref)
            running = False
        except ProviderError:
            running = True
        record_event(
            app,
            m.id,
            EventKind.DUPLICATE,
            reason="adopted",
            detail={"instance_id": inst.id, "kept": m.instance_id, "still_running": running},
        )


# --- what is sent, and what is recorded ---------------------------------------------------------


def _launch_request(
    m: Machine,
    experiment: Experiment,
    c: Candidate,
    user_data: str | None,
    rates: Rates,
    ssh_public_key: str | None = None,  # the key chosen (keys.choose); else the experiment's
) -> LaunchRequest:
    o = c.offer
    res = experiment.resources
    labels = {
        **experiment.labels,
        TAG_MANAGED_BY: TAG_MANAGED_BY_VALUE,
        TAG_MACHINE: m.id,
        TAG_PROJECT: experiment.project,
        TAG_OWNER: experiment.owner,
    }
    max_price = None
    if c.spot and res.max_price_per_hour is not None:
        # The cap in the offer's currency at the settings' rate, rounded down: never above
        # what the experiment allows (the planner already refused a rate it lacks).
        cap = rates.convert(res.max_price_per_hour, o.currency).amount
        max_price = cap.quantize(Decimal("0.0001"), ROUND_DOWN)
    return LaunchRequest(
        name=resource_name(experiment, m.id),
        token=launch_token(m.id, c),
        region=o.region,
        zone=o.zone,
        instance_type=o.instance_type,
        gpu=o.gpu,
        gpu_count=o.gpu_count,
        spot=c.spot,
        disk_gb=res.disk_gb,
        accelerator=o.accelerator,
        image=res.image.get(o.cloud),
        user_data=user_data,
        ssh_public_key=ssh_public_key or experiment.ssh_public_key,
        labels=labels,
        max_price=max_price,
        preemption_action="terminate"
        if experiment.lifecycle.on_preemption == "terminate"
        else "stop",
    )


def _record(
    app: App,
    machine_id: str,
    inst: Instance,
    attempt: LaunchAttempt,
    event: EventKind,
    key: keys.Key | None = None,
) -> Machine:
    """The machine ``attempt`` launched (``event``: launched, or adopted after a lost answer
    or a crash), recorded with the attempt's rate (usage opens now) and the SSH key it was
    given (``provisioner ssh`` connects with it)."""
    now = app.clock.now()
    with app.db.session() as s:
        m = machine_row(s, machine_id)
        m.cloud, m.region, m.zone = attempt.cloud, inst.region, inst.zone or attempt.zone
        m.instance_type, m.gpu, m.gpu_count = inst.instance_type, attempt.gpu, attempt.gpu_count
        m.market, m.instance_id, m.resource_name = attempt.market, inst.id, inst.name
        m.rate, m.currency = attempt.rate.amount, attempt.rate.currency
        set_rates(app, m, attempt.cloud, m.currency)
        m.public_ip, m.launched_at = inst.public_ip, now
        status = S.PENDING if inst.state == MachineState.PENDING else S.RUNNING
        ledger.record_transition(
            s,
            m,
            status,
            now,
            event=event,
            detail={
                **attempt.to_json(),
                "instance_id": inst.id,
                "public_ip": inst.public_ip,
                **({keys.DETAIL: key.detail()} if key else {}),
                **(
                    {keys.PULL_DETAIL: keys.fingerprint(key.pull_key)}
                    if key and key.pull_key
                    else {}
                ),
            },
        )
        return m
