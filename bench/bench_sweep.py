"""The off-hours sweep at fleet size, and side by side with Cloud Custodian on one moto fleet.

    .venv/bin/python bench/bench_sweep.py                       # both parts, default sizes
    .venv/bin/python bench/bench_sweep.py --sandbox 500 5000    # sandbox cloud only
    .venv/bin/python bench/bench_sweep.py --aws 100 1000        # moto, with Cloud Custodian
    .venv/bin/python bench/bench_sweep.py --aws 1000 --database-url postgresql://postgres@127.0.0.1:5432/test

Sandbox: every machine idle at night (no heartbeat, counted as idle); one pass stops them all.
Printed: the pass's time, the sandbox API calls and the state database's write transactions.

AWS: a fleet of idle g4dn machines in moto server, behind the test suite's request-recording
proxy (tests/emulators/aws.py), one reservation per machine as `up` makes them. Each tool gets a
fresh fleet and acts once:

- provisioner: ``provisioner sweep``, a whole fresh process (interpreter, imports, settings,
  clients), its clock at 21:00 in New York (``PROVISIONER_CLOCK``), under a nights policy that
  counts a silent machine as idle; its state a SQLite file, and with ``--database-url`` a fresh
  PostgreSQL schema too (a fresh fleet each);
- Cloud Custodian 0.9.53 (installed into its own venv on first use, /tmp/c7n-venv):
  ``custodian run`` of an ``offhour`` (opt-out, this UTC hour) + ``stop`` policy, with
  AWS_ENDPOINT_URL at the same proxy; it lists with the same tag filter (``tag:managed-by``).

Printed for each: EC2 requests by action, wall time, own time outside moto (wall minus the
time the proxy spent answering) and the process's CPU time. Both walls include the interpreter's
start-up; Custodian's alone is printed first (``custodian version``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import event as sa_event

from providers.base import TAG_MACHINE, TAG_MANAGED_BY, TAG_MANAGED_BY_VALUE, LaunchRequest
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.jobs import sweep
from provisioner.models import Event, Machine, new_id
from provisioner.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
C7N_VENV = Path("/tmp/c7n-venv")
C7N_VERSION = "0.9.53"
BERLIN_NIGHTS = """
name: nights
off_hours:
  timezone: Europe/Berlin
  windows: [{days: mon-fri, start: "20:00", end: "08:00"}]
idle: {gpu_util_below: 5, for_minutes: 30, unknown_counts_as_idle: true}
"""
NY_NIGHTS = BERLIN_NIGHTS.replace("Europe/Berlin", "America/New_York")
LAUNCH = datetime(2026, 11, 6, 7, 0, tzinfo=UTC)  # Friday morning
NOON_BERLIN = datetime(2026, 11, 6, 11, 0, tzinfo=UTC)
NIGHT_BERLIN = datetime(2026, 11, 6, 21, 0, tzinfo=UTC)
NIGHT_NY = datetime(2026, 11, 7, 2, 0, tzinfo=UTC)  # Friday 21:00 in New York


def record(app: App, rows: list[dict[str, Any]]) -> None:
    """State rows for launched machines, written in bulk (``up`` would measure ``up``)."""
    machines = [
        Machine(
            project="bench",
            owner="bench@example.com",
            status="running",
            spec={},
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


def write_transactions(app: App) -> list[int]:
    """A counter of the state database's transactions that wrote something."""
    count, dirty = [0], set()

    def wrote(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip()[:6].upper() in ("INSERT", "UPDATE", "DELETE"):
            dirty.add(id(conn))

    def committed(conn: Any) -> None:
        if id(conn) in dirty:
            dirty.discard(id(conn))
            count[0] += 1

    sa_event.listen(app.db.engine, "before_cursor_execute", wrote)
    sa_event.listen(app.db.engine, "commit", committed)
    return count


# --- sandbox -------------------------------------------------------------------------------


def run_sandbox(n: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        home = Path(d)
        (home / "policy.yaml").write_text(BERLIN_NIGHTS)
        settings = Settings(
            home=home,
            clouds={"sandbox": {"latency_seconds": 0, "retry_base_seconds": 0.001, "agent": False}},
            policies=[str(home / "policy.yaml")],
        )
        app = App(settings, ManualClock(LAUNCH))
        sandbox = app.provider("sandbox")
        t = time.perf_counter()
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
                    spot=False,
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
                    gpu="T4",
                    market="reserved",
                    instance_id=inst.id,
                    resource_name=inst.name,
                    public_ip=inst.public_ip,  # as `up` records it (else reconcile learns it)
                    rate=Decimal("0.15"),
                )
            )
        record(app, rows)
        print(f"sandbox: {n} machines seeded in {time.perf_counter() - t:.1f} s")
        writes = write_transactions(app)
        for at, label in ((NOON_BERLIN, "noon: nothing to do"), (NIGHT_BERLIN, "night: stop all")):
            app.clock.set(at)
            calls, before = sandbox.api_calls, writes[0]
            t = time.perf_counter()
            p = sweep.run(app)
            dt = time.perf_counter() - t
            done = sum(a.done for a in p.actions)
            print(
                f"  {n:6d} machines  {label:<22} {dt:7.2f} s   API calls "
                f"{sandbox.api_calls - calls:4d}   state write transactions "
                f"{writes[0] - before:4d}   stopped {done}"
            )
        app.close()


