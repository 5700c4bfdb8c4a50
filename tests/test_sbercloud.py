"""SberCloud (cloud.ru Advanced) adapter: the real huaweicloudsdkecs against a local ECS emulator
that checks every request's SDK-HMAC-SHA256 signature."""

from __future__ import annotations

import base64
import email
import subprocess
import sys
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from providers.base import (
    TAG_MACHINE,
    TAG_MANAGED_BY,
    AuthError,
    CapacityError,
    InstanceRef,
    InvalidRequest,
    LaunchRequest,
    MachineState,
    NotFound,
    QuotaError,
    Throttled,
    VolumeRequest,
    VolumeState,
)
from providers.sbercloud.adapter import STOP_MARKER, SberCloudProvider
from providers.sbercloud.errors import by_code
from providers.userdata import decoded, parts
from provisioner import catalog, machines, planner
from provisioner.app import App
from provisioner.spec import Experiment
from tests.conftest import make_settings
from tests.contract.sbercloud import AK, SK, options, sber_env
from tests.emulators.sbercloud import ZONES, EcsEmulator

SCRIPT = "#!/bin/bash\nnvidia-smi > /tmp/gpu.txt\n"
SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAItest ana@laptop"


@pytest.fixture
def emu():
    e = EcsEmulator(AK, SK).start()
    yield e
    e.stop()


@pytest.fixture
def env(monkeypatch):
    return sber_env(monkeypatch)


@pytest.fixture
def sc(emu, env) -> SberCloudProvider:
    return SberCloudProvider(options(emu))


def request(
    token: str = "pv-token-1",
    *,
    flavor: str = "pi2.2xlarge.4",
    zone: str = ZONES[0],
    spot: bool = False,
    machine: str = "m-1",
    max_price: Decimal | None = None,
) -> LaunchRequest:
    return LaunchRequest(
        name=f"exp-{machine}",
        token=token,
        region="ru-moscow-1",
        zone=zone,
        instance_type=flavor,
        gpu="T4",
        gpu_count=1,
        spot=spot,
        disk_gb=80,
        user_data=SCRIPT,
        ssh_public_key=SSH_KEY,
        labels={
            TAG_MANAGED_BY: "provisioner",
            TAG_MACHINE: machine,
            "provisioner-project": "vision",
            "provisioner-owner": "ana",
        },
        max_price=max_price,
    )


def creates(emu: EcsEmulator):
    return emu.received("POST", r"/v1\.1/[^/]+/cloudservers$")


def alive(emu: EcsEmulator) -> list[dict]:
    return [s for s in emu.servers.values() if s["status"] != "DELETED"]


# -- launch -------------------------------------------------------------------------------


@pytest.mark.parametrize("spot", [True, False], ids=["spot", "on-demand"])
@pytest.mark.parametrize(
    "flavor", ["pi2.2xlarge.4", "p3.2xlarge.8", "p5s.5xlarge.12"], ids=["T4", "A100", "H100"]
)
def test_launch_puts_the_whole_intent_on_the_wire(emu, sc, flavor, spot):
    max_price = Decimal("45.50") if spot else None
    inst = sc.launch(request(flavor=flavor, zone=ZONES[1], spot=spot, max_price=max_price))

    [sent] = creates(emu)
    assert sent.headers["X-Client-Token"] == "pv-token-1"
    server = sent.body["server"]
    assert server["flavorRef"] == flavor
    assert server["availability_zone"] == ZONES[1]
    assert server["imageRef"] == "img-ubuntu-22-gpu"
    assert server["root_volume"] == {"volumetype": "SSD", "size": 80}
    assert server["nics"] == [{"subnet_id": "subnet-0001"}]
    assert server["security_groups"] == [{"id": "sg-0001"}]
    assert server["publicip"] == {
        "eip": {
            "iptype": "5_bgp",
            "bandwidth": {"size": 100, "sharetype": "PER", "chargemode": "traffic"},
        },
        "delete_on_termination": True,
    }
    assert {t["key"]: t["value"] for t in server["server_tags"]} == {
        TAG_MANAGED_BY: "provisioner",
        TAG_MACHINE: "m-1",
        "provisioner-project": "vision",
        "provisioner-owner": "ana",
    }
    expected_ext = {"chargingMode": "postPaid"}
    if spot:
        expected_ext |= {"marketType": "spot", "spotPrice": "45.50"}
    assert server["extendparam"] == expected_ext
    # gzip-compressed cloud-init: our #cloud-config, then the script as a part of its own
    (kind, text), script = parts(decoded(base64.b64decode(server["user_data"])))
    assert kind == "cloud-config" and text.startswith("#cloud-config\n")
    config = yaml.safe_load(text)
    assert config["users"][1]["name"] == "provisioner"  # one SSH user everywhere
    assert config["users"][1]["ssh_authorized_keys"] == [SSH_KEY]
    assert script == ("x-shellscript", SCRIPT)

    assert inst.state is MachineState.RUNNING
    assert (inst.instance_type, inst.zone, inst.spot) == (flavor, ZONES[1], spot)
    assert inst.machine_id == "m-1"
    assert inst.id in emu.servers


