"""The sweep against the AWS adapter and its wire-level emulator (moto + fault layer): idle
machines out of hours are stopped with one StopInstances per 1,000, busy ones kept, and the pass
reads the cloud with DescribeInstances list calls — never one call per machine."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from provisioner import catalog, machines, startup
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.jobs import sweep
from provisioner.models import Heartbeat
from provisioner.spec import Experiment
from tests.conftest import make_settings, sandbox_experiment
from tests.contract.aws import clean_emulator
from tests.emulators.aws import AwsEmulator

POLICY = """
name: nights
off_hours: {timezone: America/New_York, windows: [{days: mon-fri, start: "20:00", end: "08:00"}]}
idle: {gpu_util_below: 5, for_minutes: 30}
"""


@pytest.fixture
def emu(monkeypatch: pytest.MonkeyPatch) -> Iterator[AwsEmulator]:
    """The worker's moto + proxy, emptied, with fake credentials (tests/contract/aws.py)."""
    with clean_emulator(monkeypatch) as e:
        yield e


@pytest.mark.parametrize(
    ("market", "verb", "after"),
    [
        ("reserved", "Stop", ("stopping", "stopped")),
        ("spot", "Terminate", ("shutting-down", "terminated")),
    ],
)
def test_sweep_stops_idle_aws_machines_with_list_calls_only(
    emu, home: Path, tmp_path, market, verb, after
):
    """Idle machines are stopped; an idle AWS spot machine, which EC2 cannot stop (one-time
    request), is terminated, saying why."""
    (tmp_path / "p.yaml").write_text(POLICY)
    options = {"endpoint": emu.endpoint_url, "retry_base_seconds": 0.001}
    clock = ManualClock(datetime(2026, 11, 6, 17, 0, tzinfo=UTC))  # Friday 12:00 in New York
    app = App(
        make_settings(home, clouds={"aws": options}, policies=[str(tmp_path / "p.yaml")]), clock
    )
    try:
        catalog.refresh(app.settings, "aws", app.provider("aws").fetch_offers())
        launched = {}
        for name in ("idle-a", "idle-b", "busy-c"):
            spec = sandbox_experiment(name, gpu="T4:1", market=market, clouds=["aws"])
            launched[name] = machines.up(app, Experiment.model_validate(spec)).machine
            startup.issue_token(app, launched[name].id)
        machines.reconcile(app)  # launched "pending"; seen running from now on
        clock.set(datetime(2026, 11, 7, 2, 0, tzinfo=UTC))  # Friday 21:00 in New York

        def beats() -> None:
            with app.db.session() as s:
                for name, m in launched.items():
                    util = 90.0 if name.startswith("busy") else 0.5
                    for k in range(0, 45, 5):
                        s.add(
                            Heartbeat(
                                machine_id=m.id,
                                at=clock.now() - timedelta(minutes=k),
                                gpus=[{"index": 0, "util": util}],
                                max_util=util,
                            )
                        )

        beats()
        if market == "spot":  # a terminate that loses the disk: the owner is warned first
            emu.wait_idle()
            before = len(emu.requests)
            warned = sweep.run(app)
            emu.wait_idle()
            assert {r.action for r in emu.requests[before:]} == {"DescribeInstances"}
            assert sorted((a.machine, a.action) for a in warned.actions) == [
                ("idle-a", "warn"),
                ("idle-b", "warn"),
            ]
            clock.advance(timedelta(minutes=sweep.UNSTOPPABLE_WARN_MINUTES))
            beats()
        emu.wait_idle()
        before = len(emu.requests)
        p = sweep.run(app)
        emu.wait_idle()
        sent = [
            (r.action, sorted(v for k, v in r.params.items() if k.startswith("InstanceId.")))
            for r in emu.requests[before:]
        ]
    finally:
        app.close()
    action = verb.lower()
    assert sorted((a.machine, a.action, a.done) for a in p.actions) == [
        ("idle-a", action, True),
        ("idle-b", action, True),
    ]
    why = "spot machine on aws cannot be stopped: terminated with its boot disk"
    assert all((why in a.why) == (market == "spot") for a in p.actions)
    idle_ids = {launched["idle-a"].instance_id, launched["idle-b"].instance_id}
    # one list call for the region, by our tag, then one call acting on the idle machines
    # together — no lookup per machine, and nothing sent about the busy one
    assert sent == [("DescribeInstances", []), (f"{verb}Instances", sorted(idle_ids))]
    states = {
        i["InstanceId"]: i["State"]["Name"]
        for region in {m.region for m in launched.values()}
        for r in emu.client("ec2", region).describe_instances()["Reservations"]
        for i in r["Instances"]
    }
    assert states[launched["busy-c"].instance_id] == "running"
    assert states[launched["idle-a"].instance_id] in after


