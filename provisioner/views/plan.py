"""An experiment's plan as ``provisioner plan`` and the dashboard's Plan page show it: the
candidates cheapest first, the cheapest per cloud, offers that fit but have no price, the
reasons others were turned down (each with an example), and the policy and budget verdicts.

Loads no database code unless a rule needs the state (``plan`` stays quick)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from provisioner.money import Money

if TYPE_CHECKING:
    from provisioner.app import App
    from provisioner.planner import Candidate, Plan
    from provisioner.spec import Experiment


@dataclass
class Reject:
    reason: str
    count: int
    example: str  # one offer it turned down


@dataclass
class PlanView:
    experiment: Experiment
    plan: Plan
    cheapest: list[tuple[str, Money]]  # per cloud, in the ranking currency, cheapest first
    unpriced: dict[str, list[str]]  # cloud: the instance types that fit but have no price
    rejects: list[Reject]  # most frequent first
    warnings: list[str] = field(default_factory=list)  # what a candidate's cloud will do to it
    addresses: list[str] = field(default_factory=list)  # what a public IPv4 adds, per cloud
    guard: list[str] = field(default_factory=list)  # who enforces each rule, per cloud/market

    @property
    def candidates(self) -> list[Candidate]:
        return self.plan.candidates

    @property
    def currency(self) -> str:
        return self.plan.currency

    @property
    def checks(self) -> list[Any]:
        """The policy decision and the budget projection (each says itself with ``str``)."""
        return self.plan.checks

    @property
    def refusal(self) -> str | None:
        """Why ``up`` would launch none of the candidates — a policy's verdict, or a budget the
        cheapest would overrun (so would every dearer one) — or None: it tries them in order."""
        for c in self.plan.checks:
            if getattr(c, "allowed", True) is False:
                return str(c)
            if getattr(c, "over", False):
                st, (_, cost) = c.status, c.cheapest
                return f"budget {st.policy.name} ({st.period.label}) overrun by {cost - st.left}"
        return None

    @property
    def refused(self) -> bool:
        return self.refusal is not None

    @property
    def launchable(self) -> list[Candidate]:
        """What ``up`` would try, in order: the candidates, or none when it would refuse."""
        return [] if self.refused else self.candidates


def plan(app: App, experiment: Experiment, source: str | None = None) -> PlanView:
    """``source``: the experiment's file, named when its startup data fits no cloud."""
    from provisioner import (  # policies and the catalog: not for --help
        catalog_checks,
        fits,
        planning,
    )

    p = planning.plan(app, experiment)
    fits.drop_unfit(app, experiment, p, source)
    best: dict[str, Candidate] = {}
    for c in p.candidates:  # ranked: the first of a cloud is its cheapest
        best.setdefault(c.offer.cloud, c)
    unpriced: dict[str, set[str]] = {}
    for o in p.unpriced:
        unpriced.setdefault(o.cloud, set()).add(o.instance_type)
    return PlanView(
        experiment,
        p,
        sorted(((cl, best[cl].price_base) for cl in sorted(best)), key=lambda x: x[1].amount),
        {cl: sorted(types) for cl, types in sorted(unpriced.items())},
        [Reject(r, n, p.examples.get(r, "")) for r, n in p.summary_reasons()],
        unstoppable_spot(p.candidates)
        + autostop_cap(app, experiment)
        + catalog_checks.stale([c.offer for c in p.candidates], app.clock.now().date()),
        address_rates(app, p.candidates),
        guard_lines(app, experiment, p.candidates),
    )


def guard_lines(app: App, experiment: Experiment, candidates: list[Candidate]) -> list[str]:
    """Who enforces autostop, on_finish and max_lifetime on a machine of each candidate cloud
    and market (its own agent, or the scheduler where a power-off keeps billing), and the idle
    rules only the scheduler applies: each line once, in the candidates' order."""
    import providers
    from provisioner import guard

    r = guard.rules(experiment, app.policies)
    out: list[str] = []
    for c in candidates:
        where = f"{c.offer.cloud} {c.market}"
        lines = guard.enforcement(r, providers.spec(c.offer.cloud), c.market, c.offer.instance_type)
        for line in lines:
            said = line if line.startswith("idle rules") else f"{where}: {line}"
            if said not in out:
                out.append(said)
    return sorted(out, key=lambda x: x.startswith("idle rules"))  # the scheduler's last