def test_a_cloud_config_startup_script_is_kept_beside_our_key(emu, sc):
    sc.launch(replace(request(), user_data="#cloud-config\npackages: [htop]\n"))
    doc = decoded(base64.b64decode(creates(emu)[0].body["server"]["user_data"]))
    parts = [
        yaml.safe_load(p.get_payload(decode=True))
        for p in email.message_from_string(doc).walk()
        if not p.is_multipart()
    ]
    assert parts[0]["users"][1]["ssh_authorized_keys"] == [SSH_KEY]
    assert parts[1:] == [{"packages": ["htop"]}]


def test_launch_without_an_image_is_refused_before_any_call(emu, env):
    sc = SberCloudProvider({**options(emu), "image": None})
    with pytest.raises(InvalidRequest, match=r"clouds\.sbercloud\.image") as err:
        sc.launch(request())
    assert err.value.code == "NoImage"
    assert emu.requests == []


def test_a_flavor_the_cloud_does_not_have_is_invalid_request(emu, sc):
    with pytest.raises(InvalidRequest) as err:
        sc.launch(request(flavor="p9.huge.1"))
    assert err.value.code == "Ecs.0029"
    assert "Ecs.0029" in str(err.value)


def raw_create(sc: SberCloudProvider, **server: object) -> Any:
    """A create the adapter would never send, through the real SDK (for what the API refuses)."""
    from huaweicloudsdkecs.v2 import model as m

    body = m.PrePaidServer(
        image_ref="img-ubuntu-22-gpu",
        flavor_ref="pi2.2xlarge.4",
        name="raw",
        vpcid="vpc-0001",
        nics=[m.PrePaidServerNic(subnet_id="subnet-0001")],
        root_volume=m.PrePaidServerRootVolume(volumetype="SSD", size=80),
        extendparam=m.PrePaidServerExtendParam(charging_mode="postPaid"),
        **server,
    )
    create = m.CreateServersRequest(body=m.CreateServersRequestBody(server=body))
    return sc._call("raw create", lambda c: c.create_servers(create))


def test_labels_are_folded_into_at_most_ten_tags_ours_first(emu, sc):
    user = {
        "team": "vision",
        "a-label-key-that-is-far-longer-than-thirty-six": "v",
        "cost/centre": "x" * 60,
        "note": "a=b, c|d <e> *f* \\g/h",
        "run": "r1",
        "stage": "dev",
        "extra-1": "dropped",
        "extra-2": "dropped",
    }
    req = replace(request(), labels={**user, **request().labels, "provisioner-owner": "ana@x.io"})
    inst = sc.launch(req)

    sent = [(t["key"], t["value"]) for t in creates(emu)[0].body["server"]["server_tags"]]
    assert sent == [
        (TAG_MANAGED_BY, "provisioner"),
        (TAG_MACHINE, "m-1"),
        ("provisioner-project", "vision"),
        ("provisioner-owner", "ana@x.io"),
        ("team", "vision"),
        ("a-label-key-that-is-far-longer-than-", "v"),
        ("cost_centre", "x" * 43),
        ("note", "a_b_ c_d _e_ _f_ _g_h"),
        ("run", "r1"),
        ("stage", "dev"),
    ]
    assert inst.machine_id == "m-1"
    assert [i.id for i in sc.list_managed(machine_id="m-1")] == [inst.id]


@pytest.mark.parametrize(
    ("tags", "code"),
    [
        ([(f"k{n}", "v") for n in range(11)], "Ecs.0905"),
        ([("k" * 37, "v")], "Ecs.0906"),
        ([("", "v")], "Ecs.0906"),
        ([("k", "v" * 44)], "Ecs.0906"),
        ([("a=b", "v")], "Ecs.0907"),
        ([("k", "a,b")], "Ecs.0907"),
        ([("k", "a/b")], "Ecs.0907"),
        ([("k", "line\nbreak")], "Ecs.0907"),
        ([("k", "1"), ("k", "2")], "Ecs.0908"),
    ],
    ids=[
        "11-tags",
        "long-key",
        "empty-key",
        "long-value",
        "eq-in-key",
        "comma",
        "slash",
        "ctrl",
        "dup",
    ],
)
def test_a_create_with_tags_ecs_refuses_gets_the_ecs_code(emu, sc, tags, code):
    from huaweicloudsdkecs.v2 import model as m

    with pytest.raises(InvalidRequest) as err:
        raw_create(sc, server_tags=[m.PrePaidServerTag(key=k, value=v) for k, v in tags])
    assert err.value.code == code
    assert alive(emu) == []


# -- public address -----------------------------------------------------------------------


def eip(size: int = 10, share: str = "PER", charge: str | None = None, **publicip: Any) -> Any:
    from huaweicloudsdkecs.v2 import model as m

    bandwidth = m.PrePaidServerEipBandwidth(size=size, sharetype=share, chargemode=charge)
    return m.PrePaidServerPublicip(
        eip=m.PrePaidServerEip(iptype="5_bgp", bandwidth=bandwidth), **publicip
    )


