"""One launch attempt, typed and serialised in one place, and what its failure rules out.

A :class:`LaunchAttempt` is what ``up`` tried: written to the ``launch-attempt`` event before the
cloud is asked (so a crash can be adopted from it), to ``launched``/``adopted``/``launch-failed``
after, and shown by ``up -o json``. Its rate is a :class:`Money` from the candidate to the
machine's row; the JSON keeps it as an exact decimal string with its currency.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

from providers.base import (
    AuthError,
    CapacityError,
    ConfigurationError,
    InvalidRequest,
    ProviderError,
    QuotaError,
)
from provisioner.money import Money
from provisioner.planner import Candidate
from provisioner.schema import AttemptOutcome


@dataclass(frozen=True)
class LaunchAttempt:
    cloud: str
    region: str
    zone: str
    instance_type: str
    gpu: str
    gpu_count: int
    market: str
    token: str
    rate: Money
    outcome: AttemptOutcome | None = None  # None: under way (or its answer was lost)
    message: str = ""

    @classmethod
    def of(cls, c: Candidate, token: str) -> LaunchAttempt:
        o = c.offer
        return cls(
            o.cloud, o.region, o.zone, o.instance_type, o.gpu, o.gpu_count, c.market, token, c.price
        )

    @property
    def where(self) -> str:
        return f"{self.cloud}/{self.zone or self.region}"

    def ended(self, outcome: AttemptOutcome, message: str = "") -> LaunchAttempt:
        return replace(self, outcome=outcome, message=message)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "where": self.where,
            "cloud": self.cloud,
            "region": self.region,
            "zone": self.zone,
            "instance_type": self.instance_type,
            "gpu": self.gpu,
            "gpu_count": self.gpu_count,
            "market": self.market,
            "token": self.token,
            "rate": str(self.rate.amount),
            "currency": self.rate.currency,
        }
        if self.outcome is not None:
            out["outcome"] = self.outcome.value
            out["message"] = self.message
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LaunchAttempt:
        """An attempt as an event recorded it (events written before this type carry no
        ``where`` and no outcome: both are derived or absent)."""
        outcome = d.get("outcome")
        return cls(
            cloud=d["cloud"],
            region=d["region"],
            zone=d.get("zone") or "",
            instance_type=d["instance_type"],
            gpu=d["gpu"],
            gpu_count=int(d["gpu_count"]),
            market=d["market"],
            token=d.get("token", ""),
            rate=Money(Decimal(d["rate"]), d["currency"]),
            outcome=AttemptOutcome(outcome) if outcome else None,
            message=d.get("message", ""),
        )


def launch_token(machine_id: str, c: Candidate) -> str:
    """Same intent and same candidate → same token, so a retried launch finds its machine."""
    o = c.offer
    key = f"{machine_id}|{o.cloud}|{o.region}|{o.zone}|{o.instance_type}|{c.market}"
    return "pv-" + hashlib.sha256(key.encode()).hexdigest()[:32]


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

    def add(self, c: Candidate, err: ProviderError) -> AttemptOutcome:
        o = c.offer
        if isinstance(err, AuthError):
            self.clouds[o.cloud] = f"{o.cloud} blocked: credentials"
            return AttemptOutcome.AUTH
        if isinstance(err, ConfigurationError):
            self.clouds[o.cloud] = f"{o.cloud} blocked: settings"
            return AttemptOutcome.SETTINGS
        if isinstance(err, QuotaError):
            if err.scope == "cloud":
                self.clouds[o.cloud] = f"{o.cloud} blocked: quota"
            else:
                self.regions[(o.cloud, o.region)] = f"{o.region} blocked: quota"
            return AttemptOutcome.QUOTA
        if isinstance(err, CapacityError):
            # zone-less offers (Azure prices per region) block the region they were tried in
            if o.zone:
                self.zones[(o.cloud, o.zone)] = f"{o.zone} blocked: no capacity"
            else:
                self.regions[(o.cloud, o.region)] = f"{o.region} blocked: no capacity"
            return AttemptOutcome.CAPACITY
        return AttemptOutcome.INVALID if isinstance(err, InvalidRequest) else AttemptOutcome.ERROR
