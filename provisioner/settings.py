"""Settings: where state lives, which clouds are enabled and their non-secret options, currency
rates, price overrides, mail and scheduler options.

Read from a YAML file (``--config``, ``$PROVISIONER_CONFIG`` or ``<user config dir>/settings.yaml``)
and ``PROVISIONER_*`` environment variables, which win (nested keys with ``__``:
``PROVISIONER_CLOUDS__AWS__REGIONS='["us-east-1"]'``). Secrets never live here: each cloud SDK finds
its own credentials, and the SMTP password comes from ``$PROVISIONER_SMTP_PASSWORD``.
"""

from __future__ import annotations

import os
from decimal import Decimal
from pathlib import Path
from typing import Any

import platformdirs
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    create_model,
    field_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

import providers
from policies import yamlfile
from providers.gpus import GPUS
from providers.spec import Options
from provisioner.errors import ConfigError, Problem
from provisioner.money import Rates

APP = "provisioner"


def data_dir() -> Path:
    return Path(os.environ.get("PROVISIONER_HOME") or platformdirs.user_data_dir(APP))


def default_config_path() -> Path:
    return Path(platformdirs.user_config_dir(APP)) / "settings.yaml"


class PriceOverride(BaseModel):
    """A price the catalog lacks (e.g. cloud.ru Advanced publishes none), per hour, in the
    cloud's currency."""

    model_config = ConfigDict(extra="forbid")
    price: Decimal | None = None
    spot_price: Decimal | None = None


class SmtpSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str = "localhost"
    port: int = 587
    security: str = Field("starttls", pattern="^(starttls|ssl|none)$")
    sender: str = "provisioner@localhost"
    user: str | None = None  # the password comes from $PROVISIONER_SMTP_PASSWORD
    ca_file: str | None = None  # trust this CA bundle for the server (e.g. an internal CA)
    timeout_seconds: float = Field(30, gt=0)


class GpuOwnership(BaseModel):
    """Owning one card: its purchase price range and its power draw."""

    model_config = ConfigDict(extra="forbid")
    price_low: Decimal = Field(gt=0)
    price_high: Decimal = Field(gt=0)
    power_watts: int = Field(gt=0)


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

    model_config = ConfigDict(extra="forbid")
    currency: str = "USD"  # of prices and electricity
    electricity_per_kwh: Decimal = Field(Decimal("0.15"), ge=0)  # a typical commercial tariff
    amortisation_months: int = Field(36, ge=1)  # a common depreciation horizon for GPUs
    gpus: dict[str, GpuOwnership] = Field(default_factory=_default_gpus)


class SchedulerSettings(BaseModel):
    model_config = ConfigDict(extra="allow")
    sweep_interval_seconds: int = Field(300, ge=10)
    recover_interval_seconds: int = Field(120, ge=10)
    reconcile_interval_seconds: int = Field(600, ge=10)
    listen: str = "127.0.0.1:8787"  # heartbeat + /metrics endpoint
    endpoint_url: str | None = None  # how agents on machines reach the endpoint
    # idle signal and leader lease (scheduler helper)
    agent_interval_seconds: int = Field(30, ge=5)  # heartbeat period of the on-machine agent
    heartbeat_grace_seconds: int = Field(300, ge=30)  # silent longer: the idle signal is unknown
    lease_seconds: int = Field(900, ge=30)  # a pass must finish within it; a dead leader's expires


class DashboardSettings(BaseModel):
    """``provisioner dashboard``. Beyond loopback it asks for a token: ``token`` here or
    ``$PROVISIONER_DASHBOARD_TOKEN`` (which wins), entered once on its login page."""

    model_config = ConfigDict(extra="forbid")
    listen: str = "127.0.0.1:8765"
    language: str | None = Field(None, pattern="^(en|ru)$")  # None: the browser's choice
    token: SecretStr | None = None
    experiments: list[str] = Field(
        default_factory=list
    )  # files or directories the Plan page offers

    @property
    def secret(self) -> str | None:
        env = os.environ.get("PROVISIONER_DASHBOARD_TOKEN")
        return env or (self.token.get_secret_value() if self.token else None)


def _clouds_model() -> type[BaseModel]:
    """``clouds:``: one optional section per registered cloud, typed by the cloud's own
    options model, so a misspelt cloud or option is an error with its file and line. A cloud
    absent from a settings file that has ``clouds:`` is not enabled."""
    fields: dict[str, Any] = {s.name: (s.options | None, None) for s in providers.specs()}
    return create_model("Clouds", __config__=ConfigDict(extra="forbid", frozen=True), **fields)


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
    rates: dict[str, Decimal] = Field(default_factory=lambda: {"RUB": Decimal("80")})
    prices: dict[str, dict[str, PriceOverride]] = Field(default_factory=dict)
    disk_prices: dict[str, Decimal] = Field(default_factory=dict)  # cloud → per GB-month
    policies: list[str] = Field(default_factory=list)  # policy files or directories
    smtp: SmtpSettings = Field(default_factory=SmtpSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    ownership: OwnershipSettings = Field(default_factory=OwnershipSettings)  # rent or buy
    dashboard: DashboardSettings = Field(default_factory=DashboardSettings)
    home: Path = Field(default_factory=data_dir)  # state, sandbox cloud, refreshed catalog

    @field_validator("currency")
    @classmethod
    def _iso(cls, v: str) -> str:
        if len(v) != 3 or not v.isalpha():
            raise ValueError("use an ISO currency code (USD, RUB, EUR)")
        return v.upper()

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

    @property
    def enabled_clouds(self) -> list[str]:
        """In registry order."""
        return [c for c in providers.REGISTRY if (o := self.cloud(c)) is not None and o.enabled]

    @property
    def database_url(self) -> str:
        return self.state_url or f"sqlite:///{self.home / 'state.db'}"

    @property
    def money_rates(self) -> Rates:
        return Rates(self.currency, self.rates)


def load_settings(path: str | Path | None = None) -> Settings:
    """Load settings; a missing default file is fine, a named missing file is an error."""
    path = path or os.environ.get("PROVISIONER_CONFIG")
    file = Path(path) if path else default_config_path()
    data: dict[str, Any] = {}
    lines = None
    if path or file.exists():
        raw, lines = yamlfile.load_document(file)
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError([Problem(str(file), 1, None, "settings must be a mapping of keys")])
        data = raw or {}
    try:
        settings = Settings(**data)
    except ValidationError as e:
        if lines is None:  # only the environment was read
            raise ConfigError(
                [
                    Problem(
                        "environment",
                        None,
                        "PROVISIONER_" + "__".join(str(x) for x in err["loc"]).upper(),
                        err["msg"],
                    )
                    for err in e.errors(include_url=False)
                ]
            ) from None
        raise ConfigError(
            lines.problems + yamlfile.problems_from(e, lines, str(file), data)
        ) from None
    if lines is not None and lines.problems:
        raise ConfigError(lines.problems)
    return settings