@pytest.mark.parametrize("spot", [False, True], ids=["on-demand", "spot"])
def test_a_server_gets_a_public_address_and_down_leaves_no_eip_billing(emu, sc, spot):
    inst = sc.launch(request(spot=spot))
    [address] = [e["address"] for e in emu.eips.values() if e["server_id"] == inst.id]
    assert inst.public_ip == address
    assert inst.private_ip == emu.servers[inst.id]["ip"]
    sc.stop(inst.ref)
    assert sc.get(inst.ref).public_ip == address  # a stopped server keeps its EIP
    sc.terminate(inst.ref)
    assert emu.eips == {}


def test_the_bandwidth_is_an_option_and_by_bandwidth_sends_no_chargemode(emu, env):
    sc = SberCloudProvider(options(emu, bandwidth_mbit=20, bandwidth_charge="bandwidth"))
    sc.launch(request())
    bandwidth = creates(emu)[0].body["server"]["publicip"]["eip"]["bandwidth"]
    assert bandwidth == {"size": 20, "sharetype": "PER"}


def test_without_public_ip_no_eip_is_made(emu, env):
    inst = SberCloudProvider(options(emu, public_ip=False)).launch(request())
    assert "publicip" not in creates(emu)[0].body["server"]
    assert inst.public_ip is None and inst.private_ip
    assert emu.eips == {}


def raw_eip_server(sc: SberCloudProvider) -> str:
    """A server whose EIP was made without delete_on_termination (as an older launch, or one
    made elsewhere): only a delete that asks delete_publicip deletes it."""
    made = raw_create(sc, publicip=eip(delete_on_termination=False))
    sc._wait(made.job_id, "raw create", 5)
    [sid] = made.server_ids
    return sid


def test_an_eip_not_released_with_its_server_stays_and_bills(emu, sc):
    """The SDK's documented default: DeleteServers without delete_publicip only unbinds."""
    from huaweicloudsdkecs.v2 import model as m

    sid = raw_eip_server(sc)
    body = m.DeleteServersRequestBody(servers=[m.ServerId(id=sid)])
    job = sc._call("raw delete", lambda c: c.delete_servers(m.DeleteServersRequest(body=body)))
    sc._wait(job.job_id, "raw delete", 5)
    [left] = emu.eips.values()
    assert (left["server_id"], left["status"]) == (None, "DOWN")


@pytest.mark.parametrize("batch", [False, True], ids=["one", "batch"])
def test_down_deletes_the_eip_even_one_not_made_to_go_with_its_server(emu, sc, batch):
    sid = raw_eip_server(sc)
    ref = InstanceRef(id=sid, region="ru-moscow-1", zone=ZONES[0])
    if batch:
        assert sc.terminate_many([ref]) == {ref: None}
    else:
        sc.terminate(ref)
    assert emu.eips == {}  # nothing left billing
    [delete] = emu.received("POST", r"/v1/[^/]+/cloudservers/delete$")
    assert delete.body["delete_publicip"] is True


@pytest.mark.parametrize("how", ["delete", "vanish"])
def test_a_spot_server_taken_back_releases_its_eip(emu, sc, how):
    inst = sc.launch(request(spot=True))
    emu.preempt(inst.id, how=how)
    assert emu.eips == {}


@pytest.mark.parametrize("how", ["stop", "delete"])
def test_when_a_server_was_taken_is_read_from_the_wire(emu, sc, how):
    """A deleted server is dated by OS-SRV-USG:terminated_at, a SHUTOFF one by ``updated``."""
    from datetime import UTC, datetime

    inst = sc.launch(request(spot=True))
    assert sc.get(inst.ref).stopped_at is None
    taken = datetime(2026, 11, 2, 9, 7, 0, tzinfo=UTC)
    emu.preempt(inst.id, how=how, at=taken)
    got = sc.get(inst.ref)
    assert (got.state, got.stopped_at) == (MachineState.PREEMPTED, taken)


def test_no_eip_quota_is_quota_error_and_leaves_nothing(emu, sc):
    emu.faults.max_eips = 0
    with pytest.raises(QuotaError) as err:
        sc.launch(request())
    assert err.value.code == "Ecs.0013"
    assert alive(emu) == [] and emu.eips == {}


def test_a_bandwidth_ecs_does_not_sell_is_invalid_request(emu, env):
    sc = SberCloudProvider(options(emu, bandwidth_mbit=2001))
    with pytest.raises(InvalidRequest) as err:
        sc.launch(request())
    assert err.value.code == "Ecs.0045"
    assert alive(emu) == []