NIGHTS_UNKNOWN_IDLE = """
name: nights
off_hours: {timezone: America/New_York, windows: [{days: mon-fri, start: "20:00", end: "08:00"}]}
idle: {gpu_util_below: 5, for_minutes: 30, unknown_counts_as_idle: true}
"""


@pytest.mark.slow  # end to end on moto: README command and CI, not the quick loop
def test_first_real_run_through_the_cli_leaves_nothing_billed(emu, home: Path, tmp_path):
    """`up`, a preemption, the sweep's recovery, a night's idle stop and `down`, each through
    the real CLI against the AWS emulator; then the emulator's own books: no open spot
    request, no billed instance, every machine reachable (our SSH group, IMDSv2 only)."""
    import json
    import re

    from tests.conftest import run_cli, write_settings, write_yaml

    emu.reset()  # the books this test reads are its own
    (tmp_path / "p.yaml").write_text(NIGHTS_UNKNOWN_IDLE)
    aws = {"endpoint": emu.endpoint_url, "regions": ["us-east-1"], "retry_base_seconds": 0.001}
    cfg = write_settings(home, clouds={"aws": aws}, policies=[str(tmp_path / "p.yaml")])
    spec = write_yaml(
        tmp_path / "train.yaml", sandbox_experiment("train", gpu="T4:1", clouds=["aws"])
    )
    noon = datetime(2026, 11, 6, 17, 0, tzinfo=UTC)  # Friday 12:00 in New York

    def cli(*args: str, at: datetime) -> dict:
        r = run_cli("--config", str(cfg), *args, "-o", "json", now=at)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    # machines launched through the CLI must not be waited for: moto's public addresses are
    # not ours to connect to, and no test reaches past loopback
    r = run_cli("--config", str(cfg), "up", str(spec), "--no-wait", now=noon)
    assert r.returncode == 0, r.stderr
    said = " ".join(r.stdout.split())  # `up` says what an idle stop will do to it
    assert (
        "a spot machine on aws cannot be stopped: an out-of-hours idle stop terminates it and "
        "its boot disk, not its volumes (the owner is warned 15 minutes before)"
    ) in said
    assert "provisioner stop" not in said
    [instance_id] = re.findall(r"instance (i-[0-9a-f]+)", said)
    emu.preempt(instance_id, action="terminate")
    swept = cli("sweep", at=noon + timedelta(minutes=5))
    [relaunch] = [a for p in swept["passes"] for a in p["actions"]]
    assert (relaunch["action"], relaunch["done"]) == ("relaunch", True)
    night = datetime(2026, 11, 7, 2, 0, tzinfo=UTC)  # Friday 21:00 in New York, no heartbeat
    swept = cli("sweep", at=night)
    [warn] = [a for p in swept["passes"] for a in p["actions"]]
    assert warn["action"] == "warn" and "terminate at 02:15 UTC" in warn["why"]
    swept = cli("sweep", at=night + timedelta(minutes=16))  # the CLI's clock ticks on
    [stop] = [a for p in swept["passes"] for a in p["actions"]]
    why = "spot machine on aws cannot be stopped: terminated with its boot disk"
    assert stop["action"] == "terminate" and why in stop["why"]
    cli("down", "train", at=night + timedelta(minutes=17))

    assert emu.billed_instances("us-east-1") == []
    assert emu.open_spot_requests() == []
    launches = emu.run_instances_requests
    assert len(launches) == 2  # the first machine and its replacement, nothing more
    for wire in launches:
        assert wire["InstanceMarketOptions.SpotOptions.SpotInstanceType"] == "one-time"
        assert wire["MetadataOptions.HttpTokens"] == "required"
        [group] = emu.client("ec2").describe_security_groups(GroupIds=[wire["SecurityGroupId.1"]])[
            "SecurityGroups"
        ]
        assert any(p.get("FromPort") == 22 for p in group["IpPermissions"])


