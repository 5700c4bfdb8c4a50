"""GPU facts in one table: the names offers and experiments use, what each is a variant of, its
memory, and owning one card (the report's rent-or-buy rule of thumb).

Memory is the usual size of the board a cloud rents under that name; a variant with more memory
keeps its own row in the catalog (an Azure H100 NVL is 94 GB, a Yandex V100 32 GB).
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal


@dataclass(frozen=True)
class GPUModel:
    name: str
    family: str  # "A100-80GB" is an A100: a request for A100 accepts it
    memory_gb: int
    # Owning one card: street price range (2024–2026, new or refurbished) and board power from
    # NVIDIA's data sheets (SXM versions for A100/H100). Rules of thumb, not quotes; None: no
    # card one can buy (a cloud's own naming).
    price_low: Decimal | None = None
    price_high: Decimal | None = None
    power_watts: int | None = None


def _gpu(
    name: str, memory: int, family: str = "", own: tuple[str, str, int] | None = None
) -> GPUModel:
    low, high, watts = own if own else (None, None, None)
    return GPUModel(
        name,
        family or name,
        memory,
        Decimal(low) if low else None,
        Decimal(high) if high else None,
        watts,
    )


GPUS: dict[str, GPUModel] = {
    g.name: g
    for g in (
        _gpu("A100", 40, own=("8000", "15000", 400)),
        _gpu("A100-80GB", 80, family="A100", own=("12000", "18000", 400)),
        _gpu("H100", 80, own=("25000", "40000", 700)),
        _gpu("H200", 141),
        _gpu("T4", 16, own=("1000", "2500", 70)),
        _gpu("L4", 24, own=("2500", "3500", 72)),
        _gpu("A10G", 24, own=("3000", "5000", 150)),
        _gpu("V100", 16, own=("1500", "4000", 300)),
        _gpu("T4I", 24),  # Yandex's name for its T4i platform
        # Yandex does not name the chips of these platforms: never sold as A100/H100 here.
        _gpu("YC-GEN2", 80),
        _gpu("YC-V4", 141),
    )
}


def family(name: str) -> str:
    return GPUS[name].family if name in GPUS else name


def implied_memory_gb(name: str) -> int:
    """The memory a name promises beyond its family's (A100-80GB → 80), else 0."""
    g = GPUS.get(name)
    return g.memory_gb if g and g.family != g.name else 0
