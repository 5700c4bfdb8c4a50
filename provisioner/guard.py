"""The rules a machine enforces on itself, and who enforces each one.

At launch the startup data writes the machine's ``guard.json`` (:func:`guard_doc`): its autostop
(the experiment's, capped by a matching policy's ``max_autostop``), the idle threshold, the job
whose end stops it (``lifecycle.on_finish``) and when its lifetime ends. The machine's agent
(:mod:`provisioner.agent_guard`) powers it off when one of them is due — with no scheduler, no
endpoint and no laptop.

Whether that power-off ends the bill is the cloud's fact (``CloudSpec.guest_shutdown``): AWS, GCP,
Yandex and SberCloud stop the machine; an AWS one-time spot instance is terminated; an Azure VM
stopped from inside keeps billing until the scheduler deallocates it. :func:`enforcement` says
so, per offer, for ``plan`` and ``up``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from policies.duration import short_duration
from policies.schema import IdleRule, autostop_cap, matching
from providers.spec import KEEPS_BILLING, TERMINATES, CloudSpec

if TYPE_CHECKING:
    from policies.schema import Policy
    from provisioner.spec import Experiment

RUN_JOB = "run"  # the job id `up` starts the experiment's `run` as (machines.jobs.start_run)
SCHEDULER = "the scheduler (`provisioner sweep` from cron, or `provisioner scheduler run`)"


@dataclass(frozen=True)
class Rules:
    """What stops a machine of this experiment, from the experiment and the matching policies."""

    autostop: timedelta | None
    autostop_from: str  # "experiment", or how a policy's max_autostop caps or gives it
    idle_below: float  # percent: every GPU under it is idle
    gpus_only: bool  # the idle rule counts the GPUs only (a running job may idle)
    on_finish: str | None  # "stop" or "terminate" once the run ends; None: kept
    lifetime: tuple[timedelta, str, str] | None  # (after, action, from), the shortest
    # idle rules only the scheduler applies (a calendar, or the experiment's lifecycle.idle)
    scheduler_idle: list[str] = field(default_factory=list)


def rules(experiment: Experiment, policies: list[Policy]) -> Rules:
    """The machine's rules, as the scheduler would judge them (jobs.sweep.RuleBook,
    jobs.autostop.setting)."""
    mine = matching(policies, experiment.project, experiment.owner)
    life = experiment.lifecycle
    autostop, source = _autostop(experiment, policies)
    idle_rules, scheduler_idle = _idle(experiment, mine)
    below = min((r.gpu_util_below for r in idle_rules), default=IdleRule().gpu_util_below)
    lifetimes = [
        (p.max_lifetime.after, p.max_lifetime.action, f"policy {p.name}")
        for p in mine
        if p.max_lifetime is not None
    ]
    if life.max_lifetime is not None:
        lifetimes.append((life.max_lifetime, "stop", "experiment"))
    lifetime = min(lifetimes, key=lambda x: (x[0], x[1] != "terminate")) if lifetimes else None
    finish = experiment.on_finish
    return Rules(
        autostop=autostop,
        autostop_from=source,
        idle_below=below,
        gpus_only=any(getattr(r, "gpus_only", False) for r in idle_rules),
        on_finish=finish if finish in ("stop", "terminate") and experiment.run else None,
        lifetime=lifetime,
        scheduler_idle=scheduler_idle,
    )


def _autostop(experiment: Experiment, policies: list[Policy]) -> tuple[timedelta | None, str]:
    """The experiment's autostop under the policies' ``max_autostop``, and where it is from."""
    own = experiment.lifecycle.autostop
    cap = autostop_cap(policies, experiment.project, experiment.owner)
    if cap is not None and own is not None and own > cap[0]:
        return cap[0], f"capped from {short_duration(own)} by policy {cap[1]}"
    if cap is not None and own is None:
        return cap[0], f"policy {cap[1]}'s max_autostop"
    return own, "experiment"


def _idle(experiment: Experiment, mine: list[Policy]) -> tuple[list[IdleRule], list[str]]:
    """The idle rules the scheduler holds the machine to, and whose each is."""
    life = experiment.lifecycle
    idle_rules: list[IdleRule] = [r for p in mine if (r := p.idle_rule) is not None]
    scheduler_idle = [
        f"policy {p.name}" + (" (off hours)" if p.off_hours else "")
        for p in mine
        if p.idle_rule is not None
    ]
    if life.idle is not None:
        idle_rules.append(IdleRule(**life.idle.model_dump()))
        scheduler_idle.append(f"lifecycle.idle ({life.idle.for_minutes} min)")
    return idle_rules, scheduler_idle


def jobs_dir(login_user: str) -> str:
    """Where the supervisor keeps the login user's jobs (templates/provisioner-job.sh)."""
    home = "/root" if login_user == "root" else f"/home/{login_user}"
    return f"{home}/.provisioner/jobs"