@pytest.mark.parametrize(
    "publicip",
    [
        lambda: eip(charge="bandwidth"),  # only absent, empty or "traffic"
        lambda: eip(share="SHARED"),
        lambda: eip(share="WHOLE"),  # a shared bandwidth needs its id
        lambda: eip(size=None),  # PER needs a size
        lambda: eip(id="00000000-0000-4000-8000-00000000e1p"),  # id or eip, not both
    ],
    ids=["chargemode", "sharetype", "whole-without-id", "per-without-size", "id-and-eip"],
)
def test_a_publicip_ecs_refuses_is_invalid_request(emu, sc, publicip):
    with pytest.raises(InvalidRequest) as err:
        raw_create(sc, publicip=publicip())
    assert err.value.code == "Ecs.0005"
    assert alive(emu) == [] and emu.eips == {}


# -- idempotency --------------------------------------------------------------------------


def test_the_same_intent_launched_twice_is_one_machine(emu, sc):
    first = sc.launch(request())
    again = sc.launch(request())
    assert again.id == first.id
    assert len(alive(emu)) == 1
    assert [r.headers["X-Client-Token"] for r in creates(emu)] == ["pv-token-1", "pv-token-1"]


# -- faults -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "job"])
def test_a_zone_out_of_capacity_is_capacity_error(emu, sc, mode):
    emu.sell_out(ZONES[0], mode=mode)
    with pytest.raises(CapacityError) as err:
        sc.launch(request(spot=True))
    assert err.value.code == "Ecs.0319"
    assert ZONES[0] in str(err.value) and "Ecs.0319" in str(err.value)
    assert alive(emu) == []
    assert sc.launch(request("pv-token-2", zone=ZONES[1], spot=True)).zone == ZONES[1]


def test_a_throttling_storm_is_ridden_out_without_a_second_machine(emu, sc):
    emu.throttle(4)
    inst = sc.launch(request())
    assert [r.status for r in creates(emu)] == [429, 429, 429, 429, 200]
    assert [s["id"] for s in alive(emu)] == [inst.id]
    emu.throttle(2)  # GETs too (the SDK reports those as its own "429")
    assert sc.get(inst.ref).state is MachineState.RUNNING


def test_a_job_still_running_at_the_deadline_returns_the_pending_machine(emu, env):
    sc = SberCloudProvider(options(emu, operation_timeout_seconds=0.001))
    emu.faults.job_polls = 5
    inst = sc.launch(request())
    assert inst.state is MachineState.PENDING
    assert inst.id in emu.servers


def test_the_sdk_names_for_credentials_work_too(emu, env):
    env.delenv("SBERCLOUD_ACCESS_KEY")
    env.delenv("SBERCLOUD_SECRET_KEY")
    env.setenv("HUAWEICLOUD_SDK_AK", AK)
    env.setenv("HUAWEICLOUD_SDK_SK", SK)
    assert SberCloudProvider(options(emu)).launch(request()).state is MachineState.RUNNING


def test_without_a_project_id_it_is_looked_up_in_iam(env):
    emu = EcsEmulator("AKIAMLOOKUP0001", SK).start()  # own AK: the SDK caches lookups per AK
    try:
        env.setenv("SBERCLOUD_ACCESS_KEY", "AKIAMLOOKUP0001")
        sc = SberCloudProvider({**options(emu), "project_id": None})
        assert sc.launch(request()).state is MachineState.RUNNING
        [lookup] = emu.received("GET", r"^/v3/projects$")
        assert lookup.query == {"name": "ru-moscow-1"}
    finally:
        emu.stop()


# -- states -------------------------------------------------------------------------------


def test_a_start_clears_the_stop_marker_so_a_later_preemption_still_shows(emu, sc):
    inst = sc.launch(request(spot=True))
    sc.stop(inst.ref)
    sc.start(inst.ref)
    assert STOP_MARKER not in emu.servers[inst.id]["metadata"]
    emu.preempt(inst.id, how="stop")
    assert sc.get(inst.ref).state is MachineState.PREEMPTED


def test_stop_and_start_are_one_batch_action_each_and_delete_takes_the_volume(emu, sc):
    inst = sc.launch(request())
    sc.stop(inst.ref)
    sc.stop(inst.ref)
    assert len(emu.received("POST", r"/cloudservers/action$")) == 1
    assert emu.received("POST", r"/cloudservers/action$")[0].body == {
        "os-stop": {"servers": [{"id": inst.id}], "type": "SOFT"}
    }
    assert emu.servers[inst.id]["metadata"][STOP_MARKER] == "user"
    sc.start(inst.ref)
    sc.start(inst.ref)
    assert len(emu.received("POST", r"/cloudservers/action$")) == 2
    sc.terminate(inst.ref)
    sc.terminate(inst.ref)
    [delete] = emu.received("POST", r"/cloudservers/delete$")
    assert delete.body["delete_volume"] is True


def test_a_machine_that_vanished_can_be_stopped_and_terminated_but_not_started(emu, sc):
    inst = sc.launch(request())
    emu.preempt(inst.id, how="vanish")
    sc.stop(inst.ref)
    sc.terminate(inst.ref)
    with pytest.raises(NotFound):
        sc.start(inst.ref)


