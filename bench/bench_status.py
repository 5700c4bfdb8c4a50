"""`provisioner status` over 0, 1,000 and 10,000 live machines, each run in a fresh interpreter,
beside `python -c pass` and `provisioner --help` measured in the same run (the anchors).

    .venv/bin/python bench/bench_status.py [--runs 7] [--machines 0 1000 10000] [--source DIR]
        [--database-url postgresql://USER@HOST:PORT/DB]

Each state is a SQLite file in a home of its own (``PROVISIONER_HOME``, no settings file: a new
user's set-up), filled with bulk inserts: running sandbox machines in USD and RUB, each with an
open compute and disk interval and a closed earlier one, every tenth relaunched after a
preemption (its cost is summed across both launches). The sandbox cloud holds the same
instances, so `status` (which asks the clouds first) finds each machine as recorded: it measures
provisioner's work, the list call being local. `--no-refresh` skips asking the clouds.
With ``--database-url`` each state is also written to PostgreSQL (a schema ``bench_<n>`` of
that database, dropped and made again; ``PROVISIONER_STATE_URL`` names it, beside a home of its
own for the sandbox) and `status` on it is timed beside SQLite's: the ratio is the wall time
(the server's CPU is not the command's) and the command's CPU time.
Prints the median wall and CPU time of N runs (after a warm-up run, which writes bytecode
caches as an install does: with $PYTHONDONTWRITEBYTECODE every run would compile the project
from source) and the 10x growth ratio.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NOW = datetime(2026, 11, 20, 12, tzinfo=UTC)
RATES = [("USD", "0.52"), ("USD", "3.06"), ("USD", "32.77"), ("RUB", "142.50"), ("RUB", "891.00")]
GPUS = [("T4", 1, "g4dn.xlarge"), ("A100", 8, "p4d.24xlarge"), ("H100", 8, "p5.48xlarge")]


def pg_schema(url: str, n: int) -> str:
    """A new schema ``bench_<n>`` in the database ``url`` names: the URL that uses it."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS bench_{n} CASCADE")
        conn.execute(f"CREATE SCHEMA bench_{n}")
    return f"{url}{'&' if '?' in url else '?'}options=-csearch_path%3Dbench_{n}"


def populate(home: Path, n: int, url: str | None = None) -> None:
    from sqlalchemy import insert

    from provisioner.app import App
    from provisioner.clock import ManualClock
    from provisioner.models import Event, Machine, UsageInterval, epoch_us
    from provisioner.settings import Settings

    # made on the clock `status` then runs on (PROVISIONER_CLOCK): a simulated-clock state,
    # which `status` reconciles as a user's real one on the real clock (provisioner.realclock)
    app = App(Settings(home=home, state_url=url), ManualClock(NOW))
    machines, usage, events, instances = [], [], [], []
    for i in range(n):
        cur, rate = RATES[i % len(RATES)]
        gpu, count, itype = GPUS[i % len(GPUS)]
        start = NOW - timedelta(hours=2 + i % 300, minutes=i % 60)
        mid, iid = f"m{i:08d}", f"sb-{i:08d}"
        row = {
            "id": mid,
            "name": f"exp-{i}",
            "project": f"proj-{i % 40}",
            "owner": f"user{i % 200}@example.com",
            "status": "running",
            "spec": {"resources": {"gpu": f"{gpu}:{count}", "market": "spot"}},
            "cloud": "sandbox",
            "region": "sandbox-1",
            "zone": "sandbox-1a",
            "instance_type": itype,
            "gpu": gpu,
            "gpu_count": count,
            "market": "spot",
            "instance_id": iid,
            "rate": Decimal(rate),
            "currency": cur,
            "disk_gb": 200,
            "disk_rate": Decimal("0.0274"),
            "public_ip": f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}",
            "created_at": start,
            "launched_at": start,
        }
        machines.append(row)
        spans = [(start, start + timedelta(hours=1)), (start + timedelta(hours=1, minutes=5), None)]
        for a, b in spans:
            for kind, r in (("compute", rate), ("disk", "0.0274")):
                usage.append(
                    {
                        "machine_id": mid,
                        "kind": kind,
                        "started_at": a,
                        "ended_at": b,
                        "start_us": epoch_us(a),
                        "end_us": None if b is None else epoch_us(b),
                        "rate": Decimal(r),
                        "currency": cur,
                    }
                )
        if i % 10 == 9:  # relaunched after a preemption: the earlier launch, terminated
            old = f"r{i:08d}"
            machines.append(
                {**row, "id": old, "status": "terminated", "instance_id": f"sb-old-{i:08d}"}
            )
            a, b = start - timedelta(hours=3), start - timedelta(minutes=1)
            usage.append(
                {
                    "machine_id": old,
                    "kind": "compute",
                    "started_at": a,
                    "ended_at": b,
                    "start_us": epoch_us(a),
                    "end_us": epoch_us(b),
                    "rate": Decimal(rate),
                    "currency": cur,
                }
            )
            events.append(
                {
                    "machine_id": mid,
                    "at": start,
                    "kind": "recovered",
                    "reason": "preempted",
                    "detail": {"replaces": old},
                }
            )
        labels = {"managed-by": "provisioner", "provisioner-machine": mid}
        instances.append(
            (iid, f"exp-{i}", f"tok-{i}", "sandbox-1", "sandbox-1a", itype, gpu, count, 1,
             "stop", "running", None, json.dumps(labels), None, start.isoformat(),
             row["public_ip"], None)
        )  # fmt: skip
    with app.db.engine.begin() as conn:
        if machines:
            conn.execute(insert(Machine.__table__), machines)
            conn.execute(insert(UsageInterval.__table__), usage)
        if events:
            conn.execute(insert(Event.__table__), events)
    sandbox = app.provider("sandbox")  # creates its tables
    sandbox.close()  # type: ignore[attr-defined]
    app.close()
    with sqlite3.connect(home / "sandbox.db") as db:
        db.executemany(f"INSERT INTO machines VALUES ({', '.join('?' * 17)})", instances)


