"""What a cloud is, declared without importing its SDK: a name, a currency, typed options,
the SSH user, the pip extra that brings its SDK, and what it can and cannot do.

Each cloud package (``providers/<cloud>/__init__.py``) defines ``SPEC``; the registry in
:mod:`providers` is the only list of clouds, and settings, the CLI, the catalog build and the
benches read it. An option a cloud does not know is an error at settings load (file and line),
never a default quietly used.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from providers.limits import Limits

Name = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=256)]
Names = tuple[Name, ...]  # a YAML list; a bare string is an error, not a list of characters
Seconds = Annotated[float, Field(gt=0, le=86_400)]  # a timeout
Wait = Annotated[float, Field(ge=0, le=3_600)]  # a pause between tries or polls; 0: none


def _url(v: str) -> str:
    if not re.match(r"^https?://[^\s/:]+(:\d{1,5})?(/\S*)?$", v):
        raise ValueError(f"write an http:// or https:// URL (got {v!r})")
    return v


def _file(v: str) -> str:
    if not Path(v).expanduser().is_file():
        raise ValueError(f"no such file: {v!r}")
    return v


Url = Annotated[Name, AfterValidator(_url)]  # an API endpoint
File = Annotated[Name, AfterValidator(_file)]  # a file that must exist (a CA bundle, say)
Count = Annotated[int, Field(ge=0, le=1_000_000)]  # machines, GPUs, calls: never beyond this


class Options(BaseModel):
    """What every cloud accepts, under the same names. A cloud's own model adds only what it
    honours; where two clouds share a notion they share the name: ``endpoint`` (the API URL, for
    a private endpoint or an emulator), ``pricing_endpoint``, ``regions``, ``zones``, ``image``,
    ``timeout_seconds`` (one API call), ``operation_timeout_seconds`` (waiting for a long
    operation), ``poll_seconds``."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)

    enabled: bool = True
    retry_attempts: int = Field(6, ge=1, le=20)  # a throttled call is tried at most this often
    retry_base_seconds: Wait = 0.5  # backoff: random 0..min(max, base·2ⁿ)
    retry_max_seconds: Wait = 20

    def allows(self, region: str, zone: str) -> bool:
        """Whether the user enabled this place: ``zones`` when set, else ``regions`` when the
        cloud has them (None: all). What is planned and launched stays inside it, so it is
        also where ``list_managed`` looks."""
        zones: tuple[str, ...] | None = getattr(self, "zones", None)
        if zones and zone:
            return zone in zones
        regions: tuple[str, ...] | None = getattr(self, "regions", None)
        return regions is None or region in regions

    def in_home(self, home: Path) -> Options:
        """These options with what the cloud keeps on disk and the user left unset placed in
        the provisioner's home (the sandbox's machines); most clouds keep nothing there."""
        return self


@dataclass(frozen=True)
class Capabilities:
    """What the cloud's API allows, so callers decide from data rather than from docstrings.
    Every ability a cloud lacks carries its reason in ``why``: the cloud fact, with its source
    where one is written down (the contract suite skips with it)."""

    stop_spot: bool  # a spot machine can be stopped by us and started again
    cap_spot_price: bool  # a spot launch can carry a maximum price per hour
    zones: bool  # offers and launches name a zone (Azure prices and places per region)
    batch: bool  # stop/start/terminate many machines in one API call
    # a spot machine stopped outside provisioner (the console) reads STOPPED, not PREEMPTED
    console_stop_of_spot: bool = True
    # a spot machine may be deleted (not stopped) when the cloud takes it back
    delete_on_preemption: bool = True
    # a preempted spot machine is kept, stopped, with its disk, and can be started again in
    # place (recover starts it before launching anew)
    restart_preempted: bool = True
    why: Mapping[str, str] = field(default_factory=dict, hash=False)  # ability lacked → why

    def __post_init__(self) -> None:
        lacking = {f.name for f in fields(self) if f.name != "why" and not getattr(self, f.name)}
        if set(self.why) != lacking:
            raise ValueError(
                f"give a reason for exactly the abilities a cloud lacks: {sorted(lacking)} "
                f"(reasons given: {sorted(self.why)})"
            )

    def why_not(self, ability: str) -> str:
        """The reason the cloud lacks ``ability`` (KeyError when it has it)."""
        return self.why[ability]


STOPS, TERMINATES, KEEPS_BILLING = "stops", "terminates", "keeps-billing"


@dataclass(frozen=True)
class GuestShutdown:
    """What a shutdown from inside the machine's OS (``shutdown -h now``: how the machine's own
    guard stops it) does to the machine and to its billing, per market, with the source:

    - ``stops``: the cloud stops it; compute billing ends (disks and addresses go on);
    - ``terminates``: the cloud deletes it (an AWS one-time spot instance), its boot disk too;
    - ``keeps-billing``: it reads stopped but stays allocated and billed until the API
      deallocates it (Azure): the scheduler must finish it.

    ``billed_flavors``: a regular expression of instance types that bill while stopped all the
    same (Huawei ECS local-disk flavors), with ``flavors_why``."""

    on_demand: str
    spot: str
    source: str
    billed_flavors: str = ""
    flavors_why: str = ""

    def __post_init__(self) -> None:
        for v in (self.on_demand, self.spot):
            if v not in (STOPS, TERMINATES, KEEPS_BILLING):
                raise ValueError(
                    f"guest_shutdown: {v!r} is not {STOPS}, {TERMINATES} or {KEEPS_BILLING}"
                )

    def effect(self, market: str, instance_type: str = "") -> str:
        """What a guest shutdown does to a machine of ``market`` (spot / on-demand) and type."""
        got = self.spot if market == "spot" else self.on_demand
        if got == STOPS and self.billed_flavors and re.match(self.billed_flavors, instance_type):
            return KEEPS_BILLING
        return got


@dataclass(frozen=True)
class CloudSpec:
    name: str
    title: str
    currency: str  # what its prices are in
    options: type[Options]
    adapter: str  # "module:Class", imported when the cloud is first used
    ssh_user: str  # the login user on its machines
    extra: str | None  # `pip install 'gpu-provisioner[<extra>]'` brings its SDK; None: built in
    sdk: tuple[str, ...]  # top-level modules of its SDK: a missing one names the extra
    capabilities: Capabilities
    simulated: bool = False  # the sandbox: never pretends to be a real cloud
    # where `catalog refresh` reads prices, and what credentials that needs (said before asking)
    prices_from: str = "no price refresh"
    # "module:function" (reference price files → the shipped catalog's rows, imported only by
    # provisioner/data/catalog/build.py); None: its catalog file is kept by hand
    catalog_rows: str | None = None
    # "module:function" (provider, first day, day after the last) → providers.billing.Bill:
    # the cloud's own billing data for `provisioner bill`; None: `billing_why` says why not
    billing: str | None = None
    billing_why: str = ""
    # what a shutdown from inside the OS does to billing (the machine's guard uses it)
    guest_shutdown: GuestShutdown = GuestShutdown(STOPS, STOPS, "simulated")
    # what one launch may send (startup data size, tags, names), with sources; None: no limit
    # applies (the sandbox)
    limits: Limits | None = None
