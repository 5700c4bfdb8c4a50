"""up / stop / start / down / reconcile.

``up`` reads top to bottom: plan, check the limits and write the intent (one at a time, under the
``intents`` lock, so concurrent ``up``s cannot overrun ``max_machines`` or a budget) → holding
the intent's own lock, adopt a machine an interrupted run already launched → walk the
candidates, launching each with a token derived from the intent and blocking a zone, region or
cloud by the kind of failure; a launch whose answer was lost (throttled, timed out, dropped,
5xx) is looked up by our machine tag before moving on → record the machine and open its usage
intervals at the launch-time rate.

``down`` of an intent still launching wins: it records ``cancel-requested`` (a second ``up`` of
the name is refused meanwhile), the launching ``up`` sees it and terminates what it launched,
and ``down`` waits for that on the intent's lock.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from decimal import ROUND_DOWN, Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

import providers
from policies.evaluate import Decision
from providers.base import (
    TAG_MACHINE,
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    TAG_OWNER,
    TAG_PROJECT,
    AuthError,
    CapacityError,
    ConfigurationError,
    Instance,
    InstanceRef,
    InvalidRequest,
    LaunchRequest,
    MachineState,
    NotFound,
    Offer,
    ProviderError,
    QuotaError,
)
from providers.retry import call_with_retry, wait_until
from provisioner import budget, catalog, idle, ledger, planning
from provisioner.app import App
from provisioner.crashpoints import crashpoint
from provisioner.errors import OperationFailed, UserError
from provisioner.models import ACTIVE_EXCLUDED, Event, Machine, new_id
from provisioner.money import Money, Rates
from provisioner.planner import Candidate, Plan
from provisioner.schema import observed
from provisioner.spec import Experiment
from provisioner.state import LockBusy, live_machine, named_machine
from provisioner.state import machine as machine_row

log = logging.getLogger("provisioner")
DOWN_WAIT_SECONDS = 600  # how long `down` waits for an `up` still launching the same intent

Progress = Callable[[str], None]


@dataclass
class Attempt:
    where: str
    instance_type: str
    market: str
    outcome: str  # launched | capacity | quota | auth | settings | invalid | error | skipped
    message: str = ""


@dataclass
class UpResult:
    machine: Machine
    already: bool = False
    attempts: list[Attempt] = field(default_factory=list)
    plan: Plan | None = None


class Blocklist:
    """What failures rule out for the rest of this ``up``: capacity → the zone, quota → the
    region (or the cloud), auth → the cloud."""

    def __init__(self) -> None:
        self.zones: dict[tuple[str, str], str] = {}
        self.regions: dict[tuple[str, str], str] = {}
        self.clouds: dict[str, str] = {}

    def reason(self, c: Candidate) -> str | None:
        o = c.offer
        return (
            self.clouds.get(o.cloud)
            or self.regions.get((o.cloud, o.region))
            or (self.zones.get((o.cloud, o.zone)) if o.zone else None)
        )

    def add(self, c: Candidate, err: ProviderError) -> str:
        o = c.offer
        if isinstance(err, AuthError):
            self.clouds[o.cloud] = f"{o.cloud} blocked: credentials"
            return "auth"
        if isinstance(err, ConfigurationError):
            self.clouds[o.cloud] = f"{o.cloud} blocked: settings"
            return "settings"
        if isinstance(err, QuotaError):
            if err.scope == "cloud":
                self.clouds[o.cloud] = f"{o.cloud} blocked: quota"
            else:
                self.regions[(o.cloud, o.region)] = f"{o.region} blocked: quota"
            return "quota"
        if isinstance(err, CapacityError):
            # zone-less offers (Azure prices per region) block the region they were tried in
            if o.zone:
                self.zones[(o.cloud, o.zone)] = f"{o.zone} blocked: no capacity"
            else:
                self.regions[(o.cloud, o.region)] = f"{o.region} blocked: no capacity"
            return "capacity"
        return "invalid" if isinstance(err, InvalidRequest) else "error"


def launch_token(machine_id: str, c: Candidate) -> str:
    """Same intent and same candidate → same token, so a retried launch finds its machine."""
    o = c.offer
    key = f"{machine_id}|{o.cloud}|{o.region}|{o.zone}|{o.instance_type}|{c.market}"
    return "pv-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def resource_name(experiment: Experiment, machine_id: str) -> str:
    return f"{experiment.name}-{machine_id[:6]}"


def up(
    app: App,
    experiment: Experiment,
    *,
    spec_path: str | None = None,
    progress: Progress = lambda _: None,
    prefer: Callable[[Candidate], Any] | None = None,
) -> UpResult:
    """``prefer`` reorders the candidates (stable): recovery tries the lost machine's zone and
    region first."""
    # The limits (max_machines, budgets) are read and the intent written under one lock:
    # otherwise six concurrent `up`s each count the same machines and all go ahead.
    with app.db.lock("intents"):
        plan = check(app, experiment)
        machine, already = _write_intent(app, experiment, spec_path, plan.candidates[0])
    if already:
        return UpResult(machine, already=True, plan=plan)
    if prefer is not None:
        plan.candidates.sort(key=prefer)
    # one launching process per intent; a second `up` of it waits here, then finds it done
    with app.db.lock(f"intent-{machine.id}"):
        with app.db.session() as s:
            current = machine_row(s, machine.id)
        if current.status != "requested":
            if not current.is_live:
                raise OperationFailed(f"{experiment.name}: taken down while it was launched")
            return UpResult(current, already=True, plan=plan)
        return _launch(app, machine, experiment, plan, progress)


def check(app: App, experiment: Experiment) -> Plan:
    """The plan, refused (exit 2) as ``up`` refuses it: by policy, by budget (with the numbers;
    failover keeps only candidates every budget can afford), or for want of an offer."""
    plan = planning.plan(app, experiment)
    _refuse_by_policy(plan)
    budget.guard(plan)
    if not plan.candidates:
        reasons = "; ".join(f"{r} ({n})" for r, n in plan.summary_reasons()[:6])
        raise UserError(f"no offer fits {experiment.name}: {reasons or 'the catalog is empty'}")
    return plan


def _launch(
    app: App, machine: Machine, experiment: Experiment, plan: Plan, progress: Progress
) -> UpResult:
    """Launch the intent ``machine`` (its lock held): adopt, else walk the candidates."""
    crashpoint("after-intent")
    _unless_cancelled_before(app, machine)

    adopted = _adopt(app, machine, progress)
    if adopted is not None:
        return UpResult(_unless_cancelled(app, adopted), plan=plan)

    user_data = _startup_data(app, machine.id, experiment)
    attempts: list[Attempt] = []
    blocked = Blocklist()
    for cand in plan.candidates:
        o = cand.offer
        _unless_cancelled_before(app, machine)
        if why := blocked.reason(cand):
            attempts.append(Attempt(cand.where, o.instance_type, cand.market, "skipped", why))
            continue
        progress(f"trying {cand.where} {o.instance_type} {cand.market} at {cand.price}/h")
        request = _launch_request(machine, experiment, cand, user_data, app.settings.money_rates)
        record_event(app, machine.id, "launch-attempt", detail=_attempt_detail(cand, request.token))
        crashpoint("before-launch")
        try:
            instance = app.provider(o.cloud).launch(request)
        except ProviderError as err:
            found = _launched_after_all(app, machine, cand, err, progress)
            if found:
                attempts.append(Attempt(cand.where, o.instance_type, cand.market, "launched"))
                adopted = _record_adoption(
                    app, machine.id, o.cloud, found[0], _attempt_detail(cand, request.token)
                )
                _end_duplicates(app, adopted, found[1:])
                return UpResult(_unless_cancelled(app, adopted), attempts=attempts, plan=plan)
            outcome = blocked.add(cand, err)
            attempts.append(Attempt(cand.where, o.instance_type, cand.market, outcome, str(err)))
            record_event(
                app,
                machine.id,
                "launch-failed",
                reason=outcome,
                detail={
                    **_attempt_detail(cand, request.token),
                    "error": str(err),
                    "code": err.code,
                },
            )
            progress(f"  {outcome}: {err}")
            continue
        crashpoint("after-launch")
        attempts.append(Attempt(cand.where, o.instance_type, cand.market, "launched"))
        launched = _record_launch(app, machine.id, cand, instance, request)
        return UpResult(_unless_cancelled(app, launched), attempts=attempts, plan=plan)

    with app.db.session() as s:
        m = machine_row(s, machine.id)
        ledger.record_transition(s, m, "failed", app.clock.now(), reason="no-candidate-launched")
    tried = [a for a in attempts if a.outcome != "skipped"]
    summary = "; ".join(f"{a.where} {a.instance_type}: {a.outcome}" for a in tried[:8])
    raise OperationFailed(
        f"could not launch {experiment.name} on any of {len(tried)} "
        f"{'candidate' if len(tried) == 1 else 'candidates'} tried: {summary}"
    )


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
        return m, m.status != "requested"  # "requested": an interrupted up, resume it
    try:
        with app.db.session() as s:
            m = Machine(
                id=new_id(),
                name=experiment.name,
                project=experiment.project,
                owner=experiment.owner,
                status="requested",
                spec=experiment.to_json(),
                spec_path=spec_path,
                created_at=now,
                disk_gb=experiment.resources.disk_gb,
                rate=first.price.amount,
                currency=first.price.currency,
                disk_rate=disk_rate(
                    app, first.offer.cloud, first.price.currency, experiment.resources.disk_gb
                ),
            )
            s.add(m)
            s.flush()
            s.add(Event(machine_id=m.id, at=now, kind="requested", detail={"spec_path": spec_path}))
        return m, False
    except IntegrityError:  # another `up` of this name won the race
        with app.db.session() as s:
            m = live_machine(s, experiment.name)
        if m is None:
            raise UserError(
                f"{experiment.name} changed while this `up` wrote it; run `provisioner up` again"
            ) from None
        return m, True


def _refuse_cancelled(app: App, m: Machine) -> None:
    if m.status == "requested" and _cancel_requested(app, m.id):
        raise UserError(
            f"{m.name} is being taken down while an earlier `up` launches it; run `provisioner "
            f"up` again once `provisioner status --all` shows it terminated or failed"
        )


def _cancel_requested(app: App, machine_id: str) -> bool:
    """Whether `down` was asked of this intent (re-read from the state, never cached)."""
    with app.db.session() as s:
        return (
            s.scalars(
                select(Event.id).where(
                    Event.machine_id == machine_id, Event.kind == "cancel-requested"
                )
            ).first()
            is not None
        )


def _unless_cancelled_before(app: App, m: Machine) -> None:
    if _cancel_requested(app, m.id):
        _transition(app, m.id, "failed", event="cancelled", reason="down")
        raise OperationFailed(f"{m.name}: taken down before it was launched")


def _unless_cancelled(app: App, m: Machine) -> Machine:
    """After recording a launch: if `down` was asked meanwhile, terminate what was launched
    (the `down` waiting on the intent's lock then finds it done)."""
    if not _cancel_requested(app, m.id):
        return m
    _provider_call(app, m, "terminate")
    _transition(
        app, m.id, "terminated", event="terminated", reason="down", detail={"while": "launching"}
    )
    raise OperationFailed(
        f"{m.name}: taken down while it was launched; {m.instance_id} is terminated"
    )


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
            app, machine.id, "launch-unknown", detail={"where": cand.where, "error": str(e)}
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


def _adopt(app: App, machine: Machine, progress: Progress) -> Machine | None:
    """Find a machine that an interrupted run of this intent launched but never recorded."""
    with app.db.session() as s:
        tried = [
            e.detail
            for e in s.scalars(
                select(Event).where(Event.machine_id == machine.id, Event.kind == "launch-attempt")
            )
        ]
    by_cloud: dict[str, set[str]] = {}
    for d in tried:
        by_cloud.setdefault(d["cloud"], set()).add(d["region"])
    for cloud, regions in by_cloud.items():
        try:
            found = app.provider(cloud).list_managed(sorted(regions), machine_id=machine.id)
        except ProviderError:
            continue
        live = [i for i in found if i.state not in (MachineState.TERMINATED,)]
        for inst in live:
            attempt = next(
                (
                    d
                    for d in reversed(tried)
                    if d["cloud"] == cloud
                    and d["zone"] in (inst.zone, "")
                    and d["instance_type"] == inst.instance_type
                ),
                None,
            )
            if attempt is None:
                continue
            progress(f"found {inst.id} launched by an interrupted run; adopting it")
            adopted = _record_adoption(app, machine.id, cloud, inst, attempt)
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
            "duplicate",
            reason="adopted",
            detail={"instance_id": inst.id, "kept": m.instance_id, "still_running": running},
        )


