"""The plan for one experiment in this context: the catalog's offers ranked by the planner, under
the policies that apply (the request-level decision, and each offer checked against the rules),
with what the cheapest candidate would add to each budget. ``plan`` shows it; ``up`` follows it.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import providers
from policies import evaluate as pe
from policies.schema import matching
from providers import disks
from provisioner import planner
from provisioner.app import App
from provisioner.money import Money
from provisioner.schema import VolumeStatus
from provisioner.spec import Experiment


def plan(app: App, experiment: Experiment) -> planner.Plan:
    """Candidates for ``experiment`` in the order ``up`` would try them."""
    res = experiment.resources
    clouds = [c for c in (res.clouds or providers.CLOUDS) if c in app.settings.enabled_clouds]
    decision, policy_check = _policy(app, experiment)
    p = planner.plan(
        experiment,
        app.offers(clouds, gpu_family=res.gpu.family, gpu_count=res.gpu.count),
        app.settings.money_rates,
        enabled_clouds=app.settings.enabled_clouds,
        policy_check=policy_check,
    )
    if decision.rejected:  # policy turned offers down: say whether any is left
        decision.candidates_allowed = len(p.candidates)
    p.checks.append(decision)
    if experiment.volumes:
        _volumes(app, experiment, p)
    if any(policy.budget is not None or policy.per_owner for policy in app.policies):
        from provisioner import budget  # the ledger costs SQLAlchemy (~0.2 s): only with budgets

        # what the new machine would add to each budget that applies
        p.checks.extend(budget.projections(app, p))
    return p


def check_known(app: App, experiment: Experiment, candidate: planner.Candidate) -> planner.Plan:
    """The checks of :func:`plan` for one known candidate (a stopped machine started again,
    at its launch-time rate): the policy decision and each budget's projection."""
    decision, policy_check = _policy(app, experiment)
    p = planner.Plan(experiment, [candidate], currency=app.settings.currency)
    if policy_check(candidate) is not None:
        p.candidates = []
    decision.candidates_allowed = len(p.candidates)
    p.checks.append(decision)
    if any(policy.budget is not None or policy.per_owner for policy in app.policies):
        from provisioner import budget

        p.checks.extend(budget.projections(app, p, disk_gb=0))
    return p


def _volumes(app: App, experiment: Experiment, p: planner.Plan) -> None:
    """Only clouds with volumes; the volumes the project has already (live, in any state):
    the first pins the plan to its cloud and zone; the others the budget counts as new."""
    from sqlalchemy import select  # SQLAlchemy (~0.2 s): only for an experiment with volumes

    from provisioner.models import Machine, Volume  # as above

    _only_clouds_with_volumes(p)
    names = [v.name for v in experiment.volumes]
    with app.db.session() as s:
        found = {
            v.name: v
            for v in s.scalars(
                select(Volume).where(
                    Volume.project == experiment.project,
                    Volume.name.in_(names),
                    Volume.status != VolumeStatus.DELETED,
                )
            )
        }
        kinds = {v.name: _disk_type(s.get(Machine, v.id)) for v in found.values()}
    p.new_volume_gb = sum(v.size_gb for v in experiment.volumes if v.name not in found)
    _pin_to_first(p, names, found)

    def unmountable(c: planner.Candidate) -> str | None:
        """A volume that exists is of one disk type; a family that cannot take it is turned
        down here, not after its machine bills with the attach refused (GCP: A3 Ultra and A4
        take Hyperdisk only, N1/A2/G2 no Hyperdisk Balanced)."""
        o = c.offer
        for name, v in found.items():
            kind = kinds[name] or disks.DEFAULTS.get(v.cloud, "")
            if v.cloud == o.cloud and (why := disks.refusal(o.cloud, o.instance_type, kind)):
                return f"volume {name} is {kind}: {why}"
        return None

    p.refuse(unmountable)


