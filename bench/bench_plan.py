"""Planner over a large catalog: 10,000 and 100,000 offers (the shipped catalog's rows repeated
over synthetic zones with varied prices), written as refreshed per-cloud catalogs, then planned
for configs/examples/experiment.yaml as ``provisioner plan`` does (read the experiment's GPU
family, count the rest, rank). Side by side in the same run: reading every row into offers (the
format's full cost) and a bare ``csv.reader`` pass over the same files (the floor).

    .venv/bin/python bench/bench_plan.py
"""

from __future__ import annotations

import csv
import random
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import providers
from provisioner import catalog, planner, planning
from provisioner.app import App
from provisioner.clock import ManualClock
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


def best(fn, runs: int = 3) -> tuple[float, object]:
    times, result = [], None
    for _ in range(runs):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return min(times), result


def main() -> None:
    experiment = load_experiment(ROOT / "configs/examples/experiment.yaml")
    clouds = [c for c in providers.CLOUDS if c != "sandbox"]
    base = catalog.load(Settings(home=Path(tempfile.mkdtemp())), clouds)
    print(f"shipped catalog: {len(base)} offers; experiment wants {experiment.resources.gpu}")
    print(
        f"{'offers':>8} {'csv.reader s':>13} {'read all s':>11} {'plan s':>8} "
        f"{'converted':>10} {'candidates':>11}"
    )
    for n in (10_000, 100_000):
        measure(n, base, experiment, clouds)


def measure(n: int, base: list, experiment, clouds: list[str]) -> None:
    home = Path(tempfile.mkdtemp())
    by_cloud = defaultdict(list)
    for o in synthetic(n, base):
        by_cloud[o.cloud].append(o)
    settings = Settings(home=home, clouds={c: {} for c in clouds})
    paths = []
    for cloud, offers in by_cloud.items():
        paths.append(catalog.refreshed_path(settings, cloud))
        catalog.write_csv(paths[-1], offers)

    def floor() -> int:
        rows = 0
        for p in paths:
            with p.open(newline="") as f:
                rows += sum(1 for _ in csv.reader(f))
        return rows

    t_floor, _ = best(floor)
    t_all, _ = best(lambda: [o for p in paths for o in catalog.read_csv(p)])
    app = App(settings, ManualClock(datetime(2026, 11, 2, 9, 0, tzinfo=UTC)))
    t_plan, p = best(lambda: planning.plan(app, experiment))
    assert isinstance(p, planner.Plan)
    converted = n - sum(p.rejected.get(r, 0) for r in (catalog.OTHER_GPU, catalog.OTHER_COUNT))
    print(
        f"{n:>8} {t_floor:>13.3f} {t_all:>11.3f} {t_plan:>8.3f} {converted:>10} "
        f"{len(p.candidates):>11}"
    )


if __name__ == "__main__":
    main()