def test_list_managed_filters_by_tag_and_pages_by_page_number(emu, env):
    sc = SberCloudProvider(options(emu, page_size=2))
    ours = {sc.launch(request(f"t-{n}", machine=f"m-{n}")).id for n in range(5)}
    emu.add_server("someone-elses")
    assert {i.id for i in sc.list_managed()} == ours
    pages = emu.received("GET", r"/cloudservers/detail$")
    assert [r.query for r in pages] == [
        {"tags": "managed-by=provisioner", "limit": "2", "offset": str(p)} for p in (1, 2, 3)
    ]
    [one] = sc.list_managed(machine_id="m-3")
    assert one.machine_id == "m-3"
    assert emu.received("GET", r"/cloudservers/detail$")[-1].query["tags"] == (
        "provisioner-machine=m-3"
    )


# -- check --------------------------------------------------------------------------------


def test_check_names_the_settings_a_launch_still_needs(emu, env):
    result = SberCloudProvider(options(emu, image=None, subnet_id=None)).check()
    assert result.ok and "\n" not in result.message
    assert "clouds.sbercloud.image, subnet_id" in result.message
    assert "to launch" not in SberCloudProvider(options(emu)).check().message


def ssh_group(emu: EcsEmulator) -> dict:
    [group] = [g for g in emu.security_groups.values() if g["name"] == "provisioner-ssh"]
    return group


def inbound(group: dict) -> set:
    return {
        (r["protocol"], r["port_range_min"], r["remote_ip_prefix"])
        for r in group["rules"].values()
        if r["direction"] == "ingress" and not r["remote_group_id"]
    }


def test_without_a_security_group_servers_join_ours_open_to_ssh_cidrs_only(emu, env):
    sc = SberCloudProvider(options(emu, security_group_id=None, ssh_cidrs=["198.51.100.0/24"]))
    inst = sc.launch(request())
    group = ssh_group(emu)
    assert group["tags"] == {TAG_MANAGED_BY: "provisioner"}
    # the new group's own 22 and 3389 from anywhere are gone: 22/tcp from ssh_cidrs only
    assert inbound(group) == {("tcp", 22, "198.51.100.0/24")}
    assert {r["direction"] for r in group["rules"].values()} == {"ingress", "egress"}  # out: all
    assert creates(emu)[0].body["server"]["security_groups"] == [{"id": group["id"]}]
    assert emu.servers[inst.id]["security_groups"] == [group["id"]]
    assert emu.reachable_on_22(inst.id, "198.51.100.7")
    assert not emu.reachable_on_22(inst.id, "203.0.113.10")
    # another process finds it again: no second group, no rule touched
    again = SberCloudProvider(options(emu, security_group_id=None, ssh_cidrs=["198.51.100.0/24"]))
    before = len(emu.requests)
    second = again.launch(request("pv-token-2", machine="m-2"))
    assert emu.servers[second.id]["security_groups"] == [group["id"]]
    assert len(emu.received("POST", r"/security-groups$")) == 1
    assert not [r for r in emu.requests[before:] if "security-group-rules/" in r.path]


def test_changed_ssh_cidrs_replace_the_group_s_ssh_rules(emu, env):
    SberCloudProvider(options(emu, security_group_id=None, ssh_cidrs=["198.51.100.0/24"])).launch(
        request()
    )
    moved = SberCloudProvider(
        options(emu, security_group_id=None, ssh_cidrs=["192.0.2.0/28", "2001:db8::/32"])
    )
    inst = moved.launch(request("pv-token-2", machine="m-2"))
    assert inbound(ssh_group(emu)) == {("tcp", 22, "192.0.2.0/28"), ("tcp", 22, "2001:db8::/32")}
    [v6] = [r for r in ssh_group(emu)["rules"].values() if r["remote_ip_prefix"] == "2001:db8::/32"]
    assert v6["ethertype"] == "IPv6"
    assert emu.reachable_on_22(inst.id, "192.0.2.3")
    assert not emu.reachable_on_22(inst.id, "198.51.100.7")


def test_a_named_security_group_is_used_as_it_is(emu, env, sc):
    inst = sc.launch(request())
    assert emu.servers[inst.id]["security_groups"] == ["sg-0001"]
    assert not [r for r in emu.requests if "security-group" in r.path]


def test_unused_network_names_and_removes_our_group_once_no_server_is_in_it(emu, env):
    sc = SberCloudProvider(options(emu, security_group_id=None))
    inst = sc.launch(request())
    group = ssh_group(emu)["id"]
    assert sc.unused_network() == []
    sc.stop(inst.ref)
    assert sc.unused_network() == []  # a stopped server still needs it
    sc.terminate(inst.ref)
    [line] = sc.unused_network()
    assert group in line and "provisioner-ssh" in line
    assert sc.unused_network(remove=True) == [line]
    assert set(emu.security_groups) == {"default"}  # never a group that is not ours
    assert emu.eips == {}  # the EIP went with its server
    # the next launch makes the group again
    again = sc.launch(request("pv-token-2", machine="m-2"))
    assert emu.reachable_on_22(again.id)


