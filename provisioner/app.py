"""The application context: settings, clock, state database, providers. One per command."""

from __future__ import annotations

from collections.abc import Iterable
from decimal import Decimal
from functools import cached_property
from typing import TYPE_CHECKING

import providers
from providers.base import Offer, Provider
from provisioner import catalog, planner
from provisioner.clock import Clock
from provisioner.errors import UserError
from provisioner.money import Money
from provisioner.settings import Settings
from provisioner.spec import Experiment

if TYPE_CHECKING:
    from policies.evaluate import Decision
    from policies.schema import Policy
    from provisioner.state import Database


class App:
    def __init__(self, settings: Settings, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock = clock or Clock()
        self._providers: dict[str, Provider] = {}

    @cached_property
    def db(self) -> Database:
        from provisioner.state import Database  # SQLAlchemy costs ~0.2 s: only when state is used

        db = Database(self.settings.database_url)
        db.migrate()
        return db

    def provider(self, cloud: str) -> Provider:
        """The adapter for ``cloud``, built once with its options from settings."""
        if cloud not in self._providers:
            if cloud not in self.settings.clouds:
                raise UserError(f"cloud {cloud!r} is not enabled in settings")
            options = self.settings.cloud_options(cloud)
            if cloud == "sandbox":
                options.setdefault("db_path", str(self.settings.home / "sandbox.db"))
                options.setdefault("clock", self.clock.now)
            self._providers[cloud] = providers.create(cloud, options)
        return self._providers[cloud]

    def use_provider(self, cloud: str, provider: Provider) -> None:
        """Use this adapter instance for ``cloud`` (e.g. one built with an explicit credential)."""
        self._providers[cloud] = provider

    def offers(self, clouds: Iterable[str] | None = None) -> list[Offer]:
        return catalog.load(self.settings, clouds or self.settings.enabled_clouds)

    def plan(self, experiment: Experiment) -> planner.Plan:
        """Candidates for ``experiment`` in the order ``up`` would try them."""
        res = experiment.resources
        clouds = [c for c in (res.clouds or providers.CLOUDS) if c in self.settings.enabled_clouds]
        decision, policy_check = self._policy(experiment)
        plan = planner.plan(
            experiment,
            self.offers(clouds),
            self.settings.money_rates,
            enabled_clouds=self.settings.enabled_clouds,
            policy_check=policy_check,
        )
        if decision.rejected:  # policy turned offers down: say whether any is left
            decision.candidates_allowed = len(plan.candidates)
        plan.checks.append(decision)
        if any(
            p.budget is not None for p in self.policies
        ):  # the ledger costs SQLAlchemy: only then
            from provisioner import budget

            # what the new machine would add to each budget that applies
            plan.checks.extend(budget.projections(self, plan))
        return plan

    # -- policies (scheduler helper) -----------------------------------------------------------

    @cached_property
    def policies(self) -> list[Policy]:
        """The policy files and directories named in settings: all of them, or an error naming
        every problem's file, line and field (never half of the rules)."""
        from policies import loader

        return loader.load(self.settings.policies) if self.settings.policies else []

    def _policy(self, experiment: Experiment) -> tuple[Decision, planner.PolicyCheck]:
        """The request-level decision, and the per-candidate check for the planner (each offer
        it turns down counted on the decision under the rule it broke)."""
        from policies import evaluate as pe
        from policies.schema import matching

        res = experiment.resources
        applied = matching(self.policies, experiment.project, experiment.owner)
        active: tuple[tuple[str, str], ...] = ()
        if any(p.max_machines is not None for p in applied):
            from sqlalchemy import select

            from provisioner.models import ACTIVE_EXCLUDED, Machine

            with self.db.session() as s:
                rows = s.execute(
                    select(Machine.project, Machine.owner).where(
                        Machine.status.not_in(ACTIVE_EXCLUDED), Machine.name != experiment.name
                    )
                )
                active = tuple((project, owner) for project, owner in rows)
        request = pe.Request(
            project=experiment.project,
            owner=experiment.owner,
            gpu=res.gpu.type,
            gpu_count=res.gpu.count,
            market=res.market,
            clouds=tuple(res.clouds) if res.clouds else None,
            active=active,
        )
        decision = pe.evaluate(request, applied)
        rates = self.settings.money_rates

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

    def close(self) -> None:
        if "db" in self.__dict__:
            self.db.dispose()
