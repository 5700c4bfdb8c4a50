"""What the clouds bill that the ledger does not price: a machine's boot disk or public IPv4
address, or a volume, whose rate was unknown at launch (no cited rate in the shipped catalog,
none in settings). The ledger counts them at nothing; ``status``, ``report`` and ``plan`` say
so beside the figures rather than let a zero pass as a price."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import or_, select

from provisioner.fleet import unpriced_pieces
from provisioner.ledger.periods import Period
from provisioner.ledger.sums import Scope
from provisioner.models import Machine, Volume

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


@dataclass(frozen=True)
class Unpriced:
    """``count`` of one billed piece on one cloud the ledger holds at no price, and the setting
    that prices it."""

    piece: str  # "boot disk", "public IPv4", "volume"
    cloud: str
    count: int

    @property
    def setting(self) -> str:
        prefix = {"public IPv4": "address_prices"}.get(self.piece, "disk_prices")
        return f"{prefix}.{self.cloud}"

    def __str__(self) -> str:
        what = self.piece + ("s" if self.count > 1 and self.piece != "public IPv4" else "")
        return f"{self.count} {self.cloud} {what} not priced (set {self.setting})"

    def as_json(self) -> dict[str, Any]:
        return {
            "piece": self.piece,
            "cloud": self.cloud,
            "count": self.count,
            "setting": self.setting,
        }


def unpriced(s: Session, period: Period, now: datetime, scope: Scope = Scope()) -> list[Unpriced]:
    """The billed pieces of the machines and volumes alive in ``period`` (up to ``now``) within
    ``scope`` that carry no price, counted per piece and cloud."""
    end = min(period.end, now)
    alive = [
        Machine.created_at < end,
        or_(Machine.terminated_at.is_(None), Machine.terminated_at > period.start),
    ]
    admits = scope.admitter()
    counts: Counter[tuple[str, str]] = Counter()
    for m in s.scalars(select(Machine).where(*alive, *scope.clauses())):
        if admits(m.project, m.owner):
            counts.update((piece, str(m.cloud)) for piece in unpriced_pieces(m))
    counts.update(("volume", cloud) for cloud in _volumes(s, period, end, scope))
    return [Unpriced(p, c, n) for (p, c), n in sorted(counts.items(), key=lambda kv: kv[0][::-1])]


def _volumes(s: Session, period: Period, end: datetime, scope: Scope) -> list[str]:
    """The cloud of each volume alive in the period that has no price (none in a scope of a
    GPU or a machine: a volume has no GPU and is no machine)."""
    if scope.gpu is not None or scope.machine is not None:
        return []
    vols = select(Volume).where(
        Volume.rate.is_(None),
        Volume.created_at < end,
        or_(Volume.deleted_at.is_(None), Volume.deleted_at > period.start),
        *([Volume.cloud == scope.cloud] if scope.cloud is not None else []),
    )
    admits = scope.admitter()
    return [
        v.cloud
        for v in s.scalars(vols)
        if v.volume_id and admits(v.project, v.owner) and _in(scope, v)
    ]


def _in(scope: Scope, v: Volume) -> bool:
    """The plain (not glob) project and owner of ``scope`` (globs: :meth:`Scope.admitter`)."""
    pairs = ((scope.project, v.project), (scope.owner, v.owner))
    return all(
        want is None or any(ch in want for ch in "*?[") or want == got for want, got in pairs
    )