def test_a_group_taken_into_use_meanwhile_is_kept(emu, env, monkeypatch):
    sc = SberCloudProvider(options(emu, security_group_id=None))
    sc.terminate(sc.launch(request()).ref)
    group = ssh_group(emu)["id"]
    foreign = emu.add_server("someone-elses")
    # ECS does not list it (e.g. another project's server in our group): the delete is refused
    emu.servers[foreign]["security_groups"] = [group]
    monkeypatch.setattr(emu, "_list", lambda query: (200, {"count": 0, "servers": []}))
    assert sc.unused_network(remove=True) == []
    assert group in emu.security_groups
    [refused] = emu.received("DELETE", r"/security-groups/")
    assert refused.status == 409


# -- offers -------------------------------------------------------------------------------


def test_fetch_offers_lists_gpu_flavors_of_every_zone_without_prices(emu, sc):
    offers = sc.fetch_offers()
    assert {o.zone for o in offers} == set(ZONES)
    by_type = {o.instance_type: o for o in offers if o.zone == ZONES[0]}
    assert {t: (o.gpu, o.gpu_count, o.gpu_memory_gb) for t, o in by_type.items()} == {
        "pi2.2xlarge.4": ("T4", 1, 16),
        "pi2.4xlarge.4": ("T4", 2, 16),
        "p2s.2xlarge.8": ("V100", 1, 32),
        "p3.2xlarge.8": ("A100-80GB", 1, 80),
        "p5s.5xlarge.12": ("H100", 1, 80),
    }
    assert all(o.price is None and o.spot_price is None and o.currency == "RUB" for o in offers)
    assert by_type["p5s.5xlarge.12"].memory_gb == 240


def test_fetched_offers_feed_the_planner_once_priced_in_settings(emu, sc, home):
    settings = make_settings(
        home,
        clouds={"sbercloud": {}},
        prices={"sbercloud": {"p3.2xlarge.8": {"price": "390", "spot_price": "160"}}},
    )
    catalog.refresh(settings, "sbercloud", sc.fetch_offers())
    experiment = Experiment.model_validate(
        {
            "name": "llm",
            "project": "vision",
            "owner": "ana@example.com",
            "resources": {"gpu": "A100-80GB:1", "clouds": ["sbercloud"], "market": "spot"},
        }
    )
    result = planner.plan(
        experiment,
        catalog.load(settings, ["sbercloud"]),
        settings.money_rates,
        enabled_clouds=["sbercloud"],
    )
    assert [(c.offer.zone, c.price.amount) for c in result.candidates] == [
        (z, Decimal("160")) for z in ZONES
    ]


# -- end to end ---------------------------------------------------------------------------


def test_up_fails_over_from_a_zone_out_of_capacity_to_the_next(emu, env, home, clock):
    settings = make_settings(
        home,
        clouds={"sbercloud": options(emu)},
        prices={"sbercloud": {"pi2.2xlarge.4": {"price": "95", "spot_price": "30"}}},
    )
    emu.sell_out(ZONES[0])
    experiment = Experiment.model_validate(
        {
            "name": "train",
            "project": "vision",
            "owner": "ana@example.com",
            "resources": {"gpu": "T4:1", "clouds": ["sbercloud"], "market": "spot"},
        }
    )
    app = App(settings, clock)
    try:
        result = machines.up(app, experiment)
    finally:
        app.close()
    assert [(a.where, a.outcome) for a in result.attempts] == [
        (f"sbercloud/{ZONES[0]}", "capacity"),
        (f"sbercloud/{ZONES[1]}", "launched"),
    ]
    m = result.machine
    assert (m.status, m.zone, m.market, m.rate, m.currency) == (
        "running",
        ZONES[1],
        "spot",
        Decimal("30"),
        "RUB",
    )
    [server] = alive(emu)
    assert (server["zone"], server["metadata"]["charging_mode"]) == (ZONES[1], "2")
    assert server["tags"][TAG_MACHINE] == m.id


# -- error mapping and import hygiene -----------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "message", "kind"),
    [
        (400, "Ecs.0319", "Check capacity: Capacity is not enough.", CapacityError),
        (None, "Ecs.0044", "Disk type [SSD] has been sold out in AZ [x].", CapacityError),
        (None, None, "No valid host was found", CapacityError),
        (400, "Ecs.0013", "Insufficient EIP quota.", QuotaError),
        (403, "Ecs.0110", "Token role is not allowed", AuthError),
        (400, "Ecs.0023", "The project ID in token does not match that in URL.", AuthError),
        (501, "Ecs.0603", "Other commands are being executed.", Throttled),
        (404, "Ecs.0614", "itemNotFound: Instance xxx could not be found.", NotFound),
        (404, "APIGW.0101", "The API does not exist", InvalidRequest),
        (400, "Ecs.0005", "Invalid request body.", InvalidRequest),
    ],
)
def test_huawei_error_codes_map_to_the_taxonomy(status, code, message, kind):
    err = by_code(status, code, message, where="create in ru-moscow-1a")
    assert type(err) is kind
    assert err.code == code


