"""The dashboard's two heavy pages: the fleet of 1,000 live machines (two hours of heartbeats
each, every 30 s) and the spend page over 1M usage intervals (with two budgets).

    .venv/bin/python bench/bench_dashboard.py [--machines 1000] [--intervals 1000000] \
        [--postgres URL]

Builds the state like bench/bench_report.py (bulk inserts into a SQLite file in a temporary
directory; with ``--postgres``, into fresh schemas on that server, dropped afterwards), then, in
a fresh interpreter (one per fleet page), calls the WSGI application the way waitress would and
times each page: the first request (cold: imports; the templates are compiled at start-up, as
the server does before it listens), the median of two more passes over the state, one with the
budgets' standings already shared (another page viewed within the slice), and one answered from
the pages' cache (another browser in the same slice).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

NOW = datetime(2026, 11, 26, 10, tzinfo=UTC)
BEAT_EVERY = timedelta(seconds=30)
BEATS_FOR = timedelta(hours=2)
POLICIES = [
    {
        "name": "nlp",
        "applies_to": {"projects": ["proj-1*"]},
        "budget": {"amount": "200000 USD"},
        "off_hours": {
            "timezone": "Europe/Berlin",
            "windows": [{"days": "mon-fri", "start": "19:20", "end": "07:00"}],
        },
    },
    {
        "name": "vision",
        "applies_to": {"projects": ["proj-2*"]},
        "budget": {"amount": "9000000 RUB"},
    },
]


def settings(home: Path, state_url: str | None = None):
    from provisioner.settings import Settings

    return Settings(
        home=home, state_url=state_url, clouds={"sandbox": {}}, policies=[str(home / "policies")]
    )


def populate_fleet(home: Path, n: int, state_url: str | None) -> None:
    import yaml
    from sqlalchemy import insert

    from provisioner.app import App
    from provisioner.clock import ManualClock
    from provisioner.models import Event, Heartbeat, Machine, UsageInterval, epoch_us

    (home / "policies").mkdir(parents=True, exist_ok=True)
    for p in POLICIES:
        (home / "policies" / f"{p['name']}.yaml").write_text(yaml.safe_dump(p))
    app = App(settings(home, state_url), ManualClock(NOW))  # the clock the pages run on
    rnd = random.Random(7)
    t0 = time.perf_counter()
    start = NOW - timedelta(days=3)
    with app.db.engine.begin() as conn:
        rows = []
        for i in range(n):
            rows.append(
                {
                    "id": f"live{i:06d}",
                    "name": f"live-{i}",
                    "project": f"proj-{i % 40}",
                    "owner": f"user{i % 200}@example.com",
                    "status": "running",
                    "spec": {"lifecycle": {"max_lifetime": "96h"}} if i % 3 == 0 else {},
                    "cloud": "sandbox",
                    "region": "sandbox-us",
                    "zone": "sandbox-us-1a",
                    "instance_type": "sbx-t4-1",
                    "instance_id": f"i-{i:08x}",
                    "gpu": "T4",
                    "gpu_count": 1,
                    "market": "spot",
                    "rate": Decimal("0.15"),
                    "disk_rate": Decimal("0.0068"),
                    "currency": "USD",
                    "created_at": start,
                    "launched_at": start,
                }
            )
        conn.execute(insert(Machine.__table__), rows)
        conn.execute(
            insert(Event.__table__),
            [{"machine_id": r["id"], "at": start, "kind": "launched", "detail": {}} for r in rows],
        )
        conn.execute(
            insert(UsageInterval.__table__),
            [
                {
                    "machine_id": r["id"],
                    "kind": kind,
                    "started_at": start,
                    "ended_at": None,
                    "start_us": epoch_us(start),
                    "end_us": None,
                    "rate": rate,
                    "currency": "USD",
                }
                for r in rows
                for kind, rate in (("compute", r["rate"]), ("disk", r["disk_rate"]))
            ],
        )
        beats, at = [], NOW - BEATS_FOR
        while at < NOW:
            for r in rows:
                u = rnd.choice((2.0, 50.0, 95.0))
                beats.append(
                    {
                        "machine_id": r["id"],
                        "at": at,
                        "gpus": [{"index": 0, "util": u}],
                        "max_util": u,
                    }
                )
            if len(beats) >= 50_000:
                conn.execute(insert(Heartbeat.__table__), beats)
                beats.clear()
            at += BEAT_EVERY
        if beats:
            conn.execute(insert(Heartbeat.__table__), beats)
    if app.db.engine.dialect.name == "postgresql":  # as autovacuum would (bench_report.py)
        with app.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("ANALYZE")
    app.close()
    print(
        f"fleet: {n:,} live machines, {int(BEATS_FOR / BEAT_EVERY) * n:,} heartbeats, built in "
        f"{time.perf_counter() - t0:.1f} s"
    )


def get(wsgi, path: str) -> tuple[int, int]:
    from wsgiref.util import setup_testing_defaults

    env: dict = {"REQUEST_METHOD": "GET"}
    env["PATH_INFO"], _, env["QUERY_STRING"] = path.partition("?")
    setup_testing_defaults(env)
    env["wsgi.input"] = io.BytesIO()
    env["HTTP_ACCEPT_ENCODING"] = "gzip, deflate, br"  # as a browser asks
    status: list[str] = []
    body = b"".join(wsgi(env, lambda s, h, e=None: status.append(s)))
    return int(status[0].split()[0]), len(body)


def run(home: Path, state_url: str | None, paths: list[str]) -> None:
    from provisioner.app import App
    from provisioner.clock import ManualClock
    from provisioner.dashboard import make_app

    app = App(settings(home, state_url), ManualClock(NOW))
    app.db  # noqa: B018  (migrated before timing)
    wsgi = make_app(app).warm()  # as `provisioner dashboard` starts before it listens
    out = {}
    for path in paths:
        times = []
        for i in range(5):
            if i < 3:
                wsgi._cache.clear()  # each of these passes over the state anew
            elif i == 3:  # another page within the slice: the budgets' standings are shared
                for k in [k for k in wsgi._cache if k[0] != "standings"]:
                    del wsgi._cache[k]
            t = time.perf_counter()
            code, size = get(wsgi, path)
            times.append(time.perf_counter() - t)
            assert code == 200, (path, code)
        out[path] = {
            "cold_s": times[0],
            "warm_s": statistics.median(times[1:3]),
            "standings_shared_s": times[3],
            "shared_s": times[4],
            "bytes": size,
        }
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--machines", type=int, default=1000)
    ap.add_argument("--intervals", type=int, default=1_000_000)
    ap.add_argument("--postgres", help="a PostgreSQL server URL (schemas of their own are made)")
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--state-url", help=argparse.SUPPRESS)
    ap.add_argument("--paths", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        run(Path(args.run), args.state_url, args.paths)
        return
    import bench_report

    schemas: list[str] = []

    def state_url() -> str | None:
        if args.postgres is None:
            return None
        schema, url = bench_report.postgres_schema(args.postgres)
        schemas.append(schema)
        return url

    try:
        measure(args, state_url)
    finally:
        if schemas:
            import psycopg

            with psycopg.connect(args.postgres, autocommit=True) as conn:
                for schema in schemas:
                    conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


def measure(args: argparse.Namespace, state_url: Callable[[], str | None]) -> None:
    import bench_report
    import yaml

    tmp = Path(tempfile.mkdtemp())
    fleet_home, fleet_url = tmp / "fleet", state_url()
    populate_fleet(fleet_home, args.machines, fleet_url)
    spend_home, spend_url = tmp / "spend", state_url()
    (spend_home / "policies").mkdir(parents=True)
    for p in POLICIES:
        (spend_home / "policies" / f"{p['name']}.yaml").write_text(yaml.safe_dump(p))
    bench_report.populate(spend_home, spend_url, args.intervals)
    fleet = ["/", "/?sort=cost&dir=desc", "/?project=proj-7"]
    for home, url, paths in (
        *((fleet_home, fleet_url, [p]) for p in fleet),  # each page's first request cold
        (spend_home, spend_url, ["/spend?period=2026-11", "/spend?budget=nlp&period=2026-11"]),
    ):
        child = [sys.executable, __file__, "--run", str(home), "--paths", *paths]
        if url:
            child += ["--state-url", url]
        res = json.loads(subprocess.run(child, capture_output=True, text=True, check=True).stdout)
        for path, r in res.items():
            print(
                f"{path:40} first {r['cold_s']:.2f} s, again {r['warm_s']:.2f} s, budgets "
                f"shared {r['standings_shared_s']:.2f} s, page shared {r['shared_s']:.3f} s "
                f"({r['bytes'] / 1024:.0f} KiB)",
                flush=True,
            )


if __name__ == "__main__":
    main()
