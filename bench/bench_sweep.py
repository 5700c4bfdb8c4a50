"""Sweep over many sandbox machines: time per pass and provider API calls per pass.

The sweep reads the state with one query per table, refreshes it with one list call per cloud
(not one get per machine), and then calls the cloud once per machine it acts on. Run:

    .venv/bin/python bench/bench_sweep.py [--machines 10000]
    .venv/bin/python bench/bench_sweep.py --aws [--machines 1000]   # against moto server

With ``--aws`` the machines live in moto (behind the test suite's fault-injecting proxy) and the
pass is counted in EC2 requests by action, at two page sizes: list calls grow with pages.

Seeding launches every machine through the sandbox adapter and writes state rows in bulk
(through ``up`` it would take minutes and measure ``up``, not the sweep).
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from providers.base import TAG_MACHINE, TAG_MANAGED_BY, TAG_MANAGED_BY_VALUE, LaunchRequest
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.jobs import sweep
from provisioner.jobs.passes import Pass
from provisioner.models import Event, Heartbeat, Machine, new_id
from provisioner.settings import Settings

POLICY = """
name: nights
off_hours:
  timezone: Europe/Berlin
  windows: [{days: mon-fri, start: "20:00", end: "08:00"}]
idle: {gpu_util_below: 5, for_minutes: 30}
"""
LAUNCH = datetime(2026, 11, 6, 8, 0, tzinfo=UTC)  # Friday morning
NOON = datetime(2026, 11, 6, 11, 0, tzinfo=UTC)  # 12:00 Berlin: within hours
NIGHT = datetime(2026, 11, 6, 21, 0, tzinfo=UTC)  # 22:00 Berlin: out of hours


def record(app: App, rows: list[dict]) -> None:
    """State rows for launched machines, written in bulk (``up`` would measure ``up``)."""
    machines = [
        Machine(
            project="bench",
            owner="bench@example.com",
            status="running",
            spec={},
            gpu="T4",
            gpu_count=1,
            currency="USD",
            created_at=LAUNCH,
            launched_at=LAUNCH,
            **r,
        )
        for r in rows
    ]
    with app.db.session() as s:
        s.add_all(machines)
        s.flush()
        s.add_all(Event(machine_id=m.id, at=LAUNCH, kind="launched", detail={}) for m in machines)


def seed(app: App, n: int) -> None:
    sandbox = app.provider("sandbox")
    rows = []
    for i in range(n):
        mid = new_id()
        inst = sandbox.launch(
            LaunchRequest(
                name=f"m{i:05d}",
                token=f"bench-{mid}",
                region="sandbox-us",
                zone="sandbox-us-1a",
                instance_type="sbx-t4-1",
                gpu="T4",
                gpu_count=1,
                spot=True,
                labels={TAG_MANAGED_BY: TAG_MANAGED_BY_VALUE, TAG_MACHINE: mid},
            )
        )
        rows.append(
            dict(
                id=mid,
                name=f"m{i:05d}",
                cloud="sandbox",
                region="sandbox-us",
                zone="sandbox-us-1a",
                instance_type="sbx-t4-1",
                market="spot",
                instance_id=inst.id,
                resource_name=inst.name,
                rate=Decimal("0.15"),
            )
        )
    record(app, rows)


def beats(app: App, now: datetime, n_idle: int) -> None:
    """Every machine reports every 5 minutes for the last 40; the first ``n_idle`` at 1%."""
    with app.db.session() as s:
        ids = list(
            s.scalars(
                Machine.__table__.select().with_only_columns(Machine.id).order_by(Machine.name)
            )
        )
        rows = []
        for k, mid in enumerate(ids):
            util = 1.0 if k < n_idle else 80.0
            for m in range(0, 45, 5):
                rows.append(
                    {
                        "machine_id": mid,
                        "at": now - timedelta(minutes=m),
                        "gpus": [{"index": 0, "util": util}],
                        "max_util": util,
                    }
                )
        s.execute(Heartbeat.__table__.insert(), rows)


def timed_pass(app: App, label: str, **kw) -> Pass:
    sandbox = app.provider("sandbox")
    calls = sandbox.api_calls
    t = time.perf_counter()
    p = sweep.run(app, **kw)
    dt = time.perf_counter() - t
    acted = sum(1 for a in p.actions if a.done or p.dry_run)
    print(
        f"  {label:<34} {dt:7.2f} s   API calls {sandbox.api_calls - calls:6d}"
        f"   checked {p.checked}, {'would act' if p.dry_run else 'acted'} on {acted}"
    )
    return p


def run(n: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        home = Path(d)
        (home / "policy.yaml").write_text(POLICY)
        settings = Settings(
            home=home,
            clouds={"sandbox": {"latency_seconds": 0, "retry_base_seconds": 0.001}},
            policies=[str(home / "policy.yaml")],
        )
        clock = ManualClock(LAUNCH)
        app = App(settings, clock)
        t = time.perf_counter()
        seed(app, n)
        print(f"{n} machines seeded in {time.perf_counter() - t:.1f} s")
        clock.set(NOON)
        beats(app, NOON, n // 2)
        timed_pass(app, "noon, half idle: nothing to do")
        clock.set(NIGHT)
        beats(app, NIGHT, n // 2)
        timed_pass(app, "night, dry run (no cloud calls)", dry_run=True)
        timed_pass(app, f"night: stop the {n // 2} idle")
        clock.advance(timedelta(minutes=5))
        timed_pass(app, "next pass: nothing left to do")
        app.close()


def run_aws(n: int) -> None:
    import os

    from tests.emulators.aws import start_aws_emulator

    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    emu = start_aws_emulator()
    try:
        with tempfile.TemporaryDirectory() as d:
            home = Path(d)
            (home / "policy.yaml").write_text(POLICY)
            ec2 = emu.client("ec2")
            settings = Settings(
                home=home,
                policies=[str(home / "policy.yaml")],
                clouds={
                    "aws": {
                        "endpoint": emu.endpoint_url,
                        "regions": ["us-east-1"],
                        "images": {"us-east-1": emu.ubuntu_ami("us-east-1")},
                        "retry_base_seconds": 0.001,
                    }
                },
            )
            clock = ManualClock(LAUNCH)
            app = App(settings, clock)
            t = time.perf_counter()
            seed_aws(app, ec2, emu.ubuntu_ami("us-east-1"), n)
            print(f"{n} machines seeded in moto in {time.perf_counter() - t:.1f} s")
            for page, label in ((None, "default page size"), (100, "pages of 100")):
                if page:
                    emu.faults.cap_page_size(page)
                clock.set(NOON + timedelta(minutes=1 if page else 0))
                beats(app, clock.now(), 0)
                before = len(emu.requests)
                t = time.perf_counter()
                sweep.run(app)
                dt = time.perf_counter() - t
                counts: dict[str, int] = {}
                for r in emu.requests[before:]:
                    counts[r.action] = counts.get(r.action, 0) + 1
                print(f"  noon pass, {label:<18} {dt:6.2f} s   EC2 requests {counts}")
            clock.set(NIGHT)
            beats(app, NIGHT, n // 2)
            before = len(emu.requests)
            t = time.perf_counter()
            p = sweep.run(app)
            dt = time.perf_counter() - t
            counts = {}
            for r in emu.requests[before:]:
                counts[r.action] = counts.get(r.action, 0) + 1
            done = sum(a.done for a in p.actions)
            print(f"  night pass: stop {done} idle    {dt:6.2f} s   EC2 requests {counts}")
            app.close()
    finally:
        emu.stop()


def seed_aws(app: App, ec2, ami: str, n: int) -> None:
    """One reservation per machine, as `up` makes them (moto pages by reservation)."""
    rows = []
    for i in range(n):
        mid = new_id()
        tags = [
            {"Key": TAG_MANAGED_BY, "Value": TAG_MANAGED_BY_VALUE},
            {"Key": TAG_MACHINE, "Value": mid},
        ]
        inst = ec2.run_instances(
            ImageId=ami,
            InstanceType="g4dn.xlarge",
            MinCount=1,
            MaxCount=1,
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
        )["Instances"][0]
        rows.append(
            dict(
                id=mid,
                name=f"m{i:05d}",
                cloud="aws",
                region="us-east-1",
                zone=inst["Placement"]["AvailabilityZone"],
                instance_type="g4dn.xlarge",
                market="reserved",
                instance_id=inst["InstanceId"],
                resource_name=f"m{i:05d}",
                rate=Decimal("0.526"),
            )
        )
    record(app, rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--machines", type=int, nargs="*", default=[1000, 10000])
    ap.add_argument("--aws", action="store_true", help="machines in moto server, not the sandbox")
    args = ap.parse_args()
    if args.aws:
        for n in args.machines:
            run_aws(n)
        return
    print(
        f"python {platform.python_version()} on {platform.machine()}, "
        f"{platform.system()} {platform.release()}; state: SQLite file (WAL)"
    )
    for n in args.machines:
        run(n)


if __name__ == "__main__":
    main()
