"""The application context: settings, clock, state database, providers and policies. One per
command. It holds what the work needs, not the work: planning, machines and the scheduler's jobs
take it as their first argument."""

from __future__ import annotations

from collections.abc import Iterable
from functools import cached_property
from typing import TYPE_CHECKING, cast
from zoneinfo import ZoneInfo

from providers.base import Provider
from provisioner import acting, catalog
from provisioner.clock import Clock
from provisioner.settings import Settings

if TYPE_CHECKING:
    from policies.schema import Policy
    from provisioner.state import Database


class App:
    def __init__(self, settings: Settings, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock = clock or Clock()
        self._providers: dict[str, Provider] = {}
        self._actor: str | None = None
        self._rules_version: int | None = None  # of the team's rules app.policies holds
        #: the command this App serves (``up``, ``token create``), for a refusal's words, and
        #: whether it writes the state or acts on a cloud: on a simulated clock over a real
        #: state such a command is refused when it first opens the state or a provider; any
        #: other only looks, its writes and acts refused (:mod:`provisioner.realclock`)
        self.command: str | None = None
        self.acts = False

    @cached_property
    def db(self) -> Database:
        from provisioner.state import Database  # SQLAlchemy costs ~0.2 s: only when state is used

        db = Database(self.settings.database_url, self.settings.database)
        db.migrate(simulated=self.clock.simulated)
        if self.clock.simulated and not db.simulated:  # a real state: look, never write
            from provisioner import realclock

            try:
                realclock.on_real_state(self, db)
            except BaseException:
                db.dispose()
                raise
        who = self._identify(db)  # and, on a team's state, whether it may write
        if self._actor is None:  # every event records who caused it
            self._actor = who
        db.actor = self._actor
        return db

    def _identify(self, db: Database) -> str:
        """Who this process is (:mod:`provisioner.identity`); on a team's PostgreSQL state with
        rules applied, by the state's member map: a role not in it may read, and every write
        of this process is refused (its owner or a superuser excepted: it may apply rules)."""
        from provisioner import identity, team

        if not team.team_state(db):
            return identity.actor(self.settings, lambda: db)
        role = identity.database_role(db)
        rules = team.newest(db)
        if rules is None:
            return identity.email_of(self.settings, role)
        if role not in rules.members and not team.privileged(db):
            db.refuse_writes(team.not_member(role))
        return rules.email_of(role)

    @property
    def actor(self) -> str:
        """Who runs this process, as an e-mail (:mod:`provisioner.identity`; on PostgreSQL
        one query per process); the scheduler sets ``app.actor = identity.SCHEDULER`` for its
        own actions. Within :func:`provisioner.acting.acting_as`, that thread's actor."""
        if (who := acting.current()) is not None:
            return who
        if self._actor is None and not self.settings.database_url.startswith("postgresql"):
            from provisioner import identity  # one user's file: the OS user, no state opened

            self._actor = identity.actor(self.settings, lambda: self.db)
        if self._actor is None:
            self.db  # noqa: B018  (opening a team's state identifies who runs this)
        assert self._actor is not None
        return self._actor

    @actor.setter
    def actor(self, who: str) -> None:
        self._actor = who
        if "db" in self.__dict__:
            self.db.actor = who

    def provider(self, cloud: str) -> Provider:
        """The adapter for ``cloud``, built once with its options from settings; on a simulated
        clock over a real state, one that may be asked but not act
        (:class:`provisioner.realclock.LookOnly`)."""
        if cloud not in self._providers:
            provider = self.settings.adapter(cloud, self.clock.now)
            if self.clock.simulated and not self.db.simulated:  # a what-if: ask, never act
                from provisioner import realclock

                provider = cast(Provider, realclock.LookOnly(provider, self.command))
            self._providers[cloud] = provider
        return self._providers[cloud]

    def use_provider(self, cloud: str, provider: Provider) -> None:
        """Use this adapter instance for ``cloud`` (e.g. one built with an explicit credential)."""
        self._providers[cloud] = provider

    def offers(
        self,
        clouds: Iterable[str] | None = None,
        *,
        gpu_family: str | None = None,
        gpu_count: int | None = None,
    ) -> catalog.Offers:
        """The catalog's offers of ``clouds`` (default: the enabled ones); of one GPU when
        given (the others only counted)."""
        return catalog.load(
            self.settings,
            clouds or self.settings.enabled_clouds,
            gpu_family=gpu_family,
            gpu_count=gpu_count,
        )

    @cached_property
    def policies(self) -> list[Policy]:
        """The policy files and directories named in settings: all of them, or an error naming
        every problem's file, line and field (never half of the rules). On a team's PostgreSQL
        state with rules applied: the team's policies, the files only narrowing them
        (:func:`provisioner.team.combine`)."""
        from policies import loader  # pydantic models of the rules (~65 ms): only when read

        local = loader.load(self.settings.policies) if self.settings.policies else []
        return self.with_team_rules(local)

    @property
    def zone(self) -> ZoneInfo:
        """The team's time zone (:func:`provisioner.clock.team_zone`): every time the
        dashboard and ``status`` show is in it, UTC on hover. Rules that cannot be read: the
        settings' zone (the pages say what is wrong with them)."""
        from provisioner.clock import team_zone
        from provisioner.errors import ProvisionerError

        try:
            return team_zone(self.settings, self.policies)
        except (ProvisionerError, ValueError):
            return team_zone(self.settings)

    def with_team_rules(self, local: list[Policy]) -> list[Policy]:
        """``local`` (policies from files) as the rules in force: themselves on SQLite and
        before a team's first rules; else the team's, ``local`` only narrowing them."""
        if not self.settings.database_url.startswith("postgresql"):
            return local
        from provisioner import team

        rules = team.newest(self.db)
        self._rules_version = rules.version if rules else None
        if rules is None:
            return local
        if self._actor is None:
            self.db  # noqa: B018  (identifies who runs this)
        return team.combine(rules, local, self._actor or "")

    def refresh_rules(self) -> bool:
        """On a team's PostgreSQL state: when an admin applied new rules since they were read,
        forget them (and who this process is), to be read again on next use; one cheap query.
        Whether they changed. A long-running process (dashboard, scheduler) asks now and then."""
        if not self.settings.database_url.startswith("postgresql") or "db" not in self.__dict__:
            return False
        from provisioner import team
        from provisioner.identity import SCHEDULER

        if "policies" not in self.__dict__:  # not read yet: will be read fresh
            return False
        if team.newest_version(self.db) == self._rules_version:
            return False
        self.__dict__.pop("policies", None)
        self.db.refuse_writes(None)
        who = self._identify(self.db)
        if self._actor != SCHEDULER:  # the scheduler's actor is set, not looked up
            self._actor = self.db.actor = who
        return True

    def email_of(self, name: str) -> str:
        """The e-mail of a role or user name (an authenticating proxy's): the team's member
        map once rules are applied, else ``identity`` in settings."""
        from provisioner import identity, team

        postgres = self.settings.database_url.startswith("postgresql")
        rules = team.newest(self.db) if postgres else None
        return rules.email_of(name) if rules else identity.email_of(self.settings, name)

    def close(self) -> None:
        if "db" in self.__dict__:
            self.db.dispose()
