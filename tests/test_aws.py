"""The AWS adapter, unmodified boto3 against moto in server mode behind the fault-injecting proxy
(tests/emulators/aws.py). Zones are AZ ids, as in the catalog; moto maps us-east-1a → use1-az6,
us-east-1b → use1-az1, us-east-1c → use1-az2, us-east-1d → use1-az4."""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import boto3
import pytest
import yaml
from botocore.exceptions import ClientError

from providers.aws.adapter import AWSProvider
from providers.aws.prices import GPU_TYPES
from providers.base import (
    TAG_MACHINE,
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    TAG_OWNER,
    TAG_PROJECT,
    CapacityError,
    InvalidRequest,
    LaunchRequest,
    MachineState,
    QuotaError,
)
from providers.userdata import decoded, parts
from provisioner import catalog, machines, planning
from provisioner.app import App
from provisioner.spec import Experiment
from tests.conftest import make_settings, sandbox_experiment
from tests.contract.aws import clean_emulator, make_provider
from tests.emulators.aws import DLAMI_PARAMETER, SPOT_INTERRUPTION, AwsEmulator

ROOT = Path(__file__).resolve().parent.parent
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBmJ0tMlHkP1d1Lq8n1xj6pG1m9cQv0d0uKc0d8gYQ3h ana@laptop"
SCRIPT = "#!/bin/bash\necho training > /tmp/started\n"


@pytest.fixture
def emu(monkeypatch: pytest.MonkeyPatch) -> Iterator[AwsEmulator]:
    """The run's shared emulator, emptied, with fake credentials (tests/contract/aws.py)."""
    with clean_emulator(monkeypatch) as emulator:
        yield emulator


def make(emu: AwsEmulator, **options: object) -> AWSProvider:
    return make_provider(emu, **options)


def req(
    token: str = "tok-1", zone: str = "use1-az6", itype: str = "g4dn.xlarge", **kw
) -> LaunchRequest:
    region = {"use1": "us-east-1", "usw2": "us-west-2"}.get(zone.split("-")[0], zone[:-1])
    gpu, count = GPU_TYPES[itype]
    fields: dict = {
        "name": f"exp-{token}",
        "token": token,
        "region": region,
        "zone": zone,
        "instance_type": itype,
        "gpu": gpu,
        "gpu_count": count,
        "spot": False,
        "disk_gb": 200,
        "user_data": SCRIPT,
        "ssh_public_key": KEY,
        "labels": {
            TAG_MANAGED_BY: TAG_MANAGED_BY_VALUE,
            TAG_MACHINE: f"m-{token}",
            TAG_PROJECT: "vision",
            TAG_OWNER: "ana-example-com",
        },
    }
    fields.update(kw)
    return LaunchRequest(**fields)


def wire_tags(params: dict[str, str], resource: str) -> dict[str, str]:
    """The tags sent for ``resource`` in a RunInstances request's TagSpecification.N."""
    n = next(
        k.split(".")[1] for k, v in params.items() if k.endswith(".ResourceType") and v == resource
    )
    prefix = f"TagSpecification.{n}.Tag."
    keys = {k[len(prefix) :].split(".")[0]: v for k, v in params.items() if k.startswith(prefix)}
    return {
        params[f"{prefix}{i}.Key"]: params[f"{prefix}{i}.Value"]
        for i in {k.split(".")[0] for k in keys}
    }


def moto_instances(emu: AwsEmulator, region: str = "us-east-1") -> list[dict]:
    pages = emu.client("ec2", region).get_paginator("describe_instances").paginate()
    return [i for page in pages for r in page["Reservations"] for i in r["Instances"]]