def timed(cmd: list[str], env: dict[str, str], runs: int) -> tuple[float, float, str]:
    """The median wall and CPU (user + system) time of ``runs`` fresh processes, after one
    not timed (which writes the bytecode caches an installed package has). On a shared
    machine the CPU time is the steadier figure: what the wall time is when the cores are
    free."""
    walls, cpus, out = [], [], ""
    subprocess.run(cmd, cwd=env["PYTHONPATH"], env=env, capture_output=True)
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        r = subprocess.run(cmd, cwd=env["PYTHONPATH"], env=env, capture_output=True, text=True)
        walls.append(time.perf_counter() - t)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        if r.returncode != 0:
            sys.exit(f"{' '.join(cmd[2:])}: exit {r.returncode}\n{r.stderr}")
        out = r.stdout
    return statistics.median(walls), statistics.median(cpus), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--machines", type=int, nargs="+", default=[0, 1_000, 10_000])
    ap.add_argument("--source", default=str(ROOT), help="the checkout whose provisioner runs")
    ap.add_argument("--database-url", help="PostgreSQL too: postgresql://USER@HOST:PORT/DB")
    args = ap.parse_args()
    py = sys.executable
    status = [py, "-m", "provisioner", "status"]
    base = {
        k: v for k, v in os.environ.items() if not k.upper().startswith("PROVISIONER_")
    }  # no settings file or variable of the caller's leaks in
    base.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: modules load from bytecode
    base["PROVISIONER_CLOCK"] = NOW.isoformat()
    base["PYTHONPATH"] = args.source  # also the working directory: `-m provisioner` is its
    backends = ["SQLite"] + (["PostgreSQL"] if args.database_url else [])
    envs: dict[tuple[str, int], dict[str, str]] = {}
    for n in args.machines:
        for backend in backends:
            home = Path(tempfile.mkdtemp()) / "home"
            env = {**base, "PROVISIONER_HOME": home.as_posix()}
            if backend == "PostgreSQL":
                env["PROVISIONER_STATE_URL"] = pg_schema(args.database_url, n)
            t = time.perf_counter()
            populate(home, n, env.get("PROVISIONER_STATE_URL"))
            print(
                f"built a {backend} state of {n:,} live machines in {time.perf_counter() - t:.1f} s"
            )
            envs[backend, n] = env
    anchor_env = envs["SQLite", args.machines[0]]
    print(
        f"nproc {os.cpu_count()}; load average {os.getloadavg()[0]:.2f} before;"
        f" median of {args.runs} fresh processes"
    )
    print(f"{'command':<56} {'wall s':>7} {'CPU s':>7} {'CPU × python':>13}")
    python, python_cpu, _ = timed([py, "-c", "pass"], anchor_env, args.runs)

    def show(label: str, wall: float, cpu: float) -> None:
        print(f"{label:<56} {wall:>7.3f} {cpu:>7.3f} {cpu / python_cpu:>13.1f}")

    show("python -c pass", python, python_cpu)
    show(
        "provisioner --help", *timed([py, "-m", "provisioner", "--help"], anchor_env, args.runs)[:2]
    )
    cpus: dict[tuple[str, int, bool], float] = {}
    walls: dict[tuple[str, int, bool], float] = {}
    for n in args.machines:
        for refresh in (True, False):
            if n == 0 and not refresh:
                continue
            for backend in backends:
                cmd = status if refresh else [*status, "--no-refresh"]
                wall, cpu, out = timed(cmd, envs[backend, n], args.runs)
                rows = len(out.splitlines()) - 1 if n else 0
                assert rows == n, (n, rows, out[-500:])  # every machine drawn, none asked away
                cpus[backend, n, refresh], walls[backend, n, refresh] = cpu, wall
                label = f"status, {n:,} machines" + ("" if refresh else " --no-refresh")
                show(f"{label}, {backend}", wall, cpu)
    print(f"load average {os.getloadavg()[0]:.2f} after")
    for refresh in (True, False):
        sizes = sorted({n for _, n, r in cpus if r == refresh and n})
        for small, big in itertools.pairwise(sizes):
            growth = cpus["SQLite", big, refresh] / cpus["SQLite", small, refresh]
            print(
                f"{big:,} / {small:,} machines"
                + ("" if refresh else " (--no-refresh)")
                + f", SQLite: {growth:.2f}x the CPU time"
            )
    if "PostgreSQL" in backends:
        for (_, n, refresh), wall in walls.items():
            if _ != "PostgreSQL":
                continue
            key = ("SQLite", n, refresh)
            print(
                f"PostgreSQL / SQLite, status, {n:,} machines"
                + ("" if refresh else " --no-refresh")
                + f": {wall / walls[key]:.2f}x the wall time,"
                f" {cpus['PostgreSQL', n, refresh] / cpus[key]:.2f}x the CPU time"
            )


if __name__ == "__main__":
    main()
