"""What each cloud's ``catalog_rows`` shares: turning reference price files into rows of the
shipped catalog (``provisioner/data/catalog/<cloud>.csv``). Each cloud's spec names its function
(``CloudSpec.catalog_rows``); ``provisioner/data/catalog/build.py`` runs them, maintainers only,
never at run time. Unknown prices stay empty: never invented."""

from __future__ import annotations

from decimal import Decimal

from providers.gpus import GPUS

GPU_MEMORY = {n: g.memory_gb for n, g in GPUS.items()} | {"H100-MEGA": 80}
COPIED = "2026-11-30"  # the day the SkyPilot rows were read: the shipped rows' ``as_of``
SKYPILOT = "SkyPilot catalog v8 ({path} @ {commit}), copied " + COPIED


def dec(v: str) -> str:
    """A price as written in the catalog: normalised, "" when unknown."""
    return str(Decimal(v).normalize()) if v not in ("", None) else ""


def num(v: str) -> str:
    """A count or size: an integer when it is one."""
    d = Decimal(v)
    return str(int(d)) if d == d.to_integral_value() else str(d.normalize())