def test_import_loads_no_sdk() -> None:
    code = (
        "import sys, providers, providers.aws; providers.provider_class('aws');"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('boto3', 'botocore', 's3transfer', 'moto')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


FAMILIES = [("p4d.24xlarge", "A100"), ("p5.48xlarge", "H100"), ("g4dn.xlarge", "T4")]
MARKETS = ["on-demand", "spot-terminate", "spot-stop"]


@pytest.mark.parametrize("market", MARKETS)
@pytest.mark.parametrize(("itype", "gpu"), FAMILIES)
def test_launch_sends_market_tags_token_and_user_data(
    emu: AwsEmulator, itype: str, gpu: str, market: str
) -> None:
    spot = market != "on-demand"
    extra = {"preemption_action": market.removeprefix("spot-")} if spot else {}
    if market == "spot-stop":
        extra["max_price"] = Decimal("12.5")
    request = req("tok-a", "use1-az1", itype, spot=spot, **extra)

    inst = make(emu).launch(request)

    [wire] = emu.run_instances_requests
    assert wire["InstanceType"] == itype
    assert wire["Placement.AvailabilityZone"] == "us-east-1b"  # use1-az1 in this account
    assert wire["ClientToken"] == "tok-a"
    assert (wire["MinCount"], wire["MaxCount"]) == ("1", "1")
    assert wire["ImageId"] == emu.ubuntu_ami("us-east-1")  # the default GPU image parameter
    assert wire["BlockDeviceMapping.1.DeviceName"] == "/dev/sda1"
    assert wire["BlockDeviceMapping.1.Ebs.VolumeSize"] == "200"
    assert wire["BlockDeviceMapping.1.Ebs.VolumeType"] == "gp3"
    for resource in ("instance", "volume", "network-interface"):
        tags = wire_tags(wire, resource)
        assert tags.items() >= {**request.labels, "Name": "exp-tok-a"}.items()
    # the network interface carries the machine's tag, so Cost Explorer attributes its public
    # IPv4 address (billed to the ENI) to the machine
    ec2 = emu.client("ec2", "us-east-1")
    machine = [{"Name": f"tag:{TAG_MACHINE}", "Values": [request.labels[TAG_MACHINE]]}]
    enis = ec2.describe_network_interfaces(Filters=machine)["NetworkInterfaces"]
    assert [e["Attachment"]["InstanceId"] for e in enis] == [inst.ref.id]
    market_options = {k: v for k, v in wire.items() if k.startswith("InstanceMarketOptions.")}
    spot_options = "InstanceMarketOptions.SpotOptions."
    if market == "on-demand":
        assert market_options == {}
    elif market == "spot-terminate":
        assert market_options == {
            "InstanceMarketOptions.MarketType": "spot",
            spot_options + "SpotInstanceType": "one-time",
            spot_options + "InstanceInterruptionBehavior": "terminate",
        }
    else:  # asked to stop on preemption: still one-time + terminate (a persistent request
        # would relaunch after `down`); AWS spot machines are not stoppable (SPEC.capabilities)
        assert market_options == {
            "InstanceMarketOptions.MarketType": "spot",
            spot_options + "SpotInstanceType": "one-time",
            spot_options + "InstanceInterruptionBehavior": "terminate",
            spot_options + "MaxPrice": "12.5",
        }
    # gzip-compressed cloud-init: our #cloud-config, then the script as a part of its own
    (kind, text), script = parts(decoded(base64.b64decode(wire["UserData"])))
    assert kind == "cloud-config" and text.startswith("#cloud-config\n")
    config = yaml.safe_load(text)
    # the key goes to our one SSH user, which cloud-init makes, not to the image's own
    assert config["users"][1]["name"] == "provisioner"
    assert config["users"][1]["ssh_authorized_keys"] == [KEY]
    assert script == ("x-shellscript", SCRIPT)

    assert (inst.instance_type, inst.zone, inst.region) == (itype, "use1-az1", "us-east-1")
    assert inst.spot is spot and inst.name == "exp-tok-a"
    assert inst.labels == request.labels
    assert inst.state in (MachineState.PENDING, MachineState.RUNNING)
    assert make(emu).get(inst.ref).spot is spot


@pytest.mark.parametrize(
    ("script", "key", "expected"),
    [
        (SCRIPT, None, SCRIPT),
        (None, KEY, None),  # a cloud-config making the provisioner user: checked below
        (None, None, None),
    ],
)
def test_user_data_is_the_script_alone_or_the_key_alone(
    emu: AwsEmulator, script: str | None, key: str | None, expected: str | None
) -> None:
    make(emu).launch(req(user_data=script, ssh_public_key=key))
    [wire] = emu.run_instances_requests
    sent = decoded(base64.b64decode(wire["UserData"])) if "UserData" in wire else None
    if key and not script:
        config = yaml.safe_load(sent or "")
        assert config["users"][1]["ssh_authorized_keys"] == [KEY]
        return
    assert sent == expected


def test_zone_name_is_accepted_and_reported_as_az_id(emu: AwsEmulator) -> None:
    inst = make(emu).launch(req(zone="us-east-1c"))
    assert emu.run_instances_requests[0]["Placement.AvailabilityZone"] == "us-east-1c"
    assert inst.zone == "use1-az2"
    with pytest.raises(InvalidRequest, match="no zone"):
        make(emu).launch(req("tok-2", zone="use1-az99"))


def test_image_from_settings_wins_and_a_missing_default_is_a_clear_error(
    emu: AwsEmulator,
) -> None:
    ami = emu.ubuntu_ami("us-east-1")
    make(emu, images={"us-east-1": ami}).launch(req())
    assert emu.run_instances_requests[0]["ImageId"] == ami
    assert emu.calls("GetParameter", service="ssm") == []

    emu.public_parameters.pop(DLAMI_PARAMETER)
    with pytest.raises(InvalidRequest, match=r"images: \{us-east-1: ami-") as err:
        make(emu).launch(req("tok-2"))
    assert err.value.code == "ParameterNotFound"
    assert emu.calls("GetParameter", service="ssm")[0].params["Name"] == DLAMI_PARAMETER

    with pytest.raises(InvalidRequest) as err:
        make(emu, image="ami-00000000").launch(req("tok-3"))
    assert err.value.code == "InvalidAMIID.NotFound"
    assert len(emu.run_instances_requests) == 1  # neither bad launch reached RunInstances


def test_the_same_token_with_other_parameters_is_refused(emu: AwsEmulator) -> None:
    first = make(emu).launch(req())
    with pytest.raises(InvalidRequest) as err:
        make(emu).launch(req(itype="g4dn.2xlarge"))
    assert err.value.code == "IdempotentParameterMismatch"
    assert [i["InstanceId"] for i in moto_instances(emu)] == [first.id]


def test_a_lost_run_instances_answer_is_found_by_its_token_tag(emu: AwsEmulator) -> None:
    """The retry finds the machine by the token tag it was launched with (a DescribeInstances
    filter) instead of sending RunInstances again."""
    emu.faults.drop_response("RunInstances")
    inst = make(emu).launch(req())
    assert [c.answer for c in emu.calls("RunInstances")] == ["dropped"]
    lookups = [c.params for c in emu.calls("DescribeInstances") if "tok-1" in c.params.values()]
    assert len(lookups) == 2  # before the first RunInstances, and on the retry
    assert lookups[0]["Filter.1.Name"] == "tag:provisioner-token"
    assert [i["InstanceId"] for i in moto_instances(emu)] == [inst.id]


def test_late_response_and_retry_make_one_machine(emu: AwsEmulator) -> None:
    """The first RunInstances is answered after the client gave up; the retry (same token)
    launches; the late one then replays the same reservation instead of a second machine."""
    emu.faults.slow(1.5, action="RunInstances")
    inst = make(emu, timeout_seconds=0.3).launch(req())
    emu.wait_idle()
    calls = emu.calls("RunInstances")
    assert {c.params["ClientToken"] for c in calls} == {"tok-1"}
    assert sorted(c.answer for c in calls) == ["forwarded", "replayed"]
    assert [i["InstanceId"] for i in moto_instances(emu)] == [inst.id]


def test_emulator_honours_client_token_and_checks_spot_options(emu: AwsEmulator) -> None:
    ec2 = boto3.client("ec2", endpoint_url=emu.endpoint_url, region_name="us-east-1")
    ami = emu.ubuntu_ami("us-east-1")
    args = {"ImageId": ami, "InstanceType": "g4dn.xlarge", "MinCount": 1, "MaxCount": 1}
    one = ec2.run_instances(ClientToken="t", **args)["Instances"][0]["InstanceId"]
    two = ec2.run_instances(ClientToken="t", **args)["Instances"][0]["InstanceId"]
    assert one == two and len(moto_instances(emu)) == 1
    with pytest.raises(ClientError, match="IdempotentParameterMismatch"):
        ec2.run_instances(ClientToken="t", **{**args, "InstanceType": "g4dn.2xlarge"})
    bad_spot = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "stop"}
    with pytest.raises(ClientError, match="InvalidParameterCombination"):
        ec2.run_instances(
            InstanceMarketOptions={"MarketType": "spot", "SpotOptions": bad_spot}, **args
        )