def _iso(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def guard_doc(r: Rules, machine_id: str, launched_at: datetime, login_user: str) -> dict[str, Any]:
    """The machine's ``guard.json`` (the contract's format, version 1)."""
    return {
        "v": 1,
        "machine": machine_id,
        "launched_at": _iso(launched_at),
        "autostop_s": None if r.autostop is None else round(r.autostop.total_seconds()),
        "idle": {"gpu_util_below": r.idle_below, "gpus_only": r.gpus_only},
        "on_finish": {"job": RUN_JOB, "action": r.on_finish} if r.on_finish else None,
        "max_lifetime_at": _iso(launched_at + r.lifetime[0]) if r.lifetime else None,
        "max_lifetime_action": r.lifetime[1] if r.lifetime else "stop",
        "jobs_dir": jobs_dir(login_user),
    }


def describe(r: Rules) -> str:
    """``autostop 10m, on_finish stop, max_lifetime 48h``; empty when none applies."""
    parts = []
    if r.autostop is not None:
        by = "" if r.autostop_from == "experiment" else f" ({r.autostop_from})"
        parts.append(f"autostop {short_duration(r.autostop)}{by}")
    if r.on_finish:
        parts.append(f"on_finish {r.on_finish}")
    if r.lifetime:
        after, action, source = r.lifetime
        by = "" if source == "experiment" else f", {source}"
        parts.append(f"max_lifetime {short_duration(after)} ({action}{by})")
    return ", ".join(parts)


def enforcement(r: Rules, cloud: CloudSpec, market: str, instance_type: str = "") -> list[str]:
    """Who enforces each rule on a machine of this offer, and whether billing ends, in a line
    or two for ``plan`` and ``up``."""
    out: list[str] = []
    what = describe(r)
    gs = cloud.guest_shutdown
    effect = gs.effect(market, instance_type)
    if what:
        if effect == KEEPS_BILLING:
            by_market = gs.spot if market == "spot" else gs.on_demand
            why = (
                f"{gs.flavors_why} ({instance_type})"
                if by_market != KEEPS_BILLING
                else f"a {cloud.title} machine stopped from inside keeps billing until deallocated"
            )
            out.append(
                f"{what}: the machine's agent powers it off, but {why}: {SCHEDULER} "
                f"{'deallocates' if cloud.name == 'azure' else 'ends'} it — run one"
            )
        elif effect == TERMINATES:
            out.append(
                f"{what}: on the machine (its agent powers it off; {cloud.title} then "
                f"terminates a {market} machine: its boot disk goes, volumes stay)"
            )
        else:
            out.append(
                f"{what}: on the machine (its agent powers it off; compute billing ends — "
                f"{cloud.title}), with no scheduler, endpoint or laptop needed"
            )
        terminate = r.on_finish == "terminate" or (r.lifetime and r.lifetime[1] == "terminate")
        if terminate and effect != TERMINATES:
            out.append(f"terminate: the machine only powers off; {SCHEDULER} deletes it")
    if r.scheduler_idle:
        out.append(f"idle rules ({', '.join(r.scheduler_idle)}): {SCHEDULER}")
    return out