@pytest.mark.slow  # end to end on moto: README command and CI, not the quick loop
def test_status_over_aws_asks_once_and_needs_no_orm_while_aws_agrees(emu, home: Path, tmp_path):
    """`status` asks AWS first (one DescribeInstances for the region). The first one records
    the launch's boot (the Typer app reconciles and writes); once AWS lists every machine as
    recorded, `status` is read with plain SQL — no SQLAlchemy, no Typer — and says the same.
    A machine AWS took back goes the full way again, and is recorded."""
    import json

    from tests.conftest import run_cli, write_settings, write_yaml
    from tests.test_cli import modules_loaded_by

    aws = {"endpoint": emu.endpoint_url, "regions": ["us-east-1"], "retry_base_seconds": 0.001}
    cfg = write_settings(home, clouds={"aws": aws})
    spec = write_yaml(tmp_path / "t.yaml", sandbox_experiment("train", gpu="T4:1", clouds=["aws"]))
    noon = datetime(2026, 11, 6, 17, 0, tzinfo=UTC)

    def status(at: datetime, asks: int) -> list[dict]:
        before = len(emu.requests)
        r = run_cli("--config", str(cfg), "status", "-o", "json", now=at)
        assert r.returncode == 0, r.stderr
        # the adapter's list call (and its zone names, once per process)
        assert [q.action for q in emu.requests[before:]] == [
            "DescribeInstances",
            "DescribeAvailabilityZones",
        ] * asks
        return list(json.loads(r.stdout))

    up = run_cli("--config", str(cfg), "up", str(spec), "--no-wait", "-o", "json", now=noon)
    assert up.returncode == 0, up.stderr
    # booted since: the quick read sees it moved, the Typer app asks again and writes it
    [machine] = status(noon, asks=2)
    assert machine["status"] == "running"
    heavy = ("sqlalchemy", "typer", "click", "provisioner.models", "boto3")
    loaded = modules_loaded_by("--config", str(cfg), "status", prefixes=heavy)
    assert loaded and {m.split(".")[0] for m in loaded} == {"boto3"}
    [again] = status(noon + timedelta(minutes=1), asks=1)
    assert {k: v for k, v in again.items() if k != "spent"} == {
        k: v for k, v in machine.items() if k != "spent"
    }
    emu.preempt(machine["instance_id"], action="terminate")
    assert "provisioner.models" in modules_loaded_by("--config", str(cfg), "status", prefixes=heavy)
    listed = json.loads(run_cli("--config", str(cfg), "status", "-a", "-o", "json").stdout)
    assert [m["status"] for m in listed] == ["preempted"]


def _fleet(app: App, emu: AwsEmulator, region: str, reservations: int, size: int) -> list[str]:
    """``reservations`` × ``size`` running g4dn machines of ours in moto, recorded in the state
    as `up` would have (rows written in bulk: `up` 1,200 times would test `up`)."""
    from decimal import Decimal

    from providers.base import TAG_MANAGED_BY, TAG_MANAGED_BY_VALUE
    from provisioner.models import Event, Machine, new_id

    ec2 = emu.client("ec2", region)
    tags = [{"Key": TAG_MANAGED_BY, "Value": TAG_MANAGED_BY_VALUE}]
    now = app.clock.now()
    rows = []
    for _ in range(reservations):
        made = ec2.run_instances(
            ImageId=emu.ubuntu_ami(region),
            InstanceType="g4dn.xlarge",
            MinCount=size,
            MaxCount=size,
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
        )["Instances"]
        for inst in made:
            iid = inst["InstanceId"]
            rows.append(
                Machine(
                    id=new_id(),
                    name=f"m-{iid}",
                    project="fleet",
                    owner="ana@example.com",
                    status="running",
                    spec={},
                    cloud="aws",
                    region=region,
                    zone=emu.zone_id(region, inst["Placement"]["AvailabilityZone"]),
                    instance_type="g4dn.xlarge",
                    gpu="T4",
                    gpu_count=1,
                    market="reserved",
                    instance_id=iid,
                    resource_name=iid,
                    rate=Decimal("0.526"),
                    currency="USD",
                    created_at=now,
                    launched_at=now,
                )
            )
    with app.db.session() as s:
        s.add_all(rows)
        s.flush()
        s.add_all(Event(machine_id=m.id, at=now, kind="launched", detail={}) for m in rows)
    return [m.instance_id or "" for m in rows]


def states(emu: AwsEmulator, region: str) -> dict[str, str]:
    """Every instance's state in moto's own books (one paginated read)."""
    pages = emu.client("ec2", region).get_paginator("describe_instances").paginate()
    return {
        i["InstanceId"]: i["State"]["Name"]
        for page in pages
        for r in page["Reservations"]
        for i in r["Instances"]
    }


def _fleet_app(emu: AwsEmulator, home: Path, tmp_path: Path, regions: list[str], **aws) -> App:
    (tmp_path / "p.yaml").write_text(NIGHTS_UNKNOWN_IDLE)
    options = {"endpoint": emu.endpoint_url, "regions": regions, "retry_base_seconds": 0.001}
    settings = make_settings(
        home, clouds={"aws": {**options, **aws}}, policies=[str(tmp_path / "p.yaml")]
    )
    return App(settings, ManualClock(datetime(2026, 11, 6, 13, 0, tzinfo=UTC)))  # 08:00 NY