@pytest.mark.parametrize(
    "code", ["InsufficientInstanceCapacity", "InsufficientCapacity", "Unsupported"]
)
def test_capacity_error_in_a_zone(emu: AwsEmulator, code: str) -> None:
    emu.faults.no_capacity("use1-az6", code=code)
    provider = make(emu)
    with pytest.raises(CapacityError) as err:
        provider.launch(req(itype="p4d.24xlarge", spot=True))
    assert err.value.code == code and code in str(err.value)
    assert len(emu.run_instances_requests) == 1  # not mistaken for a transient 5xx
    assert provider.launch(req("tok-2", "use1-az1", "p4d.24xlarge", spot=True)).zone == "use1-az1"


@pytest.mark.parametrize(
    "code", ["VcpuLimitExceeded", "InstanceLimitExceeded", "MaxSpotInstanceCountExceeded"]
)
def test_quota_error_blocks_the_region(emu: AwsEmulator, code: str) -> None:
    emu.faults.quota_exceeded("us-east-1", code)
    with pytest.raises(QuotaError) as err:
        make(emu).launch(req(itype="p5.48xlarge", spot=True))
    assert (err.value.code, err.value.scope) == (code, "region")
    assert moto_instances(emu) == []


def test_preemption_and_user_stop_are_read_from_the_state_reason_code(emu: AwsEmulator) -> None:
    provider = make(emu)
    taken = provider.launch(req("tok-1", spot=True))
    stopped = provider.launch(req("tok-2"))
    emu.preempt(taken.id, action="terminate")
    provider.stop(stopped.ref)
    got = provider.get(taken.ref)
    assert got.state is MachineState.PREEMPTED
    assert got.state_reason and got.state_reason.startswith(SPOT_INTERRUPTION["terminate"][0])
    got = provider.get(stopped.ref)
    assert got.state is MachineState.STOPPED
    assert "Client.UserInitiatedShutdown" in (got.state_reason or "")


