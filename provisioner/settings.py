"""Settings: where state lives, which clouds are enabled and their non-secret options, currency
rates, price overrides, mail and scheduler options.

Read from a YAML file (``--config``, ``$PROVISIONER_CONFIG`` or ``<user config dir>/settings.yaml``)
and ``PROVISIONER_*`` environment variables, which win (nested keys with ``__``:
``PROVISIONER_CLOUDS__AWS__REGIONS='["us-east-1"]'``). Secrets never live here: each cloud SDK finds
its own credentials, and the SMTP password comes from ``$PROVISIONER_SMTP_PASSWORD``.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable
from datetime import datetime
from decimal import Decimal
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Annotated, Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

import providers
from policies import yamlfile
from policies.channels import Channel
from providers.base import Provider
from providers.gpus import GPUS
from providers.spec import Options
from provisioner.errors import ConfigError, Problem, UserError
from provisioner.location import (
    HEARTBEAT_GRACE_SECONDS,
    checked_home,
    checked_state_url,
    data_dir,
    database_url,
    default_config_path,
)
from provisioner.money import Rates

#: A price, rate or tariff: finite, not negative, and below a trillion (anything larger is a typo,
#: and Decimal arithmetic on 1e999999 overflows).
Amount = Annotated[Decimal, Field(ge=0, lt=Decimal(10) ** 12, allow_inf_nan=False)]


class PriceOverride(BaseModel):
    """A price the catalog lacks (e.g. cloud.ru Advanced publishes none), per hour, in the
    cloud's currency."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    price: Amount | None = None
    spot_price: Amount | None = None


class SmtpSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    host: str = "localhost"
    port: int = Field(587, ge=1, le=65535)
    security: Literal["starttls", "ssl", "none"] = "starttls"
    sender: str = "provisioner@localhost"
    user: str | None = None  # the password comes from $PROVISIONER_SMTP_PASSWORD
    ca_file: str | None = None  # trust this CA bundle for the server (e.g. an internal CA)
    timeout_seconds: float = Field(30, gt=0, le=600)


class GpuOwnership(BaseModel):
    """Owning one card: its purchase price range and its power draw."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    price_low: Amount = Field(gt=0)
    price_high: Amount = Field(gt=0)
    power_watts: int = Field(gt=0, le=100_000)


def _default_gpus() -> dict[str, GpuOwnership]:
    return {
        g.name: GpuOwnership(
            price_low=g.price_low, price_high=g.price_high, power_watts=g.power_watts
        )
        for g in GPUS.values()
        if g.price_low and g.price_high and g.power_watts
    }


class OwnershipSettings(BaseModel):
    """The report's rent-or-buy comparison: what owning a card would cost instead. Defaults are
    rules of thumb (card only, no server or staff); set your own quotes here."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    currency: str = "USD"  # of prices and electricity
    electricity_per_kwh: Amount = Decimal("0.15")  # a typical commercial tariff
    amortisation_months: int = Field(36, ge=1, le=600)  # a common depreciation horizon for GPUs
    gpus: dict[str, GpuOwnership] = Field(default_factory=_default_gpus)


DAY = 86_400


class SchedulerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    sweep_interval_seconds: int = Field(300, ge=10, le=DAY)
    recover_interval_seconds: int = Field(120, ge=10, le=DAY)
    reconcile_interval_seconds: int = Field(600, ge=10, le=DAY)
    listen: str = "127.0.0.1:8787"  # heartbeat + /metrics endpoint: HOST:PORT
    endpoint_url: str | None = None  # how agents on machines reach the endpoint
    # idle signal and leader lease (scheduler helper)
    agent_interval_seconds: int = Field(30, ge=5, le=3600)  # the on-machine agent's period
    heartbeat_grace_seconds: int = Field(
        HEARTBEAT_GRACE_SECONDS, ge=30, le=DAY
    )  # silent longer: idle unknown
    lease_seconds: int = Field(900, ge=30, le=DAY)  # renewed between batches
    # /metrics names machines and owners: with a token set, only `Authorization: Bearer <it>`
    # sees them (prefer $PROVISIONER_SCHEDULER__METRICS_TOKEN to writing it in the file)
    metrics_token: SecretStr | None = None
    max_connections: int = Field(100, ge=1, le=10_000)  # open connections to the endpoint
    max_connections_per_address: int = Field(32, ge=1, le=10_000)  # of one client address

    @field_validator("listen")
    @classmethod
    def _host_port(cls, v: str) -> str:
        host, sep, port = v.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(
                f"write HOST:PORT with a port from 1 to 65535, e.g. 127.0.0.1:8787 (got {v!r})"
            )
        return v.strip()

    @field_validator("endpoint_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^/\s:]+(:\d{1,5})?(/\S*)?$", v):
            raise ValueError(
                f"write an http:// or https:// URL, e.g. http://10.0.0.5:8787 (got {v!r})"
            )
        return v

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