@pytest.mark.slow  # end to end on moto: README command and CI, not the quick loop
def test_a_night_sweep_over_1200_machines_makes_pages_plus_one_stop_per_1000(
    emu, home: Path, tmp_path
):
    """1,200 idle machines in one region: the pass lists them in pages and stops them with
    two StopInstances calls (1,000 ids, then 200) — O(pages + N/1000) requests, no describe
    or stop per machine."""
    emu.reset()
    app = _fleet_app(emu, home, tmp_path, ["us-east-1"])
    try:
        ids = _fleet(app, emu, "us-east-1", reservations=12, size=100)
        emu.faults.cap_page_size(5)  # 12 reservations: pages of 5, 5 and 2
        app.clock.set(datetime(2026, 11, 7, 2, 0, tzinfo=UTC))  # Friday 21:00 in New York
        emu.wait_idle()
        before = len(emu.requests)
        p = sweep.run(app)
        emu.wait_idle()
        sent = emu.requests[before:]
    finally:
        app.close()
    assert sum(a.done for a in p.actions) == len(ids) == 1200
    counts = Counter(r.action for r in sent)
    # the zone names → ids map is read once per adapter
    assert counts == {"DescribeInstances": 3, "DescribeAvailabilityZones": 1, "StopInstances": 2}
    stops = [sorted(v for k, v in r.params.items() if k.startswith("InstanceId.")) for r in sent]
    stops = [s for s, r in zip(stops, sent, strict=True) if r.action == "StopInstances"]
    assert sorted(len(s) for s in stops) == [200, 1000]
    assert sorted(stops[0] + stops[1]) == sorted(ids)
    assert {r.answer for r in sent} == {"forwarded"}  # moto carried out every call
    sample = ids[:3] + ids[997:1003] + ids[-3:]  # both calls' machines, read back from moto
    described = emu.client("ec2").describe_instances(InstanceIds=sample)["Reservations"]
    assert {i["State"]["Name"] for r in described for i in r["Instances"]} == {"stopped"}


def test_a_failed_batch_is_recorded_per_machine_and_retried_next_pass(emu, home: Path, tmp_path):
    """Two regions; one region's StopInstances is refused past the retry bound: its machines
    carry the error, the other region's are stopped in the same pass, and the next pass stops
    the rest."""
    emu.reset()
    app = _fleet_app(emu, home, tmp_path, ["us-east-1", "us-west-2"], retry_attempts=2)
    try:
        east = _fleet(app, emu, "us-east-1", reservations=1, size=3)
        west = _fleet(app, emu, "us-west-2", reservations=1, size=2)
        app.clock.set(datetime(2026, 11, 7, 2, 0, tzinfo=UTC))
        emu.faults.throttle(2, action="StopInstances")  # the first batch call, both attempts
        first = sweep.run(app)
        app.clock.advance(timedelta(minutes=5))
        second = sweep.run(app)
    finally:
        app.close()
    failed = {a.machine for a in first.actions if a.error}
    stopped = {a.machine for a in first.actions if a.done}
    by_region = {frozenset(f"m-{i}" for i in east), frozenset(f"m-{i}" for i in west)}
    assert {frozenset(failed), frozenset(stopped)} == by_region  # one region each
    assert all("RequestLimitExceeded" in (a.error or "") for a in first.actions if a.error)
    assert {a.machine for a in second.actions if a.done} == failed
    assert not any(a.error for a in second.actions)
    assert states(emu, "us-east-1") == dict.fromkeys(east, "stopped")
    assert states(emu, "us-west-2") == dict.fromkeys(west, "stopped")


@pytest.mark.slow  # end to end on moto: README command and CI, not the quick loop
def test_a_page_that_fails_is_asked_again_not_the_whole_listing(emu, home: Path, tmp_path):
    """The listing's second page is throttled once: that page is asked again, and the first is
    not read twice (3 pages, 4 DescribeInstances; restarting the listing would make 5)."""
    emu.reset()
    app = _fleet_app(emu, home, tmp_path, ["us-east-1"])
    try:
        ids = _fleet(app, emu, "us-east-1", reservations=12, size=10)
        emu.faults.cap_page_size(5)
        emu.faults.throttle(1, action="DescribeInstances", skip=1)
        emu.wait_idle()
        before = len(emu.requests)
        listed = app.provider("aws").list_managed(["us-east-1"])
        emu.wait_idle()
        sent = [r for r in emu.requests[before:] if r.action == "DescribeInstances"]
    finally:
        app.close()
    assert sorted(i.id for i in listed) == sorted(ids)
    assert [r.answer for r in sent] == [
        "forwarded",
        "RequestLimitExceeded",
        "forwarded",
        "forwarded",
    ]
    tokens = [r.params.get("NextToken") for r in sent]
    assert tokens[0] is None and tokens[1] == tokens[2] is not None  # the same page again