def test_a_spot_machine_cannot_be_stopped_and_a_preempted_one_is_gone(emu: AwsEmulator) -> None:
    """One-time spot: EC2 refuses to stop it, and takes it back by terminating it."""
    provider = make(emu)
    spot = provider.launch(req("tok-1", spot=True, preemption_action="stop"))
    with pytest.raises(InvalidRequest) as refused:
        provider.stop(spot.ref)
    assert refused.value.code == "UnsupportedOperation"
    emu.preempt(spot.id, action="terminate")
    with pytest.raises(InvalidRequest):
        provider.start(spot.ref)
    assert provider.get(spot.ref).state is MachineState.PREEMPTED


def test_the_emulator_bills_what_a_persistent_request_relaunches(emu: AwsEmulator) -> None:
    """The control for the leak tests: had the adapter sent a persistent request, terminating
    its instance would make EC2 launch another, billed, until the request is cancelled — and
    an interrupted-stopped one would start again when capacity returns."""
    ec2 = boto3.client("ec2", endpoint_url=emu.endpoint_url, region_name="us-east-1")
    persistent = {
        "MarketType": "spot",
        "SpotOptions": {"SpotInstanceType": "persistent", "InstanceInterruptionBehavior": "stop"},
    }
    ami = emu.ubuntu_ami("us-east-1")

    def launch() -> str:
        out = ec2.run_instances(
            ImageId=ami, InstanceType="g4dn.xlarge", MinCount=1, MaxCount=1,
            InstanceMarketOptions=persistent,
        )  # fmt: skip
        return str(out["Instances"][0]["InstanceId"])

    first = launch()
    ec2.terminate_instances(InstanceIds=[first])
    [request] = emu.open_spot_requests()
    assert request.instance_id != first and emu.billed_instances() == [request.instance_id]
    emu.preempt(request.instance_id, action="stop")
    assert emu.restore_capacity() == [request.instance_id]  # started again by EC2
    ec2.cancel_spot_instance_requests(SpotInstanceRequestIds=[request.id])
    ec2.terminate_instances(InstanceIds=[request.instance_id])
    assert emu.open_spot_requests() == [] and emu.billed_instances() == []