def machine_guard(app: App, m: Any) -> list[str]:
    """At ``up``: who enforces each rule on the machine just launched."""
    import providers
    from provisioner import guard
    from provisioner.spec import Experiment

    r = guard.rules(Experiment.model_validate(m.spec), app.policies)
    spec = providers.spec(m.cloud)
    return guard.enforcement(r, spec, m.market or "reserved", m.instance_type or "")


def address_rates(app: App, candidates: list[Candidate]) -> list[str]:
    """What each candidate cloud's public IPv4 address adds to a machine's rate (the ledger
    counts it apart from compute, at the rate fixed at launch), or that it is billed at a rate
    not known here; and a boot disk billed at a rate not known here."""
    from provisioner.catalog import address_rate, disk_price

    out, seen = [], set()
    for c in candidates:
        key = (c.offer.cloud, c.price.currency)
        if key in seen:
            continue
        seen.add(key)
        if disk_price(app.settings, *key)[0] is None:
            out.append(
                f"{key[0]} boot disk billed while it exists, at a rate not known here: set "
                f"disk_prices.{key[0]} in settings to count it"
            )
        rate, billed = address_rate(app.settings, *key)
        if billed in ("none", "free"):
            continue
        when = "while it runs" if billed == "running" else "until it is deleted, stopped or not"
        if rate is None:
            out.append(
                f"{key[0]} billed {when}, at a rate not known here: set "
                f"address_prices.{key[0]} in settings to count it"
            )
        elif rate:
            out.append(f"{key[0]} + {rate} {key[1]}/h, {when}")
    return out


def autostop_cap(app: App, experiment: Experiment) -> list[str]:
    """A policy's ``max_autostop`` over the file's ``lifecycle.autostop`` (or none), in words."""
    from policies.duration import short_duration as short
    from policies.schema import autostop_cap

    cap = autostop_cap(app.policies, experiment.project, experiment.owner)
    own = experiment.lifecycle.autostop
    if cap is None or (own is not None and own <= cap[0]):
        return []
    was = f"lifecycle.autostop {short(own)}" if own else "no lifecycle.autostop"
    return [
        f"policy {cap[1]}: max_autostop {short(cap[0])}: {was}, so it is stopped once "
        f"idle (GPUs, jobs, SSH) for {short(cap[0])}, at any hour"
    ]


def unstoppable_spot(candidates: list[Candidate]) -> list[str]:
    """For each cloud among the spot candidates that cannot stop a spot machine (AWS launches
    one-time requests), what that means for the machine and its data, in words."""
    import providers

    clouds = sorted(
        {
            c.offer.cloud
            for c in candidates
            if c.spot
            and c.offer.cloud in providers.REGISTRY
            and not providers.spec(c.offer.cloud).capabilities.stop_spot
        }
    )
    return [
        f"{cloud} cannot stop a spot machine: an out-of-hours idle stop terminates it and its "
        f"boot disk, not its volumes (its owner is warned first); `provisioner down` is how it ends"
        for cloud in clouds
    ]


@dataclass
class PlanPage:
    """The Plan page's answer: the plan of a file or of pasted YAML, or what is wrong with it
    (as the CLI says it: file, line, field)."""

    source: str
    view: PlanView | None = None
    problems: list[str] = field(default_factory=list)


def plan_page(
    app: App,
    *,
    path: str | None = None,
    text: str | None = None,
    owner: Callable[[], str] | None = None,
) -> PlanPage:
    """``owner``: whose plan it is when the file names no owner (the viewer)."""
    from policies import yamlfile
    from provisioner import skypilot
    from provisioner.errors import ConfigError, ProvisionerError
    from provisioner.spec import Experiment

    source = path or "pasted"
    try:
        if path:  # an experiment file, or a SkyPilot task file (docs/SKYPILOT.md)
            e = skypilot.load(
                path, app.settings.money_rates.per_base, owner, app.settings.workdir.limits
            ).experiment
        else:
            data, lines = yamlfile.load_document(source, text or "")
            e = yamlfile.validate(
                Experiment, data, lines, source, what="experiment file", context={"actor": owner}
            )
        return PlanPage(source, plan(app, e))
    except ConfigError as err:
        return PlanPage(source, problems=[str(p) for p in err.problems])
    except ProvisionerError as err:
        return PlanPage(source, problems=[str(err)])
