"""A month's report over many usage intervals: time and peak memory.

    .venv/bin/python bench/bench_report.py [--intervals 100000 1000000] [--postgres URL]

For each size, builds a state database (SQLite in a temporary directory; with ``--postgres``, a
fresh schema on that server, dropped afterwards) with that many usage intervals over November
2026 — 50 per machine, compute and disk, in USD and RUB at a dozen rates — then, in a fresh
interpreter each, builds the report (the database clamps and groups the intervals: by project
and kind, per machine, per day; plus forecast, savings, idle waste) and renders it as CSV and
JSON. Prints the wall time, the peak RSS of that process, and Python's own peak allocation
(tracemalloc, a separate run since tracing slows it down).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NOV = datetime(2026, 11, 1, tzinfo=UTC)
PER_MACHINE = 50
RATES = [
    ("USD", "0.15"),
    ("USD", "0.50"),
    ("USD", "3.60"),
    ("USD", "11.00"),
    ("USD", "29.00"),
    ("RUB", "14.25"),
    ("RUB", "47.50"),
    ("RUB", "342.00"),
    ("RUB", "1045.00"),
]
GPUS = ["T4", "A100", "H100"]


def settings(home: Path, state_url: str | None):
    from provisioner.settings import Settings

    return Settings(home=home, state_url=state_url, clouds={"sandbox": {}})


def populate(home: Path, state_url: str | None, n: int) -> None:
    from sqlalchemy import insert

    from provisioner.app import App
    from provisioner.models import Machine, UsageInterval, epoch_us

    app = App(settings(home, state_url))
    rnd = random.Random(6)
    machines = max(1, n // PER_MACHINE)
    t0 = time.perf_counter()
    with app.db.engine.begin() as conn:
        conn.execute(
            insert(Machine.__table__),
            [
                {
                    "id": f"m{i:08d}",
                    "name": f"exp-{i}",
                    "project": f"proj-{i % 40}",
                    "owner": f"user{i % 200}@example.com",
                    "status": "terminated",
                    "spec": {},
                    "cloud": "sandbox",
                    "gpu": GPUS[i % 3],
                    "gpu_count": 1 + (i % 2) * 7,
                    "rate": Decimal(RATES[i % len(RATES)][1]),
                    "currency": RATES[i % len(RATES)][0],
                    "created_at": NOV,
                }
                for i in range(machines)
            ],
        )
        batch: list[dict] = []
        for i in range(machines):
            cur, rate = RATES[i % len(RATES)]
            t = NOV + timedelta(minutes=rnd.randrange(0, 600))
            for k in range(PER_MACHINE // 2):
                run = timedelta(minutes=rnd.randrange(10, 900))
                for kind, r in (("compute", rate), ("disk", "0.0068")):
                    batch.append(
                        {
                            "machine_id": f"m{i:08d}",
                            "kind": kind,
                            "started_at": t,
                            "ended_at": t + run,
                            "start_us": epoch_us(t),
                            "end_us": epoch_us(t + run),
                            "rate": Decimal(r),
                            "currency": cur,
                        }
                    )
                t += run + timedelta(minutes=rnd.randrange(1, 600)) + timedelta(microseconds=k)
            if len(batch) >= 50_000:
                conn.execute(insert(UsageInterval.__table__), batch)
                batch.clear()
        if batch:
            conn.execute(insert(UsageInterval.__table__), batch)
    if app.db.engine.dialect.name == "postgresql":
        # What autovacuum does on a server a minute after a bulk load; this machine's server has
        # it off, and without statistics PostgreSQL plans a budget's queries blind.
        with app.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("ANALYZE")
    app.close()
    print(
        f"populated {machines * PER_MACHINE:,} intervals on {machines:,} machines "
        f"in {time.perf_counter() - t0:.1f} s"
    )


def run(home: Path, state_url: str | None, trace: bool) -> None:
    if trace:
        import tracemalloc

        tracemalloc.start()
    from provisioner import ledger, render, reports
    from provisioner.app import App

    app = App(settings(home, state_url))
    app.db  # noqa: B018  (migrate before timing)
    t = time.perf_counter()
    r = reports.build(
        app, ledger.Period.parse("2026-11"), by="project", now=datetime(2026, 12, 1, 3, tzinfo=UTC)
    )
    built = time.perf_counter() - t
    csv_text, js = render.csv(r), json.dumps(r.as_json(), default=str)
    rendered = time.perf_counter() - t
    out = {
        "build_s": built,
        "build_and_render_s": rendered,
        "total": str(r.total),
        "csv_bytes": len(csv_text),
        "json_bytes": len(js),
        "peak_rss_mb": peak_rss_mb(),
    }
    if trace:
        out["python_peak_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
    else:
        out["floor_s"] = floor(app)
    print(json.dumps(out))


def floor(app) -> float:
    """The anchor: one bare GROUP BY over the same table, clamping each interval to the period
    (what the issue measured as the floor: 0.86-1.44 s on PostgreSQL at 1M), rows fetched but
    not priced, not rendered."""
    from provisioner.models import epoch_us

    p0, p1 = (
        epoch_us(datetime(2026, 11, 1, tzinfo=UTC)),
        epoch_us(datetime(2026, 12, 1, tzinfo=UTC)),
    )
    now = epoch_us(datetime(2026, 12, 1, 3, tzinfo=UTC))
    least, greatest = (
        ("MIN", "MAX") if app.db.engine.dialect.name == "sqlite" else ("LEAST", "GREATEST")
    )
    sql = (
        f"SELECT machine_id, kind, currency, rate, SUM({least}(COALESCE(end_us, {now}), {p1})"
        f" - {greatest}(start_us, {p0})) FROM usage_intervals WHERE start_us < {p1}"
        f" AND (end_us IS NULL OR end_us > {p0}) GROUP BY machine_id, kind, currency, rate"
    )
    raw = app.db.engine.raw_connection()
    try:
        t = time.perf_counter()
        cur = raw.cursor()
        cur.execute(sql)
        cur.fetchall()
        return time.perf_counter() - t
    finally:
        raw.close()


def peak_rss_mb() -> float:
    """This process's own peak RSS. Not ``ru_maxrss``: Linux carries it over an exec from the
    process that forked (here the parent, whose peak is populating the database)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(n: int, state_url: str | None) -> dict:
    home = Path(tempfile.mkdtemp()) / "home"
    populate(home, state_url, n)
    child = [sys.executable, __file__, "--run", str(home)]
    if state_url:
        child += ["--state-url", state_url]
    plain = json.loads(subprocess.run(child, capture_output=True, text=True, check=True).stdout)
    traced = json.loads(
        subprocess.run([*child, "--trace"], capture_output=True, text=True, check=True).stdout
    )
    print(
        f"report over {n:,} intervals: built in {plain['build_s']:.2f} s, "
        f"with CSV+JSON {plain['build_and_render_s']:.2f} s; peak RSS "
        f"{plain['peak_rss_mb']:.0f} MB; Python peak allocation "
        f"{traced['python_peak_mb']:.1f} MB (traced run: {traced['build_s']:.2f} s); "
        f"total {plain['total']}; floor (one bare GROUP BY) {plain['floor_s']:.2f} s",
        flush=True,
    )
    return plain


def postgres_schema(url: str) -> tuple[str, str]:
    """A fresh schema on the server at ``url``, and the URL that uses it."""
    import uuid

    import psycopg

    schema = f"bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    return schema, f"{url}?options=-csearch_path%3D{schema}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--intervals", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--postgres", help="a PostgreSQL server URL (a schema of its own is made)")
    ap.add_argument("--state-url", help=argparse.SUPPRESS)  # child: the database to report on
    ap.add_argument("--run", help=argparse.SUPPRESS)  # child: the home to report on
    ap.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        run(Path(args.run), args.state_url, args.trace)
        return
    times = []
    for n in args.intervals:
        if args.postgres is None:
            times.append(measure(n, None)["build_s"])
            continue
        import psycopg

        schema, url = postgres_schema(args.postgres)
        try:
            times.append(measure(n, url)["build_s"])
        finally:
            with psycopg.connect(args.postgres, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    for (n0, t0), (n1, t1) in zip(
        zip(args.intervals, times, strict=True),
        zip(args.intervals[1:], times[1:], strict=False),
        strict=False,
    ):
        print(f"{n1 / n0:.0f}x the intervals: {t1 / t0:.1f}x the time")


if __name__ == "__main__":
    main()
