"""Planner over a large catalog: 10,000 and 100,000 offers (the shipped catalog's rows repeated
over synthetic zones with varied prices), written as refreshed per-cloud catalogs, then planned
for configs/examples/experiment.yaml as ``provisioner plan`` does (read the experiment's GPU
family, count the rest, rank). Side by side in the same run: reading every row into offers (the
format's full cost) and a bare ``csv.reader`` pass over the same files (the floor); then
``provisioner plan`` as a user runs it, a whole fresh process (start-up included; after one
warm-up run that writes the bytecode caches an install has), beside ``python -c pass``: the
median wall and CPU time of ``--runs`` processes.

    .venv/bin/python bench/bench_plan.py [--runs 5]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import resource
import statistics
import subprocess
import sys
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


def command(cmd: list[str], env: dict[str, str], runs: int) -> tuple[float, float]:
    """The median wall and CPU time (user + system) of ``runs`` fresh processes."""
    walls, cpus = [], []
    subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, check=True)
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, check=True)
        walls.append(time.perf_counter() - t)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    experiment = load_experiment(ROOT / "configs/examples/experiment.yaml")
    clouds = [c for c in providers.CLOUDS if c != "sandbox"]
    base = catalog.load(Settings(home=Path(tempfile.mkdtemp())), clouds)
    print(f"shipped catalog: {len(base)} offers; experiment wants {experiment.resources.gpu}")
    print(
        f"{'offers':>8} {'csv.reader s':>13} {'read all s':>11} {'plan s':>8} "
        f"{'converted':>10} {'candidates':>11}"
    )
    homes = {n: measure(n, base, experiment, clouds) for n in (10_000, 100_000)}
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("PROVISIONER_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: modules load from bytecode
    env.update(PYTHONPATH=str(ROOT), PROVISIONER_CLOCK="2026-11-02T09:00:00+00:00")
    print(
        f"nproc {os.cpu_count()}; load average {os.getloadavg()[0]:.2f} before;"
        f" median of {args.runs} fresh processes"
    )
    print(f"{'command':<40} {'wall s':>7} {'CPU s':>7} {'CPU × python':>13}")
    wall, python = command([sys.executable, "-c", "pass"], env, args.runs)
    print(f"{'python -c pass':<40} {wall:>7.3f} {python:>7.3f} {1:>13.1f}")
    for n, home in homes.items():
        cfg = home / "settings.yaml"
        cfg.write_text(
            f"home: {json.dumps(str(home))}\nclouds: {json.dumps({c: {} for c in clouds})}\n"
        )
        cmd = [sys.executable, "-m", "provisioner", "-c", str(cfg), "plan"]
        wall, cpu = command([*cmd, str(ROOT / "configs/examples/experiment.yaml")], env, args.runs)
        print(
            f"{f'provisioner plan, {n:,} offers':<40} {wall:>7.3f} {cpu:>7.3f}"
            f" {cpu / python:>13.1f}"
        )
    print(f"load average {os.getloadavg()[0]:.2f} after")


def measure(n: int, base: list, experiment, clouds: list[str]) -> Path:
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
    return home


if __name__ == "__main__":
    main()