def test_importing_the_adapter_loads_no_sdk():
    code = (
        "import sys, providers.sbercloud; "
        "print(sorted(m for m in sys.modules if m.startswith('huaweicloudsdk')))"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    ).stdout
    assert out.strip() == "[]"


# -- the first real run, through the CLI ------------------------------------------------------

NIGHTS_UNKNOWN_IDLE = """
name: nights
off_hours: {timezone: Europe/Moscow, windows: [{days: mon-fri, start: "20:00", end: "08:00"}]}
idle: {gpu_util_below: 5, for_minutes: 30, unknown_counts_as_idle: true}
"""


@pytest.mark.slow  # an end-to-end run through the CLI's processes
def test_first_real_run_through_the_cli_leaves_nothing_billed(emu, env, home, tmp_path):
    """`up`, a spot preemption (Huawei releases the server), the sweep's recovery, a night's
    idle stop, `down` and `gc --terminate`, each through the real CLI against the emulator; then
    its books: no server, no EIP, no group of ours left; every server had an EIP and our group,
    which admitted SSH from ssh_cidrs only."""
    import json
    from datetime import UTC, datetime, timedelta

    from tests.conftest import run_cli, sandbox_experiment, write_settings, write_yaml

    (tmp_path / "p.yaml").write_text(NIGHTS_UNKNOWN_IDLE)
    sber = options(emu, security_group_id=None, ssh_cidrs=["198.51.100.0/24"])
    cfg = write_settings(
        home,
        clouds={"sbercloud": sber},
        policies=[str(tmp_path / "p.yaml")],
        prices={"sbercloud": {"pi2.2xlarge.4": {"price": "95", "spot_price": "30"}}},
    )
    experiment = sandbox_experiment("train", gpu="T4:1", clouds=["sbercloud"])
    experiment["ssh_public_key"] = SSH_KEY
    spec = write_yaml(tmp_path / "train.yaml", experiment)
    noon = datetime(2026, 11, 6, 9, 0, tzinfo=UTC)  # Friday 12:00 in Moscow

    def cli(*args: str, at: datetime) -> dict:
        r = run_cli("--config", str(cfg), *args, "-o", "json", now=at)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def reachable(server_id: str) -> bool:
        return emu.reachable_on_22(server_id, "198.51.100.20") and not emu.reachable_on_22(
            server_id, "203.0.113.10"
        )

    # the emulator's addresses are not ours to connect to: `up` must not wait for SSH
    first = cli("up", str(spec), "--no-wait", at=noon)["machine"]
    assert reachable(first["instance_id"])
    emu.preempt(first["instance_id"], how="delete")  # a spot server is released
    swept = cli("sweep", at=noon + timedelta(minutes=5))
    [relaunch] = [a for p in swept["passes"] for a in p["actions"]]
    assert (relaunch["action"], relaunch["done"]) == ("relaunch", True)
    [second] = alive(emu)
    assert second["id"] != first["instance_id"] and reachable(second["id"])
    night = datetime(2026, 11, 6, 18, 0, tzinfo=UTC)  # Friday 21:00 in Moscow, no heartbeat
    swept = cli("sweep", at=night)
    [stop] = [a for p in swept["passes"] for a in p["actions"]]
    assert (stop["action"], stop["done"]) == ("stop", True)
    assert emu.servers[second["id"]]["status"] == "SHUTOFF"
    cli("down", "train", at=night + timedelta(minutes=1))
    assert alive(emu) == [] and emu.eips == {}  # nothing bills: no server, no address
    gc = cli("gc", "--terminate", "--yes", at=night + timedelta(minutes=2))
    [line] = gc["unused_network"]["sbercloud"]
    assert "provisioner-ssh" in line
    assert set(emu.security_groups) == {"default"}

    launches = [r.body["server"] for r in creates(emu)]
    assert len(launches) == 2  # the first server and its replacement, nothing more
    for server in launches:
        assert server["extendparam"]["marketType"] == "spot"
        assert server["publicip"]["delete_on_termination"] is True
        assert server["security_groups"] == launches[0]["security_groups"]
        assert server["security_groups"][0]["id"] != "default"


# -- volumes ------------------------------------------------------------------------------


def volume_request(name: str = "data", **kw: Any) -> VolumeRequest:
    fields = {
        "name": name,
        "token": f"vol-{name}",
        "region": "ru-moscow-1",
        "zone": ZONES[0],
        "size_gb": 100,
        "labels": {TAG_MANAGED_BY: "provisioner", "provisioner-project": "vision"},
    }
    return VolumeRequest(**(fields | kw))