def _refuse_by_policy(plan: Plan) -> None:
    """No flag bypasses a policy: every violated rule is listed, exit 2."""
    for check in plan.checks:
        if isinstance(check, Decision) and not check.allowed:
            rules = "\n  ".join(check.reasons)
            raise UserError(f"refused by policy for {plan.experiment.name}:\n  {rules}")


def _startup_data(app: App, machine_id: str, experiment: Experiment) -> str | None:
    """The user's startup script, with the idle agent and a fresh per-machine token added when
    settings name the endpoint agents report to. The token is never logged or recorded."""
    sched = app.settings.scheduler
    if not sched.endpoint_url:
        return experiment.startup_script
    token = idle.issue_token(app, machine_id)
    return idle.startup_data(
        experiment.startup_script,
        sched.endpoint_url,
        token,
        sched.agent_interval_seconds,
        machine_id,
    )


def _launch_request(
    m: Machine, experiment: Experiment, c: Candidate, user_data: str | None, rates: Rates
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
        ssh_public_key=experiment.ssh_public_key,
        labels=labels,
        max_price=max_price,
        preemption_action="terminate"
        if experiment.lifecycle.on_preemption == "terminate"
        else "stop",
    )


def _attempt_detail(c: Candidate, token: str) -> dict[str, Any]:
    o = c.offer
    return {
        "cloud": o.cloud,
        "region": o.region,
        "zone": o.zone,
        "instance_type": o.instance_type,
        "gpu": o.gpu,
        "gpu_count": o.gpu_count,
        "market": c.market,
        "token": token,
        "rate": str(c.price.amount),
        "currency": c.price.currency,
    }


