"""A simulated month of spot preemptions: how much is billed past the instant the cloud took
each machine.

    .venv/bin/python bench/preemption_month.py [--machines 12] [--days 30] [--seed 7]

On the sandbox cloud and a manual clock (no wall time involved): a fleet of spot machines (T4,
A100 and one 8×H100), preempted at seeded random instants between the scheduler's 5-minute ticks,
plus one 8×H100 taken a minute into a 6-hour scheduler outage. Every tick runs the reconcile and
recover passes as the daemon does. At the end each preemption's compute usage in the ledger is
compared with the instant the cloud took the machine: the run it cut short must end there (a
machine started again in place opens a new run, which bills as it should).

Printed: preemptions, compute billed past the cloud's instant (the ledger), and what closing
usage at the moment the scheduler noticed would have billed (the behaviour before #23).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import select

from provisioner import machines
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.jobs import reconcile, recover
from provisioner.models import Machine, UsageInterval
from provisioner.settings import Settings
from provisioner.spec import Experiment

START = datetime(2026, 11, 2, tzinfo=UTC)
TICK = timedelta(minutes=5)
OUTAGE = timedelta(hours=6)
GPUS = ["T4:1", "T4:4", "A100:1", "A100:8", "H100:1"]


def experiment(name: str, gpu: str) -> Experiment:
    return Experiment.model_validate(
        {
            "name": name,
            "project": "bench",
            "owner": "ana@example.com",
            "resources": {"gpu": gpu, "market": "spot", "clouds": ["sandbox"], "disk_gb": 100},
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--machines", type=int, default=12)
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--per-day", type=float, default=3.0, help="preemptions a day, fleet-wide")
    args = ap.parse_args()
    rnd = random.Random(args.seed)
    clock = ManualClock(START)
    home = Path(tempfile.mkdtemp(prefix="preempt-month-"))
    settings = Settings(
        home=home,
        clouds={"sandbox": {"latency_seconds": 0, "retry_base_seconds": 0.001, "agent": False}},
    )
    app = App(settings, clock)
    wall = time.perf_counter()
    names = [f"m{i:02d}" for i in range(args.machines)]
    for i, name in enumerate(names):
        machines.up(app, experiment(name, GPUS[i % len(GPUS)]))
    machines.up(app, experiment("h100x8", "H100:8"))
    end = START + timedelta(days=args.days)
    outage_at = START + timedelta(days=args.days // 2, hours=12)
    # instants the cloud takes a machine: seeded, off the tick grid
    n = int(args.per_day * args.days)
    takes = sorted(
        (START + timedelta(seconds=rnd.randrange(600, int((end - START).total_seconds()))), name)
        for name in rnd.choices(names, k=n)
    )
    takes.append((outage_at + timedelta(minutes=1), "h100x8"))
    takes.sort()
    taken: list[tuple[str, datetime, datetime]] = []  # (machine id, cloud's instant, noticed)
    pending: list[tuple[str, datetime]] = []
    tick = START
    while tick < end:
        nxt = tick + (OUTAGE if tick == outage_at else TICK)
        while takes and takes[0][0] < nxt:
            at, name = takes.pop(0)
            clock.set(at)
            m = machines.find(app, name)
            if m is None or m.status != "running":
                continue  # relaunching, or taken already: the cloud takes what runs
            app.provider("sandbox").preempt(machines.ref(m))
            pending.append((m.id, at))
        clock.set(nxt)
        reconcile.run(app)
        for mid, at in pending:
            taken.append((mid, at, nxt))
        pending = []
        recover.run(app)
        tick = nxt
    past = Decimal(0)
    before = Decimal(0)
    with app.db.session() as s:
        for mid, at, noticed in taken:
            m = s.get(Machine, mid)
            assert m is not None and m.rate is not None
            for u in s.scalars(
                select(UsageInterval).where(
                    UsageInterval.machine_id == mid, UsageInterval.kind == "compute"
                )
            ):
                began = u.started_at if u.started_at.tzinfo else u.started_at.replace(tzinfo=UTC)
                last = u.ended_at or end
                last = last if last.tzinfo else last.replace(tzinfo=UTC)
                if began <= at < last:  # the run the cloud cut short: it must end at `at`
                    past += m.rate * Decimal((last - at).total_seconds()) / 3600
            before += m.rate * Decimal((noticed - at).total_seconds()) / 3600
    app.close()
    print(
        f"{len(taken)} preemptions over {args.days} days, {args.machines + 1} spot machines, "
        f"a {OUTAGE} scheduler outage; simulated in {time.perf_counter() - wall:.1f} s"
    )
    print(f"compute billed past the cloud's instant: {past.quantize(Decimal('0.01'))} USD")
    print(
        "closing at the moment the scheduler noticed would have billed: "
        f"{before.quantize(Decimal('0.01'))} USD"
    )


if __name__ == "__main__":
    main()
