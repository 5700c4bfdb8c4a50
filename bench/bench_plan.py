"""Planner over a large catalog: 10,000 and 100,000 offers (the shipped catalog's rows repeated
over synthetic zones with varied prices), timed for reading the CSV and for ranking.

    .venv/bin/python bench/bench_plan.py
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import providers
from provisioner import catalog, planner
from provisioner.settings import Settings
from provisioner.spec import load_experiment

ROOT = Path(__file__).resolve().parent.parent


def synthetic(n: int, base: list) -> list:
    rnd = random.Random(7)
    out = []
    while len(out) < n:
        o = base[len(out) % len(base)]
        k = Decimal(rnd.randint(80, 120)) / 100
        out.append(
            replace(
                o,
                zone=f"{o.zone or o.region}-x{len(out) // len(base)}",
                price=o.price * k if o.price else None,
                spot_price=o.spot_price * k if o.spot_price else None,
            )
        )
    return out


def main() -> None:
    home = Path(tempfile.mkdtemp())
    settings = Settings(home=home)
    experiment = load_experiment(ROOT / "configs/examples/experiment.yaml")
    base = catalog.load(settings, providers.CLOUDS)
    print(f"shipped catalog: {len(base)} offers")
    print(f"{'offers':>8} {'read CSV s':>11} {'plan s':>8} {'candidates':>11} {'µs/offer':>9}")
    for n in (10_000, 100_000):
        offers = synthetic(n, base)
        path = home / "catalog" / f"bench-{n}.csv"
        catalog.write_csv(path, offers)
        t = time.perf_counter()
        loaded = list(catalog.read_csv(path))
        t_read = time.perf_counter() - t
        t = time.perf_counter()
        p = planner.plan(
            experiment, loaded, settings.money_rates, enabled_clouds=settings.enabled_clouds
        )
        t_plan = time.perf_counter() - t
        print(
            f"{n:>8} {t_read:>11.3f} {t_plan:>8.3f} {len(p.candidates):>11} "
            f"{(t_read + t_plan) / n * 1e6:>9.1f}"
        )


if __name__ == "__main__":
    main()