def test_a_volume_is_an_evs_disk_created_once_by_its_client_token(emu, sc):
    labels = {TAG_MANAGED_BY: "provisioner", "provisioner-owner": "ana@example.com"}
    volume = sc.volumes.create(volume_request(labels=labels))
    sc.volumes.create(volume_request(labels=labels))  # a lost answer: same token, same disk
    posts = emu.received("POST", r"/v2\.1/[^/]+/cloudvolumes$")
    assert [p.headers["X-Client-Token"] for p in posts] == ["vol-data", "vol-data"]
    sent = posts[0].body["volume"]
    assert (sent["availability_zone"], sent["size"], sent["volume_type"]) == (ZONES[0], 100, "SSD")
    # EVS takes only digits, letters, - and _ in a disk's tags
    assert sent["tags"] == {TAG_MANAGED_BY: "provisioner", "provisioner-owner": "ana_example_com"}
    assert list(emu.volumes) == [volume.id]
    assert emu.volumes[volume.id]["status"] == "available"
    # a KVM server sees a VBD disk by its serial, the first 20 characters of its id
    assert sc.volumes.device(volume, 0) == f"/dev/disk/by-id/virtio-{volume.id[:20]}"


def test_down_keeps_our_volume_and_lets_other_data_disks_go_with_the_server(emu, sc):
    machine = sc.launch(request())
    ours = sc.volumes.create(volume_request())
    theirs = sc.volumes.create(volume_request("scratch", labels={"team": "infra"}))
    sc.volumes.attach(ours.ref, machine.ref, 0)
    sc.volumes.attach(theirs.ref, machine.ref, 1)
    sc.terminate(machine.ref)
    [delete] = emu.received("POST", r"/cloudservers/delete$")
    assert delete.body["delete_volume"] is True  # the server's other disks still go with it
    assert list(emu.volumes) == [ours.id]
    assert (emu.volumes[ours.id]["status"], emu.volumes[ours.id]["attachments"]) == (
        "available",
        [],
    )


def test_a_batch_down_keeps_every_machines_volume(emu, sc):
    machines = [sc.launch(request(f"t-{i}", machine=f"m-{i}")) for i in range(2)]
    volumes = [sc.volumes.create(volume_request(f"data-{i}")) for i in range(2)]
    for volume, machine in zip(volumes, machines, strict=True):
        sc.volumes.attach(volume.ref, machine.ref, 0)
    assert sc.terminate_many([m.ref for m in machines]) == {m.ref: None for m in machines}
    assert alive(emu) == []
    assert {v.id: v.state for v in sc.volumes.ours()} == {
        v.id: VolumeState.AVAILABLE for v in volumes
    }


def test_an_attached_volume_is_not_deleted_and_says_evs_s_code(emu, sc):
    machine = sc.launch(request())
    volume = sc.volumes.create(volume_request())
    sc.volumes.attach(volume.ref, machine.ref, 0)
    with pytest.raises(InvalidRequest) as refused:
        sc.volumes.delete(volume.ref)
    assert refused.value.code == "EVS.1046"
    assert sc.volumes.get(volume.ref).attached_to == machine.id


def test_list_volumes_pages_by_volume_offset(emu, env):
    sc = SberCloudProvider(options(emu, page_size=2))
    ours = [sc.volumes.create(volume_request(f"data-{i}")).id for i in range(4)]
    sc.volumes.create(volume_request("scratch", labels={}))
    assert sorted(v.id for v in sc.volumes.ours()) == sorted(ours)
    pages = emu.received("GET", r"/cloudvolumes/detail$")
    assert [p.query["offset"] for p in pages] == ["0", "2", "4"]


@pytest.mark.parametrize("how", ["delete", "vanish"])
def test_a_volume_of_a_spot_server_taken_back_can_be_attached_again(emu, sc, how):
    first = sc.launch(request(spot=True))
    volume = sc.volumes.create(volume_request())
    sc.volumes.attach(volume.ref, first.ref, 0)
    emu.preempt(first.id, how=how)
    assert sc.volumes.get(volume.ref).state is VolumeState.AVAILABLE
    second = sc.launch(request("pv-token-2", machine="m-2"))
    sc.volumes.attach(volume.ref, second.ref, 0)
    assert sc.volumes.get(volume.ref).attached_to == second.id


def test_an_attach_detach_or_delete_whose_answer_was_lost_is_not_an_error(emu, sc):
    machine = sc.launch(request())
    volume = sc.volumes.create(volume_request())
    emu.faults.drop_volume_responses = 1
    sc.volumes.attach(volume.ref, machine.ref, 0)  # the retry is refused: it is attaching
    assert len(emu.received("POST", r"/attachvolume$")) == 2
    assert sc.volumes.get(volume.ref).attached_to == machine.id
    emu.faults.drop_volume_responses = 1
    sc.volumes.detach(volume.ref, machine.ref)
    assert len(emu.received("DELETE", r"/detachvolume/")) == 2
    assert sc.volumes.get(volume.ref).state is VolumeState.AVAILABLE
    emu.faults.drop_volume_responses = 1
    sc.volumes.delete(volume.ref)  # the retry is refused: it is deleting
    assert len(emu.received("DELETE", r"/cloudvolumes/")) == 2
    with pytest.raises(NotFound):
        sc.volumes.get(volume.ref)