def test_spot_up_preemption_recovery_and_down_leave_nothing_billed(
    emu: AwsEmulator, home: Path, clock
) -> None:
    """The first real run, on the emulator's own books: a spot machine is taken back, the
    scheduler relaunches it, the user downs it — no open spot request, no billed instance."""
    from provisioner.jobs import recover

    app, experiment = aws_app(emu, home, clock)
    try:
        first = machines.up(app, experiment).machine
        emu.preempt(first.instance_id, first.region, action="terminate")
        emu.restore_capacity()  # a persistent request would come back here
        machines.reconcile(app)
        done = recover.run(app)
        assert [(a.action, a.done) for a in done.actions] == [("relaunch", True)]
        assert emu.calls("StartInstances") == []  # EC2 keeps no one-time spot: no start tried
        second = machines.find(app, "train")
        assert second.instance_id != first.instance_id
        assert emu.billed_instances(second.region) == [second.instance_id]
        machines.down(app, "train")
        emu.restore_capacity()
    finally:
        app.close()
    for region in {first.region, second.region}:
        assert emu.billed_instances(region) == []
    assert emu.open_spot_requests() == []
    assert {r.kind for r in emu.spot_requests.values()} == {"one-time"}


def test_a_terminated_machine_can_still_be_stopped_but_not_started(emu: AwsEmulator) -> None:
    """EC2 keeps a terminated instance visible for a while: StopInstances on it is a no-op,
    StartInstances is IncorrectInstanceState."""
    provider = make(emu)
    inst = provider.launch(req())
    provider.terminate(inst.ref)
    provider.stop(inst.ref)  # nothing left to stop: not an error
    assert provider.get(inst.ref).state is MachineState.TERMINATED
    with pytest.raises(InvalidRequest):
        provider.start(inst.ref)


def test_fetch_offers_from_price_list_and_spot_history(emu: AwsEmulator, tmp_path: Path) -> None:
    emu.faults.cap_page_size(3)  # spot history comes in several pages
    offers = make(emu, pricing_endpoint=emu.endpoint_url).fetch_offers()
    by = {(o.region, o.zone, o.instance_type): o for o in offers}
    assert len(by) == len(offers)  # one offer per type and AZ

    p4d = by[("us-east-1", "use1-az6", "p4d.24xlarge")]  # us-east-1a
    assert (p4d.gpu, p4d.gpu_count, p4d.gpu_memory_gb) == ("A100", 8, 40)
    assert (p4d.vcpus, p4d.memory_gb, p4d.currency) == (96, Decimal("1152"), "USD")
    assert p4d.price == Decimal("21.9576")  # Linux, shared, no software, used capacity
    assert p4d.spot_price == Decimal("8.6012")  # the latest of that AZ
    assert p4d.source.startswith("AWS Price List API + spot price history, fetched 20")
    assert by[("us-east-1", "use1-az1", "p4d.24xlarge")].spot_price == Decimal("10.2077")
    assert by[("us-east-1", "use1-az4", "p4d.24xlarge")].spot_price is None  # no history
    assert by[("us-east-1", "use1-az6", "p4de.24xlarge")].gpu == "A100-80GB"
    h100 = by[("us-east-1", "use1-az6", "p5.48xlarge")]
    assert (h100.gpu, h100.price) == ("H100", Decimal("55.04"))  # not the capacity block
    t4 = by[("us-east-1", "use1-az6", "g4dn.xlarge")]
    assert (t4.gpu, t4.price, t4.spot_price) == ("T4", Decimal("0.526"), Decimal("0.2163"))
    assert by[("us-west-2", "usw2-az2", "p4d.24xlarge")].spot_price == Decimal("7.9513")
    assert not any(o.instance_type == "g5.2xlarge" for o in offers)  # no price → no offer
    assert all(o.spot_price is None or o.spot_price < o.price for o in offers)

    products = emu.calls("GetProducts", service="pricing")
    terms = {(f["Field"], f["Value"]) for f in products[0].params["Filters"]}
    assert terms >= {
        ("operatingSystem", "Linux"),
        ("tenancy", "Shared"),
        ("preInstalledSw", "NA"),
        ("capacitystatus", "Used"),
    }
    assert all(f["Type"] == "TERM_MATCH" for p in products for f in p.params["Filters"])

    path = tmp_path / "aws.csv"  # what `catalog refresh` stores, read back as the planner will
    assert catalog.write_csv(path, offers) == len(offers)
    assert list(catalog.read_csv(path)) == offers