def _record_launch(
    app: App, machine_id: str, c: Candidate, inst: Instance, req: LaunchRequest
) -> Machine:
    return _record_adoption(
        app, machine_id, c.offer.cloud, inst, _attempt_detail(c, req.token), event="launched"
    )


def _record_adoption(
    app: App,
    machine_id: str,
    cloud: str,
    inst: Instance,
    attempt: dict[str, Any],
    event: str = "adopted",
) -> Machine:
    now = app.clock.now()
    with app.db.session() as s:
        m = machine_row(s, machine_id)
        m.cloud, m.region, m.zone = cloud, inst.region, inst.zone or attempt["zone"]
        m.instance_type, m.gpu, m.gpu_count = (
            inst.instance_type,
            attempt["gpu"],
            attempt["gpu_count"],
        )
        m.market, m.instance_id, m.resource_name = attempt["market"], inst.id, inst.name
        m.rate, m.currency = Decimal(attempt["rate"]), attempt["currency"]
        m.disk_rate = disk_rate(app, cloud, m.currency, m.disk_gb or 0)
        m.public_ip, m.launched_at = inst.public_ip, now
        status = "pending" if inst.state == MachineState.PENDING else "running"
        ledger.record_transition(
            s,
            m,
            status,
            now,
            event=event,
            detail={**attempt, "instance_id": inst.id, "public_ip": inst.public_ip},
        )
        return m