class DashboardSettings(BaseModel):
    """``provisioner dashboard``. Beyond loopback it asks for a token: ``token`` here or
    ``$PROVISIONER_DASHBOARD_TOKEN`` (which wins), entered once on its login page."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    listen: str = "127.0.0.1:8765"
    language: str | None = Field(None, pattern="^(en|ru)$")  # None: the browser's choice
    token: SecretStr | None = None
    # names (besides IP addresses and localhost) browsers may reach it by: any other Host is
    # refused, so a DNS-rebinding page cannot read it
    hosts: list[str] = Field(default_factory=list)
    experiments: list[str] = Field(
        default_factory=list
    )  # files or directories the Plan page offers

    @property
    def secret(self) -> str | None:
        env = os.environ.get("PROVISIONER_DASHBOARD_TOKEN")
        return env or (self.token.get_secret_value() if self.token else None)


class NotifySettings(BaseModel):
    """Notify channels per owner (beside each policy's ``notify:``), the dashboard's address for
    links in notices, and the services' base URLs (overridable for a proxy or tests)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    owners: dict[str, list[Channel]] = Field(default_factory=dict)  # a machine's owner → channels
    dashboard_url: str | None = Field(None, pattern=r"^https?://\S+$")
    telegram_api: str = Field("https://api.telegram.org", pattern=r"^https?://\S+$")
    max_attempts: int = Field(6, ge=1, le=50)  # then the delivery is failed
    timeout_seconds: float = Field(10, gt=0, le=120)
    # hosts (exact names) and networks (CIDRs, or one address) Telegram, Slack and webhooks may
    # reach though not public: loopback, private, link-local, metadata addresses are refused
    # after resolution unless listed here, e.g. ["hooks.internal.example", "10.20.0.0/16"]
    allow: list[str] = Field(default_factory=list)

    @field_validator("allow")
    @classmethod
    def _hosts_or_networks(cls, v: list[str]) -> list[str]:
        for entry in v:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", entry):
                    raise ValueError(
                        f"write a host name or a network such as 10.0.0.0/8 (got {entry!r})"
                    ) from None
        return v


class DatabaseSettings(BaseModel):
    """How long the state database may keep a command waiting: a server that accepts the
    connection but never answers, a statement stuck behind a lock, a SQLite file another
    process holds. Each ends in one line, not a hang."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    connect_timeout_seconds: int = Field(5, ge=1, le=600)  # PostgreSQL: libpq connect_timeout
    statement_timeout_seconds: int = Field(60, ge=1, le=86_400)  # PostgreSQL statement_timeout
    busy_timeout_seconds: int = Field(30, ge=1, le=3600)  # SQLite: a write lock held elsewhere


class WorkdirSettings(BaseModel):
    """What an experiment's ``workdir`` may hold: code and configs, copied at each `up` and
    `sync`; data belongs on a volume. Checked by `plan` and `up` before anything is launched."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    max_files: int = Field(10_000, ge=1, le=10_000_000)
    max_bytes: int = Field(1 << 30, ge=1)  # 1 GiB

    @property
    def limits(self) -> tuple[int, int]:
        return self.max_files, self.max_bytes


class JobsSettings(BaseModel):
    """How jobs on a machine end: ``cancel`` sends TERM to a job's process group, then KILL
    after ``cancel_grace_seconds`` if it still runs (``cancel --grace`` for one call)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    cancel_grace_seconds: float = Field(10.0, ge=0, le=3600)


class IdentitySettings(BaseModel):
    """Who runs provisioner, as an e-mail: the database role on PostgreSQL (each member
    connects as their own role), the OS user on SQLite; ``members`` maps either to an e-mail,
    an unmapped name is ``<name>@<domain>``. On a team's PostgreSQL state with rules applied
    (``provisioner policy apply``: :mod:`provisioner.team`) the state's member map and domain
    are used instead; ``admins`` and ``scheduler`` name kinds of members for that apply. The
    dashboard trusts ``proxy_header`` (a user name or e-mail set by an authenticating proxy)
    only from ``trusted_proxies``."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    members: dict[str, str] = Field(default_factory=dict)  # role or OS user → e-mail
    # the team's rules (`provisioner policy apply`, PostgreSQL): the roles that may apply
    # them, and the role the scheduler connects as
    admins: list[str] = Field(default_factory=list)
    scheduler: str | None = None
    domain: str = Field("localhost", pattern=r"^[A-Za-z0-9.-]+$")
    proxy_header: str = Field("X-Forwarded-User", pattern=r"^[A-Za-z0-9-]+$")
    trusted_proxies: list[str] = Field(default_factory=list)  # addresses or networks (CIDR)

    @field_validator("members")
    @classmethod
    def _emails(cls, v: dict[str, str]) -> dict[str, str]:
        for name, email in v.items():
            if not re.match(r"^[^@\s]+@[^@\s]+$", email):
                raise ValueError(f"{name}: not an e-mail address: {email!r}")
        return v

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        import ipaddress

        for n in v:
            try:
                ipaddress.ip_network(n, strict=False)
            except ValueError:
                raise ValueError(
                    f"not an address or network: {n!r} (e.g. 10.0.0.5 or 10.0.0.0/24)"
                ) from None
        return v


def _clouds_model() -> type[BaseModel]:
    """``clouds:``: one optional section per registered cloud, typed by the cloud's own
    options model, so a misspelt cloud or option is an error with its file and line. A cloud
    absent from a settings file that has ``clouds:`` is not enabled."""
    fields: dict[str, Any] = {s.name: (s.options | None, None) for s in providers.specs()}
    return create_model(
        "Clouds", __config__=ConfigDict(extra="forbid", frozen=True, defer_build=True), **fields
    )


Clouds = _clouds_model()


def _every_cloud() -> Any:
    return Clouds(**{s.name: s.options() for s in providers.specs()})


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PROVISIONER_", env_nested_delimiter="__", extra="forbid"
    )

    state_url: str | None = None  # None → SQLite file in the user data directory
    clouds: Clouds = Field(default_factory=_every_cloud)  # type: ignore[valid-type]
    currency: str = "USD"  # the one currency candidates are ranked in
    # units of each currency per 1 of `currency`; default (for USD only): 80 RUB
    rates: dict[str, Annotated[Amount, Field(gt=0)]] = Field(None, validate_default=True)
    prices: dict[str, dict[str, PriceOverride]] = Field(default_factory=dict)
    disk_prices: dict[str, Amount] = Field(default_factory=dict)  # cloud → per GB-month
    address_prices: dict[str, Amount] = Field(default_factory=dict)  # cloud → per public IPv4-hour
    policies: list[str] = Field(default_factory=list)  # policy files or directories
    smtp: SmtpSettings = Field(default_factory=SmtpSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    ownership: OwnershipSettings = Field(default_factory=OwnershipSettings)  # rent or buy
    dashboard: DashboardSettings = Field(default_factory=DashboardSettings)
    notify: NotifySettings = Field(default_factory=NotifySettings)
    identity: IdentitySettings = Field(default_factory=IdentitySettings)
    workdir: WorkdirSettings = Field(default_factory=WorkdirSettings)
    jobs: JobsSettings = Field(default_factory=JobsSettings)  # cancel's grace
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)  # its timeouts
    home: Path = Field(default_factory=data_dir)  # state, sandbox cloud, refreshed catalog
    # IANA zone of times given without one where no policy calendar applies
    # (`keep --until HH:MM`); never this computer's offset, which DST changes under us
    timezone: str = "UTC"
    # chargeback: team → its owners (emails as experiments write them, or globs such as
    # "*@ml.example.com"); `report --by team`. An owner in no team is reported under "—".
    teams: dict[str, list[str]] = Field(default_factory=dict)

    @field_validator("teams")
    @classmethod
    def _one_team_each(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        """An owner (or glob) listed under two teams would be charged to one of them at random:
        refused, naming both."""
        seen: dict[str, str] = {}
        for team, owners in v.items():
            if not team.strip():
                raise ValueError("a team needs a name")
            for owner in owners:
                key = owner.strip().lower()
                if key in seen and seen[key] != team:
                    raise ValueError(f"{owner!r} is in two teams: {seen[key]} and {team}")
                seen[key] = team
        return v

    def team_of(self) -> Callable[[str], str | None]:
        """Who is charged to which team: a function of the owner giving the team naming it,
        else the first whose glob matches it (in the order of settings), else None."""
        exact = {o.strip().lower(): t for t, owners in self.teams.items() for o in owners}
        globs = [(o, t) for o, t in exact.items() if any(ch in o for ch in "*?[")]
        known: dict[str, str | None] = {}

        def team(owner: str) -> str | None:
            if owner not in known:
                who = owner.lower()
                known[owner] = exact.get(who) or next(
                    (t for o, t in globs if fnmatchcase(who, o)), None
                )
            return known[owner]

        return team

    @field_validator("timezone")
    @classmethod
    def _zone(cls, v: str) -> str:
        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown IANA timezone {v!r} (e.g. Europe/Berlin)") from None
        return v

    @field_validator("currency")
    @classmethod
    def _iso(cls, v: str) -> str:
        if len(v) != 3 or not v.isalpha():
            raise ValueError("use an ISO currency code (USD, RUB, EUR)")
        return v.upper()

    @field_validator("rates", mode="before")
    @classmethod
    def _default_rates(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:  # the built-in rate is RUB per USD: no use for another currency
            return {"RUB": Decimal(80)} if info.data.get("currency", "USD") == "USD" else {}
        return v

    @field_validator("rates")
    @classmethod
    def _every_rate(cls, v: dict[str, Decimal], info: ValidationInfo) -> dict[str, Decimal]:
        """Each enabled cloud's currency has a rate: never a rate of another currency reused."""
        base = info.data.get("currency")
        clouds = info.data.get("clouds")
        for code in v:
            if len(code) != 3 or not code.isalpha():
                raise ValueError(f"{code!r} is not an ISO currency code (USD, RUB, EUR)")
        rates = {k.upper(): x for k, x in v.items()}
        if base is None or clouds is None:
            return rates
        missing: dict[str, list[str]] = {}
        for spec in providers.specs():
            options = getattr(clouds, spec.name, None)
            if options is not None and options.enabled and spec.currency not in (base, *rates):
                missing.setdefault(spec.currency, []).append(spec.name)
        if missing:
            cur, names = next(iter(missing.items()))
            raise ValueError(
                f"no rate for {cur} (the currency of {', '.join(names)}): set rates.{cur}, "
                f"how many {cur} one {base} buys"
            )
        return rates

    @field_validator("state_url")
    @classmethod
    def _db_url(cls, v: str | None) -> str | None:
        return checked_state_url(v)

    @field_validator("home")
    @classmethod
    def _home(cls, v: Path) -> Path:
        return checked_home(v)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (env_settings, init_settings)  # environment beats the file

    # -- derived -------------------------------------------------------------------------

    def cloud(self, name: str) -> Options | None:
        """The options of ``name``, or None when settings do not list it."""
        options: Options | None = getattr(self.clouds, name, None)
        return options

    def adapter(self, name: str, clock: Callable[[], datetime]) -> Provider:
        """A new adapter for ``name`` with its options (what it keeps on disk in the home
        unless told otherwise: :meth:`~providers.spec.Options.in_home`); :class:`UserError` for
        a cloud not enabled here or whose SDK is not installed."""
        options = self.cloud(name)
        if options is None:
            raise UserError(f"cloud {name!r} is not enabled in settings")
        try:
            return providers.create(name, options.in_home(self.home), clock=clock)
        except providers.MissingSDK as e:
            raise UserError(str(e)) from None

    @property
    def enabled_clouds(self) -> list[str]:
        """In registry order."""
        return [c for c in providers.REGISTRY if (o := self.cloud(c)) is not None and o.enabled]

    @property
    def database_url(self) -> str:
        return database_url(self.state_url, self.home)

    @property
    def money_rates(self) -> Rates:
        return Rates(self.currency, self.rates)


def load_settings(path: str | Path | None = None) -> Settings:
    """Load settings; a missing default file is fine, a named missing file is an error. A
    mistake is reported where it was made: the file and line, or the environment variable."""
    path = path or os.environ.get("PROVISIONER_CONFIG")
    file = Path(path) if path else default_config_path()
    data: dict[str, Any] = {}
    lines = yamlfile.Lines()
    if path or file.exists():
        raw, lines = yamlfile.load_document(file)
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError([Problem(str(file), 1, None, "settings must be a mapping of keys")])
        data = raw or {}
    try:
        settings = Settings(**data)
    except (SettingsError, RecursionError) as e:  # a variable pydantic-settings cannot decode
        m = re.search(r'field "([^"]+)"', str(e))
        names = _json_variables(m.group(1) if m else None)
        raise ConfigError(
            [
                Problem(
                    "environment",
                    None,
                    ", ".join(names),
                    'not valid JSON (a list is written ["us-east-1"], a mapping {"a": 1})',
                )
            ]
        ) from None
    except ValidationError as e:
        problems = yamlfile.problems_from(e, lines, str(file), data, model=Settings)
        raise ConfigError(lines.problems + [_from_environment(p) for p in problems]) from None
    if lines.problems:
        raise ConfigError(lines.problems)
    return settings


def _json_variables(field: str | None) -> list[str]:
    """The variables that set ``field`` (or, unknown, every one holding JSON)."""
    if field:
        name = "PROVISIONER_" + field.upper()
        found = [k for k in os.environ if k.upper() == name or k.upper().startswith(name + "__")]
        return sorted(found) or [name]
    found = [
        k
        for k, v in os.environ.items()
        if k.upper().startswith("PROVISIONER_") and v.lstrip()[:1] in ("[", "{")
    ]
    bad = [k for k in found if not _decodes(os.environ[k])]
    return sorted(bad or found) or ["PROVISIONER_*"]


def _decodes(text: str) -> bool:
    import json

    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _from_environment(p: Problem) -> Problem:
    """``p`` as the environment variable that set its field, when one did (it wins)."""
    parts = (p.field or "").split(".")
    env = {k.upper() for k in os.environ}
    for n in range(len(parts), 0, -1):
        name = "PROVISIONER_" + "__".join(parts[:n]).upper()
        if name in env:
            return Problem("environment", None, name, p.message)
    return p