def aws_app(emu: AwsEmulator, home: Path, clock) -> tuple[App, Experiment]:
    """An App on the emulator with its prices refreshed, and a T4 spot experiment `train`."""
    options = {"endpoint": emu.endpoint_url, "retry_base_seconds": 0.001}
    app = App(make_settings(home, clouds={"aws": options}), clock)
    catalog.refresh(app.settings, "aws", app.provider("aws").fetch_offers())
    experiment = Experiment.model_validate(
        sandbox_experiment("train", gpu="T4:1", market="spot", clouds=["aws"])
    )
    return app, experiment


def test_up_fails_over_from_a_zone_without_capacity(emu: AwsEmulator, home: Path, clock) -> None:
    """`catalog refresh` from the fixtures, then `up` a T4 spot machine with the cheapest zone
    out of capacity: it lands in the next zone and leaves exactly one machine."""
    app, experiment = aws_app(emu, home, clock)
    try:
        first, second = planning.plan(app, experiment).candidates[:2]
        assert first.offer.zone != second.offer.zone
        emu.faults.no_capacity(first.offer.zone)

        result = machines.up(app, experiment)
    finally:
        app.close()

    m = result.machine
    assert (m.cloud, m.zone, m.market) == ("aws", second.offer.zone, "spot")
    assert [a.outcome for a in result.attempts] == ["capacity", "launched"]
    [one] = app.provider("aws").list_managed()
    assert (one.id, one.zone, one.spot) == (m.instance_id, second.offer.zone, True)


def test_machines_join_our_ssh_group_with_imdsv2_only(emu: AwsEmulator) -> None:
    """Without a security group in settings a machine would land in the VPC's default group,
    which admits only its own members: ours opens 22/tcp to `ssh_cidrs`, is tagged, reused."""
    provider = make(emu, ssh_cidrs=["203.0.113.0/24"])
    provider.launch(req("tok-1"))
    provider.launch(req("tok-2", zone="use1-az4"))
    first, second = emu.run_instances_requests
    assert first["SecurityGroupId.1"] == second["SecurityGroupId.1"]
    assert (
        first["MetadataOptions.HttpTokens"],
        first["MetadataOptions.HttpPutResponseHopLimit"],
    ) == ("required", "1")
    ec2 = emu.client("ec2", "us-east-1")
    [group] = ec2.describe_security_groups(GroupIds=[first["SecurityGroupId.1"]])["SecurityGroups"]
    [rule] = group["IpPermissions"]
    assert (rule["IpProtocol"], rule["FromPort"], rule["ToPort"]) == ("tcp", 22, 22)
    assert [r["CidrIp"] for r in rule["IpRanges"]] == ["203.0.113.0/24"]
    assert {"Key": "managed-by", "Value": "provisioner"} in group["Tags"]
    assert len(emu.calls("CreateSecurityGroup")) == 1
    # another process (a fresh adapter) finds the group instead of making a second
    make(emu).launch(req("tok-3"))
    assert len(emu.calls("CreateSecurityGroup")) == 1
    assert emu.run_instances_requests[-1]["SecurityGroupId.1"] == group["GroupId"]


def test_changed_ssh_cidrs_update_our_group_on_the_next_launch(emu: AwsEmulator) -> None:
    """ssh_cidrs edited after the first launch: the next launch (another process) admits the
    new CIDRs and revokes the ones no longer listed; a launch with unchanged settings sends
    nothing; a user's own group of that name is left as it is."""
    make(emu, ssh_cidrs=["203.0.113.0/24", "198.51.100.0/24"]).launch(req("tok-1"))
    [wire] = emu.run_instances_requests
    ec2 = emu.client("ec2", "us-east-1")

    def cidrs() -> list[str]:
        [group] = ec2.describe_security_groups(GroupIds=[wire["SecurityGroupId.1"]])[
            "SecurityGroups"
        ]
        return sorted(r["CidrIp"] for p in group["IpPermissions"] for r in p["IpRanges"])

    make(emu, ssh_cidrs=["198.51.100.0/24", "192.0.2.10/32"]).launch(req("tok-2"))
    assert cidrs() == ["192.0.2.10/32", "198.51.100.0/24"]
    assert emu.run_instances_requests[-1]["SecurityGroupId.1"] == wire["SecurityGroupId.1"]
    sent = (
        len(emu.calls("AuthorizeSecurityGroupIngress")),
        len(emu.calls("RevokeSecurityGroupIngress")),
    )
    assert sent == (2, 1)  # the first group's rule, then one each
    make(emu, ssh_cidrs=["198.51.100.0/24", "192.0.2.10/32"]).launch(req("tok-3"))
    assert (
        len(emu.calls("AuthorizeSecurityGroupIngress")),
        len(emu.calls("RevokeSecurityGroupIngress")),
    ) == sent