def _only_clouds_with_volumes(p: planner.Plan) -> None:
    """Turn down the candidates of clouds whose adapter has no volume service."""
    lacking: dict[str, str] = {}
    for cloud in {c.offer.cloud for c in p.candidates}:
        if not providers.has_volumes(cloud):
            lacking[cloud] = f"no volumes on {cloud}: its adapter has no volume service"
    if lacking:
        keep: list[planner.Candidate] = []
        for c in p.candidates:
            if c.offer.cloud in lacking:
                p.reject(lacking[c.offer.cloud], c.offer)
            else:
                keep.append(c)
        p.candidates = keep


def _pin_to_first(p: planner.Plan, names: list[str], found: dict[str, Any]) -> None:
    """Pin the plan to the cloud and zone of the first volume found, in the experiment's
    order."""
    for name in names:
        if (v := found.get(name)) is not None:
            p.pin(planner.VolumePin(v.cloud, v.region, v.zone, v.name))
            break


def _disk_type(row: Any) -> str:
    """The disk type a volume's ledger row says it was made of ("" before types were kept)."""
    return str(((row.spec if row is not None else None) or {}).get("disk_type") or "")


def _policy(app: App, experiment: Experiment) -> tuple[pe.Decision, planner.PolicyCheck]:
    """The request-level decision, and the per-candidate check for the planner (each offer
    it turns down counted on the decision under the rule it broke)."""
    res = experiment.resources
    applied = matching(app.policies, experiment.project, experiment.owner)
    active: tuple[tuple[str, str], ...] = ()
    owned: tuple[tuple[str, int], ...] = ()
    per_owner = any(p.per_owner is not None for p in applied)
    if per_owner or any(p.max_machines is not None for p in applied):
        active, owned = _counted(app, experiment, per_owner)
    request = pe.Request(
        project=experiment.project,
        owner=experiment.owner,
        gpu=res.gpu.type,
        gpu_count=res.gpu.count,
        market=res.market,
        clouds=tuple(res.clouds) if res.clouds else None,
        active=active,
        owned=owned,
    )
    decision = pe.evaluate(request, applied)
    rates = app.settings.money_rates

    def convert(amount: Decimal, frm: str, to: str) -> Decimal:
        return rates.convert(Money(amount, frm), to).amount

    def check(c: planner.Candidate) -> str | None:
        o = c.offer
        facts = pe.CandidateFacts(
            o.cloud, o.region, o.gpu, o.gpu_count, c.market, c.price.amount, c.price.currency
        )
        broken = pe.check_candidate(facts, applied, convert)
        if not broken:
            return None
        decision.rejected[broken[0]] += 1
        return str(broken[0])

    return decision, check


def _counted(
    app: App, experiment: Experiment, per_owner: bool
) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, int], ...]]:
    """The machines a policy counts, besides the experiment's own: (project, owner) of each
    active one, and with ``per_owner`` (project, GPUs) of each of its owner's."""
    from sqlalchemy import select  # SQLAlchemy (~0.2 s): only when a policy counts machines

    from provisioner.models import ACTIVE_EXCLUDED, Machine  # as above

    # an intent waiting for capacity holds no machine: its own try counts it (requested)
    idle = (*ACTIVE_EXCLUDED, "waiting")
    with app.db.session() as s:
        rows = list(
            s.execute(
                select(Machine.project, Machine.owner, Machine.gpu_count, Machine.spec).where(
                    Machine.status.not_in(idle), Machine.name != experiment.name
                )
            )
        )
    active = tuple((project, owner) for project, owner, _, _ in rows)
    owned: tuple[tuple[str, int], ...] = ()
    if per_owner:  # an intent has no GPUs recorded yet: its experiment's count
        owned = tuple(
            (project, gpus or _spec_gpus(spec))
            for project, owner, gpus, spec in rows
            if owner == experiment.owner
        )
    return active, owned


def _spec_gpus(spec: dict[str, Any]) -> int:
    try:
        return int(spec["resources"]["gpu"]["count"])
    except (KeyError, TypeError, ValueError):
        return 1  # the experiment model's default
