"""The application context: settings, clock, state database, providers. One per command."""

from __future__ import annotations

from collections.abc import Iterable
from functools import cached_property
from typing import TYPE_CHECKING

import providers
from providers.base import Offer, Provider
from provisioner import catalog, planner
from provisioner.clock import Clock
from provisioner.errors import UserError
from provisioner.settings import Settings
from provisioner.spec import Experiment

if TYPE_CHECKING:
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
        plan = planner.plan(
            experiment,
            self.offers(clouds),
            self.settings.money_rates,
            enabled_clouds=self.settings.enabled_clouds,
        )
        # budget projection: what the new machine would add to each budget that applies
        from provisioner import budget

        plan.checks.extend(budget.projections(self, plan))
        return plan

    def close(self) -> None:
        if "db" in self.__dict__:
            self.db.dispose()