def disk_rate(app: App, cloud: str, currency: str, disk_gb: int) -> Decimal | None:
    """Per hour, fixed at launch like the compute rate. None when the price is unknown."""
    per_gb_month, hours, _ = catalog.disk_price(app.settings, cloud, currency)
    if per_gb_month is None:
        return None
    return per_gb_month * disk_gb / hours


def record_event(
    app: App,
    machine_id: str,
    kind: str,
    *,
    reason: str | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    with app.db.session() as s:
        s.add(
            Event(
                machine_id=machine_id,
                at=app.clock.now(),
                kind=kind,
                reason=reason,
                detail=detail or {},
            )
        )


# --- stop / start / down ------------------------------------------------------------------


def find(app: App, name: str) -> Machine:
    with app.db.session() as s:
        m = live_machine(s, name)
    if m is None:
        raise UserError(f"no machine named {name!r} (see `provisioner status`)")
    return m


def ref(m: Machine) -> InstanceRef:
    return InstanceRef(
        id=m.instance_id or "", region=m.region or "", zone=m.zone or "", name=m.resource_name or ""
    )


def can_stop(m: Machine) -> bool:
    """Whether ``m``'s cloud can stop it and start it again (not an AWS one-time spot)."""
    return (
        m.market != "spot"
        or m.cloud not in providers.REGISTRY
        or (providers.spec(m.cloud).capabilities.stop_spot)
    )


def stop(
    app: App, name: str, *, reason: str = "user", detail: dict[str, Any] | None = None
) -> tuple[Machine, bool]:
    """Stop so compute billing ends; disks stay. Returns (machine, changed)."""
    m = find(app, name)
    if m.status in ("stopped", "preempted"):
        return m, False
    _require_launched(m)
    if not can_stop(m):
        raise UserError(
            f"{m.name} is a spot machine on {m.cloud}, which cannot stop one (it launches spot "
            f"as one-time requests): `provisioner down {m.name}` ends its billing"
        )
    _provider_call(app, m, "stop")
    return _transition(app, m.id, "stopped", event="stopped", reason=reason, detail=detail)


def start(app: App, name: str, *, reason: str = "user") -> tuple[Machine, bool]:
    """Start a stopped machine, within policy and budget as ``up`` (same refusal, exit 2).
    Concurrent starts of one machine start it once (the intent's lock); the check and the
    start are serialised with other ``up``s and ``start``s (the ``intents`` lock)."""
    m = find(app, name)
    if m.status in ("running", "pending"):
        return m, False
    _require_launched(m)
    with app.db.lock(f"intent-{m.id}"), app.db.lock("intents"):
        with app.db.session() as s:
            m = machine_row(s, m.id)
        if m.status in ("running", "pending"):  # a concurrent start did it
            return m, False
        _check_start(app, m)
        _provider_call(app, m, "start")
        return _transition(app, m.id, "running", event="started", reason=reason)


def _check_start(app: App, m: Machine) -> None:
    """The machine's stored experiment checked as ``up`` checks it, for the machine's own
    offer at its launch-time rate (its disk is already counted: it bills while stopped)."""
    experiment = Experiment.model_validate(m.spec)
    rate = Money(m.rate or Decimal(0), m.currency or app.settings.currency)
    spot = m.market == "spot"
    offer = Offer(
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
    base = app.settings.money_rates.convert(rate, app.settings.currency)
    cand = Candidate(offer, "spot" if spot else "reserved", rate, base)
    plan = planning.check_known(app, experiment, cand)
    _refuse_by_policy(plan)
    budget.guard(plan)


def hold(app: App, m: Machine, why: str) -> Machine:
    """A preempted machine whose relaunch policy or budget refuses is kept: stopped, with its
    disk (a cloud that cannot stop it has nothing left to keep, and it is terminated); the
    refusal is recorded as ``relaunch-refused`` and shown by `status`."""
    detail = {"refused": why}
    if not can_stop(m):
        return down(app, m.name, reason="relaunch-refused", detail=detail)[0]
    _provider_call(app, m, "stop")
    return _transition(
        app, m.id, "stopped", event="relaunch-refused", reason="preempted", detail=detail
    )[0]


def down(
    app: App, name: str, *, reason: str = "user", detail: dict[str, Any] | None = None
) -> tuple[Machine, bool]:
    """Terminate and close every usage interval. An intent that never launched is closed too."""
    with app.db.session() as s:
        m = named_machine(s, name)
    if m is None:
        raise UserError(f"no machine named {name!r} (see `provisioner status --all`)")
    if not m.is_live:
        return m, False
    if m.status == "requested":
        # an `up` may be launching it right now: it will see this and terminate what it
        # launches; we wait for it on the intent's lock (at once if no `up` runs)
        record_event(app, m.id, "cancel-requested", reason=reason)
        try:
            with app.db.lock(f"intent-{m.id}", timeout=DOWN_WAIT_SECONDS):
                with app.db.session() as s:
                    m = machine_row(s, m.id)
                if not m.is_live:  # the launching `up` settled it
                    return m, True
                if m.status == "requested":
                    adopted = _adopt(app, m, lambda _: None)
                    if adopted is None:
                        return _transition(app, m.id, "failed", event="cancelled", reason=reason)
                    m = adopted
                _provider_call(app, m, "terminate")
                return _transition(
                    app, m.id, "terminated", event="terminated", reason=reason, detail=detail
                )
        except LockBusy:
            raise OperationFailed(
                f"{name}: an `up` is still launching it after {DOWN_WAIT_SECONDS} s; it will "
                f"terminate what it launches (see `provisioner status --all`)"
            ) from None
    _provider_call(app, m, "terminate")
    return _transition(app, m.id, "terminated", event="terminated", reason=reason, detail=detail)


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
        for m in [m for m in ms if m.status == "requested"]:
            try:
                done, changed = down(app, m.name, reason=reason)
                out[m.id] = Outcome(done, changed)
            except (UserError, OperationFailed) as e:
                out[m.id] = Outcome(m, error=str(e))
        rest = [m for m in ms if m.status != "requested"]
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
    done = act(list(found.values()))
    return {
        n: done[found[n].id]
        if n in found
        else UserError(f"no machine named {n!r} (see `provisioner status`)")
        for n in wanted
    }


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
    transaction. One machine's failure is its own: machine id → outcome."""
    out: dict[str, Outcome] = {}
    by_cloud: dict[str, list[Machine]] = {}
    for m in machines:
        if (op == "stop" and m.status in ("stopped", "preempted")) or not m.is_live:
            out[m.id] = Outcome(m)
        elif m.status == "requested" or not m.instance_id:
            out[m.id] = Outcome(m, error=f"{m.name} is still being launched")
        elif op == "stop" and not can_stop(m):
            out[m.id] = Outcome(
                m,
                error=f"{m.name} is a spot machine on {m.cloud}, which "
                "cannot stop one: `provisioner down` ends its billing",
            )
        else:
            by_cloud.setdefault(m.cloud or "", []).append(m)
    status, event = ("stopped", "stopped") if op == "stop" else ("terminated", "terminated")
    for cloud, ms in by_cloud.items():
        refs = {m.id: ref(m) for m in ms}
        try:
            provider = app.provider(cloud)
            batch = provider.stop_many if op == "stop" else provider.terminate_many
            results: dict[InstanceRef, ProviderError | None] = batch(list(refs.values()))
        except (ProviderError, UserError) as e:
            results = dict.fromkeys(refs.values(), ProviderError(str(e)))
        done = []
        for m in ms:
            err = results.get(refs[m.id], ProviderError("no answer for it"))
            if err is None or (op == "terminate" and isinstance(err, NotFound)):
                done.append(m)
            elif isinstance(err, NotFound):
                out[m.id] = Outcome(m, error=f"{m.name}: the cloud no longer has {m.instance_id}")
            else:
                out[m.id] = Outcome(m, error=f"{m.name}: {op} failed: {err}")
        crashpoint(f"after-{op}")  # the cloud acted, the state does not know yet
        if not done:
            continue
        now = app.clock.now()
        with app.db.session() as s:  # one transaction for the batch
            ids = [m.id for m in done]
            rows = list(s.scalars(select(Machine).where(Machine.id.in_(ids))))
            changed = ledger.record_transitions(
                s, rows, status, now, event=event, reason=reason, details=details
            )
            for row in rows:
                out[row.id] = Outcome(row, changed[row.id])
    return out


def _require_launched(m: Machine) -> None:
    if m.status == "requested" or not m.instance_id:
        raise UserError(
            f"{m.name} is still being launched; run `provisioner up` again to finish, or `down` it"
        )


def _provider_call(app: App, m: Machine, op: str) -> None:
    try:
        getattr(app.provider(m.cloud or ""), op)(ref(m))
    except NotFound:
        if op != "terminate":
            raise OperationFailed(f"{m.name}: the cloud no longer has {m.instance_id}") from None
    except ProviderError as e:
        raise OperationFailed(f"{m.name}: {op} failed: {e}") from None
    crashpoint(f"after-{op}")  # the cloud acted, the state does not know yet


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
                s, mm, "running", app.clock.now(), event="booted", reason="launched"
            )
        progress(f"{m.name} runs at {inst.public_ip}; waiting for SSH…")
        left = max(deadline - time.monotonic(), 0)
        _, up = wait_until(
            lambda: provider.accepts_ssh(inst), bool, timeout=left, interval=interval
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


def _transition(app: App, machine_id: str, status: str, **kw: Any) -> tuple[Machine, bool]:
    with app.db.session() as s:
        m = machine_row(s, machine_id)
        changed = ledger.record_transition(s, m, status, app.clock.now(), **kw)
        return m, changed


# --- reconcile ----------------------------------------------------------------------------


@dataclass
class Observation:
    machine: Machine
    observed: str | None  # status the cloud reports, None when it could not be asked
    changed: bool
    error: str | None = None


@dataclass(frozen=True)
class Orphan:
    """A machine carrying our tag that no live machine in the state owns: it bills, unseen."""

    cloud: str
    instance: Instance
    adoptable_by: str | None = None  # the name of an interrupted `up` that launched it

    def __str__(self) -> str:
        i = self.instance
        where = f"{self.cloud}/{i.zone or i.region} {i.id} ({i.name}, {i.state.value})"
        if self.adoptable_by:
            return (
                f"{where}: an interrupted `up` of {self.adoptable_by} launched it; rerun to adopt"
            )
        return f"{where}: no machine in the state owns it"


def _orphans(app: App, cloud: str, listed: Iterable[Instance]) -> list[Orphan]:
    with app.db.session() as s:
        rows = s.execute(
            select(Machine.id, Machine.name, Machine.status, Machine.instance_id).where(
                Machine.cloud.is_(None) | (Machine.cloud == cloud)
            )
        ).all()
    owned = {iid for _, _, status, iid in rows if iid and status not in ACTIVE_EXCLUDED}
    launching = {mid: name for mid, name, status, _ in rows if status == "requested"}
    return [
        Orphan(cloud, i, launching.get(i.machine_id or ""))
        for i in listed
        if i.state != MachineState.TERMINATED and i.id not in owned
    ]


def orphans(app: App, clouds: Iterable[str] | None = None) -> tuple[list[Orphan], dict[str, str]]:
    """Orphans in every enabled cloud (not only where the state has machines), and the clouds
    that could not be asked, with why."""
    found: list[Orphan] = []
    errors: dict[str, str] = {}
    for cloud in clouds or app.settings.enabled_clouds:
        try:
            provider = app.provider(cloud)
            check = provider.check()
            if not check.ok:
                errors[cloud] = check.message
                continue
            found += _orphans(app, cloud, provider.list_managed())
        except ProviderError as e:
            errors[cloud] = str(e)
    return found, errors


def unused_network(
    app: App, clouds: Iterable[str] | None, errors: dict[str, str], *, remove: bool
) -> dict[str, list[str]]:
    """Each asked cloud's network pieces of ours that no machine uses (removed when
    ``remove``); a cloud that could not be asked before is skipped, one that fails now is
    added to ``errors``."""
    out: dict[str, list[str]] = {}
    for cloud in clouds or app.settings.enabled_clouds:
        if cloud in errors:
            continue
        try:
            pieces = app.provider(cloud).unused_network(remove=remove)
        except ProviderError as e:
            errors[cloud] = str(e)
            continue
        if pieces:
            out[cloud] = pieces
    return out


def collect(app: App, found: Iterable[Orphan]) -> list[Orphan]:
    """Terminate orphans (never one an interrupted `up` may still adopt); returns those done."""
    done = []
    for o in found:
        if o.adoptable_by:
            continue
        app.provider(o.cloud).terminate(o.instance.ref)
        done.append(o)
    return done


def reconcile(
    app: App,
    *,
    now: datetime | None = None,
    orphans: list[Orphan] | None = None,
    keep: Callable[[], bool] = lambda: True,
) -> list[Observation]:
    """Ask each cloud about every live machine and record what changed (a preemption, a machine
    stopped or deleted outside provisioner). One list call per cloud, not one call per machine.
    ``orphans``, when given, receives the orphans seen in those lists. ``keep()`` is asked
    before each cloud and each machine (a scheduler keeps its lease): False stops here, with
    what was observed so far."""
    now = now or app.clock.now()
    with app.db.session() as s:
        machines = list(
            s.scalars(
                select(Machine).where(Machine.status.not_in(("terminated", "failed", "requested")))
            )
        )
    out: list[Observation] = []
    by_cloud: dict[str, list[Machine]] = {}
    for m in machines:
        by_cloud.setdefault(m.cloud or "", []).append(m)
    for cloud, ms in by_cloud.items():
        if not keep():
            return out
        try:
            seen = {
                i.id: i
                for i in app.provider(cloud).list_managed(
                    sorted({m.region for m in ms if m.region})
                )
            }
        except ProviderError as e:
            out += [Observation(m, None, False, str(e)) for m in ms]
            continue
        if orphans is not None:
            orphans += _orphans(app, cloud, seen.values())
        for m in ms:
            if not keep():
                return out
            inst = seen.get(m.instance_id or "")
            if inst is None:  # not listed: ask directly (terminated machines drop out of lists)
                try:
                    inst = app.provider(cloud).get(ref(m))
                except NotFound:
                    inst = None
                except ProviderError as e:
                    out.append(Observation(m, None, False, str(e)))
                    continue
            status, address = observed(inst, m.public_ip)
            # A launched machine finishing its boot is no outside change, and its running time
            # started at launch: "booted" is not a running-since event (idle windows).
            booted = m.status == "pending" and status == "running"
            reason = (
                "preempted"
                if status == "preempted"
                else "launched"
                if booted
                else "outside-provisioner"
            )
            if status == m.status and address == m.public_ip:
                out.append(Observation(m, status, False))  # no write per unchanged machine
                continue
            with app.db.session() as s:
                row = s.get(Machine, m.id)
                if row is None or row.status != m.status:
                    # deleted by hand, or changed by another process since we read it: what the
                    # cloud said is about the old row — skip it, the next reconcile sees anew
                    log.warning("reconcile: %s (%s) changed meanwhile; skipped", m.name, m.id)
                    continue
                mm = row
                mm.public_ip = address
                if status == m.status:
                    out.append(Observation(mm, status, False))
                    continue
                changed = ledger.record_transition(
                    s,
                    mm,
                    status,
                    now,
                    event="booted" if booted else None,
                    reason=reason,
                    detail={
                        "observed": inst.state.value if inst else "gone",
                        "cloud_reason": inst.state_reason if inst else None,
                    },
                )
            out.append(Observation(mm, status, changed))
    return out