# --- AWS, side by side -----------------------------------------------------------------------


def seed_moto(emu: Any, n: int) -> list[dict[str, Any]]:
    """n running g4dn machines tagged as ours, one reservation each (as `up` makes them)."""
    ec2 = emu.client("ec2")
    ami = emu.ubuntu_ami("us-east-1")
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
                zone=emu.zone_id("us-east-1", inst["Placement"]["AvailabilityZone"]),
                instance_type="g4dn.xlarge",
                gpu="T4",
                market="reserved",
                instance_id=inst["InstanceId"],
                resource_name=f"m{i:05d}",
                public_ip=inst.get("PublicIpAddress"),  # as `up` records it
                rate=Decimal("0.526"),
            )
        )
    return rows


def stopped(emu: Any, rows: list[dict[str, Any]]) -> int:
    ids = {r["instance_id"] for r in rows}
    pages = emu.client("ec2").get_paginator("describe_instances").paginate()
    return sum(
        1
        for page in pages
        for r in page["Reservations"]
        for i in r["Instances"]
        if i["InstanceId"] in ids and i["State"]["Name"] in ("stopping", "stopped")
    )


def measure(emu: Any, act: Any) -> tuple[float, float, float, Counter[str]]:
    """Wall time, own time (wall minus moto's answering), the process's CPU, EC2 requests."""
    emu.wait_idle()
    before = len(emu.requests)
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    act()
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    emu.wait_idle()
    sent = emu.requests[before:]
    in_moto = sum(r.seconds for r in sent)
    used = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    return wall, wall - in_moto, used, Counter(r.action for r in sent if r.service == "ec2")


def provisioner_pass(emu: Any, home: Path, rows: list[dict[str, Any]], url: str | None) -> None:
    """``provisioner sweep`` as a user runs it: a whole fresh process (start-up included), its
    clock at 21:00 in New York (``PROVISIONER_CLOCK``, as the CLI tests fix an instant)."""
    (home / "policy.yaml").write_text(NY_NIGHTS)
    settings = Settings(
        home=home,
        state_url=url,
        policies=[str(home / "policy.yaml")],
        clouds={"aws": {"endpoint": emu.endpoint_url, "regions": ["us-east-1"]}},
    )
    app = App(settings, ManualClock(LAUNCH))
    record(app, rows)
    app.close()
    cfg = home / "settings.yaml"
    cfg.write_text(json.dumps(settings.model_dump(mode="json", exclude_defaults=True)))
    env = custodian_env(emu)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: modules load from bytecode
    env.update(PYTHONPATH=str(ROOT), PROVISIONER_CLOCK=NIGHT_NY.isoformat())
    cmd = [sys.executable, "-m", "provisioner", "-c", str(cfg), "sweep"]

    def act() -> None:
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"provisioner sweep failed:\n{done.stderr[-2000:]}")

    report(emu, "provisioner", rows, *measure(emu, act))


def ensure_custodian() -> Path:
    custodian = C7N_VENV / "bin" / "custodian"
    if not custodian.exists():
        print(f"installing c7n {C7N_VERSION} into {C7N_VENV} …")
        subprocess.run([sys.executable, "-m", "venv", str(C7N_VENV)], check=True)
        pip = [str(C7N_VENV / "bin" / "pip"), "install", "-q", f"c7n=={C7N_VERSION}"]
        subprocess.run(pip, check=True)
    return custodian