def test_a_user_made_ssh_group_keeps_its_rules(emu: AwsEmulator) -> None:
    ec2 = emu.client("ec2", "us-east-1")
    [vpc] = ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"]
    gid = ec2.create_security_group(
        GroupName="provisioner-ssh", Description="mine", VpcId=vpc["VpcId"]
    )["GroupId"]
    ec2.authorize_security_group_ingress(
        GroupId=gid, IpProtocol="tcp", FromPort=22, ToPort=22, CidrIp="10.1.0.0/16"
    )
    make(emu, ssh_cidrs=["203.0.113.0/24"]).launch(req("tok-1"))
    [group] = ec2.describe_security_groups(GroupIds=[gid])["SecurityGroups"]
    assert [r["CidrIp"] for p in group["IpPermissions"] for r in p["IpRanges"]] == ["10.1.0.0/16"]
    assert emu.run_instances_requests[-1]["SecurityGroupId.1"] == gid


def test_gc_removes_our_ssh_group_once_no_machine_uses_it(emu: AwsEmulator) -> None:
    provider = make(emu)
    inst = provider.launch(req("tok-1"))
    [wire] = emu.run_instances_requests
    group = wire["SecurityGroupId.1"]
    assert provider.unused_network() == []  # a machine is in it
    provider.terminate(inst.ref)
    [line] = provider.unused_network()
    assert group in line and "us-east-1" in line
    assert make(emu).unused_network(remove=True) == [line]
    ec2 = emu.client("ec2", "us-east-1")
    assert not [
        g for g in ec2.describe_security_groups()["SecurityGroups"] if g["GroupId"] == group
    ]
    provider.launch(req("tok-2"))  # the next launch makes it again
    assert emu.run_instances_requests[-1]["SecurityGroupId.1"] != group


def test_the_time_ec2_stopped_or_took_a_machine_is_read_and_billed_to(
    emu: AwsEmulator, home: Path, clock
) -> None:
    """StateTransitionReason's "(YYYY-MM-DD HH:MM:SS GMT)" is when EC2 stopped or took it:
    reconcile, six hours later, closes the machine's usage there."""
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import select

    from provisioner.models import Event, UsageInterval

    provider = make(emu)
    stopped = provider.launch(req("tok-2"))
    before = datetime.now(UTC).replace(microsecond=0)
    provider.stop(stopped.ref)  # moto dates a user's stop by the wall clock
    after = datetime.now(UTC)
    at = provider.get(stopped.ref).stopped_at
    assert at is not None and before <= at <= after and at.tzinfo is not None

    app, experiment = aws_app(emu, home, clock)
    try:
        t0 = clock.now()
        m = machines.up(app, experiment).machine
        clock.advance(timedelta(minutes=7))
        taken = clock.now()
        emu.preempt(m.instance_id, m.region, action="terminate", at=taken)
        clock.advance(timedelta(hours=6))
        assert app.provider("aws").get(machines.ref(m)).stopped_at == taken
        machines.reconcile(app)
        with app.db.session() as s:
            event = s.scalars(select(Event).where(Event.machine_id == m.id).order_by(Event.id))
            last = list(event)[-1]
            compute = s.scalars(
                select(UsageInterval).where(
                    UsageInterval.machine_id == m.id, UsageInterval.kind == "compute"
                )
            ).one()
    finally:
        app.close()
    assert (last.kind, last.at, last.detail["at_source"]) == ("preempted", taken, "cloud")
    assert (compute.started_at, compute.ended_at) == (t0, taken)


@pytest.mark.parametrize(
    "value",
    [
        "2026-11-07T02:00:00.000Z",
        "2026-11-07T02:00:00Z",
        "2026-11-07T02:00:00.123456+03:00",
        "Sat, 07 Nov 2026 02:00:00 GMT",
        1_794_016_800,
    ],
)
def test_response_timestamps_are_the_instants_botocore_reads(value):
    """EC2's ISO 8601 times are read by the standard library (botocore's dateutil parser took
    0.11 s of a 1,000-machine sweep's listing); every form gives botocore's instant."""
    from botocore.utils import parse_timestamp

    from providers.aws.instances import parse_timestamp as ours

    assert ours(value) == parse_timestamp(value)