def custodian_env(emu: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ENDPOINT_URL=emu.endpoint_url,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE="/nonexistent/aws-config",
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent/aws-credentials",
    )
    return env


def custodian_pass(emu: Any, home: Path, rows: list[dict[str, Any]], url: str | None) -> None:
    custodian = ensure_custodian()
    policy = home / "custodian.yml"
    policy.write_text(
        f"""
policies:
  - name: offhours-stop
    resource: ec2
    query:
      - instance-state-name: running
      - "tag:{TAG_MANAGED_BY}": {TAG_MANAGED_BY_VALUE}
    filters:
      - type: offhour
        offhour: {datetime.now(UTC).hour}
        default_tz: utc
        opt-out: true
        weekends: false
    actions:
      - stop
"""
    )
    cmd = [str(custodian), "run", "-s", str(home / "out"), "--region", "us-east-1"]
    cmd += ["--cache-period", "0", str(policy)]  # its resource cache would outlive the fleet

    def act() -> None:
        done = subprocess.run(cmd, env=custodian_env(emu), capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"custodian failed:\n{done.stderr[-2000:]}")

    report(emu, "Cloud Custodian", rows, *measure(emu, act))


def report(
    emu: Any,
    tool: str,
    rows: list[dict[str, Any]],
    wall: float,
    own: float,
    cpu: float,
    n: Counter[str],
) -> None:
    acted = stopped(emu, rows)
    requests = ", ".join(f"{k} {v}" for k, v in sorted(n.items()))
    print(
        f"  {len(rows):5d} machines  {tool:<16} wall {wall:7.2f} s   own {own:6.2f} s   "
        f"CPU {cpu:5.2f} s   "
        f"EC2 requests {sum(n.values()):5d} ({requests})   stopped {acted}"
    )


def pg_schema(url: str, name: str) -> str:
    """A new, empty schema ``name`` in the database ``url`` names: the URL that uses it."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
        conn.execute(f"CREATE SCHEMA {name}")
    return f"{url}{'&' if '?' in url else '?'}options=-csearch_path%3D{name}"


def run_aws(sizes: list[int], database_url: str | None) -> None:
    from tests.emulators.aws import start_aws_emulator

    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    custodian = ensure_custodian()
    compile_ = [sys.executable, "-m", "compileall", "-q", "provisioner", "providers", "policies"]
    subprocess.run(compile_, cwd=ROOT, check=True)  # bytecode, as an install has
    emu = start_aws_emulator()
    try:
        t = time.perf_counter()
        subprocess.run([str(custodian), "version"], env=custodian_env(emu), capture_output=True)
        print(f"aws (moto): `custodian version` takes {time.perf_counter() - t:.2f} s (start-up)")
        states = [None] + ([database_url] if database_url else [])
        for n in sizes:
            for url in states:
                print(f"  provisioner's state: {'PostgreSQL' if url else 'SQLite file (WAL)'}")
                for tool in (provisioner_pass, custodian_pass):
                    emu.reset()
                    rows = seed_moto(emu, n)
                    with tempfile.TemporaryDirectory() as d:
                        state = url and pg_schema(url, f"bench_sweep_{n}")
                        tool(emu, Path(d), rows, state)
    finally:
        emu.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandbox", type=int, nargs="*", help="machines (default 500 5000)")
    ap.add_argument("--aws", type=int, nargs="*", help="machines (default 100 1000)")
    ap.add_argument("--database-url", help="provisioner's state on PostgreSQL too (moto part)")
    args = ap.parse_args()
    both = args.sandbox is None and args.aws is None
    print(
        f"python {platform.python_version()} on {platform.machine()}, "
        f"{platform.system()} {platform.release()}; nproc {os.cpu_count()}; "
        f"load {os.getloadavg()[0]:.2f}"
    )
    if args.sandbox is not None or both:
        for n in args.sandbox or [500, 5000]:
            run_sandbox(n)
    if args.aws is not None or both:
        run_aws(args.aws or [100, 1000], args.database_url)


if __name__ == "__main__":
    main()
