"""The GCP adapter, running the real google-cloud-compute REST transport against the local
Compute Engine emulator (tests/emulators/gcp.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import pytest

from providers.base import (
    TAG_MACHINE,
    TAG_MANAGED_BY,
    TAG_OWNER,
    TAG_PROJECT,
    AuthError,
    CapacityError,
    InstanceRef,
    InvalidRequest,
    LaunchRequest,
    MachineState,
    NotFound,
    QuotaError,
)
from providers.gcp.adapter import GCPProvider, request_id
from providers.gcp.errors import by_code
from providers.gcp.network import ssh_rule_name
from tests.contract.gcp import make_provider as provider
from tests.contract.gcp import remove_credentials
from tests.emulators.gcp import GCPEmulator

ROOT = Path(__file__).resolve().parent.parent
SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEmulatorKey user@host"
ZONE = "us-central1-a"
FAMILIES = {  # gpu -> (instance type, GPUs, accelerator); a3 below 8 GPUs is Spot-only
    "A100": ("a2-highgpu-1g", 1, ""),
    "H100": ("a3-highgpu-8g", 8, ""),
    "H200": ("a3-ultragpu-8g", 8, ""),
    "T4": ("n1-standard-4", 1, "nvidia-tesla-t4"),
}
T4 = "nvidia-tesla-t4"


@pytest.fixture
def emu():
    with GCPEmulator() as emulator:
        yield emulator


@pytest.fixture
def gcp(emu: GCPEmulator) -> GCPProvider:
    return provider(emu)


def request(
    name: str = "exp-a1b2c3",
    *,
    gpu: str = "T4",
    spot: bool = True,
    zone: str = ZONE,
    token: str | None = None,
    **kw: object,
) -> LaunchRequest:
    instance_type, gpu_count, accelerator = FAMILIES[gpu]
    fields: dict = {
        "name": name,
        "token": token or f"pv-{name}",
        "region": zone.rsplit("-", 1)[0],
        "zone": zone,
        "instance_type": instance_type,
        "gpu": gpu,
        "gpu_count": gpu_count,
        "spot": spot,
        "accelerator": accelerator,
        "disk_gb": 150,
        "user_data": "#!/bin/bash\necho hello > /tmp/hello",
        "ssh_public_key": SSH_KEY,
        "labels": {
            TAG_MANAGED_BY: "provisioner",
            TAG_MACHINE: f"m{name.replace('-', '')}",
            TAG_PROJECT: "vision",
            TAG_OWNER: "Ana.Lopez@Example.com",
        },
    }
    fields.update(kw)
    return LaunchRequest(**fields)


def inserts(emu: GCPEmulator) -> list:
    return [r for r in emu.calls("POST", "/instances") if "requestId" in r.query]


# --- launch ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spot", [True, False], ids=["spot", "on-demand"])
@pytest.mark.parametrize("gpu", sorted(FAMILIES))
def test_launch_puts_the_whole_intent_on_the_wire(
    emu: GCPEmulator, gcp: GCPProvider, gpu: str, spot: bool
) -> None:
    req = request(gpu=gpu, spot=spot)
    inst = gcp.launch(req)

    assert inst.state is MachineState.RUNNING and inst.spot is spot
    assert (inst.zone, inst.region, inst.instance_type) == (ZONE, "us-central1", req.instance_type)
    (sent,) = inserts(emu)
    assert sent.query["requestId"] == request_id(req)
    body = sent.body
    assert body["name"] == req.name
    assert body["machineType"] == f"zones/{ZONE}/machineTypes/{req.instance_type}"
    scheduling = body["scheduling"]
    assert scheduling["onHostMaintenance"] == "TERMINATE"
    if spot:
        assert scheduling["provisioningModel"] == "SPOT"
        assert scheduling["instanceTerminationAction"] == "STOP"
        assert scheduling["automaticRestart"] is False
    else:
        assert scheduling["provisioningModel"] == "STANDARD"
        assert "instanceTerminationAction" not in scheduling
    if gpu == "T4":
        assert body["guestAccelerators"] == [
            {
                "acceleratorType": f"zones/{ZONE}/acceleratorTypes/nvidia-tesla-t4",
                "acceleratorCount": 1,
            }
        ]
    else:  # a2/a3 bring their GPUs with the machine type
        assert "guestAccelerators" not in body
    nic = body["networkInterfaces"][0]
    assert nic.get("nicType") == ("GVNIC" if gpu in ("H100", "H200") else None)
    # the `default` network, and an external address through a one-to-one NAT access config
    assert nic["network"] == "global/networks/default"
    assert nic["accessConfigs"] == [{"name": "External NAT", "type": "ONE_TO_ONE_NAT"}]
    assert inst.public_ip and inst.private_ip
    # labels travel sanitised to GCP's rules: the owner's e-mail is no valid label value
    assert body["labels"] == {
        TAG_MANAGED_BY: "provisioner",
        TAG_MACHINE: req.labels[TAG_MACHINE],
        TAG_PROJECT: "vision",
        TAG_OWNER: "ana-lopez-example-com",
    }
    assert inst.labels == body["labels"] and inst.machine_id == req.labels[TAG_MACHINE]
    metadata = {i["key"]: i["value"] for i in body["metadata"]["items"]}
    assert metadata["startup-script"] == req.user_data
    assert metadata["ssh-keys"] == f"provisioner:{SSH_KEY}"
    (disk,) = body["disks"]
    assert disk["boot"] and disk["initializeParams"]["diskSizeGb"] == "150"
    assert "deeplearning-platform-release" in disk["initializeParams"]["sourceImage"]
    boot = "hyperdisk-balanced" if gpu == "H200" else "pd-balanced"
    assert disk["initializeParams"]["diskType"] == f"zones/{ZONE}/diskTypes/{boot}"
    # the boot disk is billed on its own line, under its own labels: the machine's
    assert disk["initializeParams"]["labels"] == body["labels"]


def test_without_external_ip_the_instance_gets_no_access_config(emu: GCPEmulator) -> None:
    inst = provider(emu, external_ip=False).launch(request())
    (sent,) = inserts(emu)
    assert "accessConfigs" not in sent.body["networkInterfaces"][0]
    assert inst.public_ip is None and inst.private_ip


def test_spot_that_should_terminate_is_deleted_on_preemption(
    emu: GCPEmulator, gcp: GCPProvider
) -> None:
    emu.add_image("p", "x")
    inst = gcp.launch(request(preemption_action="terminate", image="projects/p/global/images/x"))
    (sent,) = inserts(emu)
    assert sent.body["scheduling"]["instanceTerminationAction"] == "DELETE"
    assert sent.body["disks"][0]["initializeParams"]["sourceImage"] == "projects/p/global/images/x"

    emu.preempt(ZONE, inst.name)
    with pytest.raises(NotFound):
        gcp.get(inst.ref)


def test_name_taken_by_the_same_machine_is_adopted_by_another_one_refused(
    emu: GCPEmulator, gcp: GCPProvider
) -> None:
    first = gcp.launch(request(token="pv-token-1"))
    # the same machine again with a token the cloud does not remember: 409, adopted
    assert gcp.launch(request(token="pv-token-2")).id == first.id
    # someone else's instance holds the name
    emu.add_instance("us-central1-b", "taken-name", labels={"team": "other"})
    with pytest.raises(InvalidRequest) as err:
        gcp.launch(request("taken-name", zone="us-central1-b"))
    assert err.value.code == "alreadyExists"


# --- failures -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code",
    [
        "ZONE_RESOURCE_POOL_EXHAUSTED",
        "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
        "insufficientCapacity",
    ],
)
def test_zone_out_of_capacity(emu: GCPEmulator, gcp: GCPProvider, code: str) -> None:
    emu.exhaust(ZONE, code)
    with pytest.raises(CapacityError) as err:
        gcp.launch(request(gpu="A100"))
    assert err.value.code == code and code in str(err.value)
    assert emu.instances == {}
    # the operation carried the error without httpErrorStatusCode: it was read by hand
    assert all("httpErrorStatusCode" not in op for op in emu.operations.values())
    # another zone still works
    assert gcp.launch(request(gpu="A100", zone="us-central1-b")).zone == "us-central1-b"


def test_an_accelerator_the_zone_lacks_is_refused_at_once_as_no_capacity_there(
    emu: GCPEmulator, gcp: GCPProvider
) -> None:
    emu.withdraw_accelerator(ZONE, T4)
    with pytest.raises(CapacityError) as err:
        gcp.launch(request())
    assert err.value.code == "badRequest"
    assert f"zones/{ZONE}/acceleratorTypes/{T4}' was not found" in str(err.value)
    assert emu.operations == {} and emu.instances == {}  # refused before any operation began
    assert gcp.launch(request(zone="us-central1-b")).state is MachineState.RUNNING


def test_a_spot_vm_preempted_while_booting_is_no_capacity_and_leaves_nothing(
    emu: GCPEmulator, gcp: GCPProvider
) -> None:
    emu.preempt_on_create(ZONE)
    with pytest.raises(CapacityError) as err:
        gcp.launch(request("booting"))
    assert err.value.code == "UNSUPPORTED_OPERATION"
    assert "failed to start due to preemption" in str(err.value)
    # GCP left it stopped under our name, its disk billing: the adapter deleted it
    assert emu.instances == {}
    assert [r.path.rsplit("/", 1)[-1] for r in emu.calls("DELETE")] == ["booting"]
    assert gcp.launch(request("booting", zone="us-central1-b")).zone == "us-central1-b"


def test_a_missing_default_network_is_an_invalid_request_that_says_what_to_set(
    emu: GCPEmulator, gcp: GCPProvider
) -> None:
    emu.delete_network("default")
    with pytest.raises(InvalidRequest) as err:
        gcp.launch(request())
    # found at the firewall rule, before any instance was asked for: firewalls.insert answers
    # a network the project lacks with 404 notFound
    assert err.value.code == "notFound"
    assert "network global/networks/default was not found" in str(err.value)
    assert "`network`" in str(err.value) and "\n" not in str(err.value)
    assert inserts(emu) == [] and emu.instances == {}
    # an instance insert naming it is refused with the same advice
    err2 = by_code(
        "invalid",
        "Invalid value for field 'resource.networkInterfaces[0].network': "
        "'global/networks/default'. The referenced network resource cannot be found.",
        400,
    )
    assert type(err2) is InvalidRequest and "`network`" in str(err2)
    # a network of one's own: our SSH rule is made on it, under its name
    emu.networks.add("gpu-vpc")
    named = provider(emu, network="projects/test-project/global/networks/gpu-vpc")
    inst = named.launch(request())
    assert inst.state is MachineState.RUNNING
    rule = emu.firewalls["provisioner-allow-ssh-gpu-vpc"]
    assert rule["network"].endswith("/projects/test-project/global/networks/gpu-vpc")
    assert emu.reachable_on_22(ZONE, inst.name)


# --- SSH reachability -----------------------------------------------------------------------


def firewall_inserts(emu: GCPEmulator) -> list:
    return emu.calls("POST", "/global/firewalls")


def test_launch_opens_ssh_with_a_firewall_rule_of_ours_made_once(emu: GCPEmulator) -> None:
    # the default network without its prepopulated default-allow-ssh (deleted, as many do)
    emu.delete_firewall("default-allow-ssh")
    gcp = provider(emu, ssh_cidrs=["198.51.100.0/24"])
    inst = gcp.launch(request("first"))

    (sent,) = inserts(emu)
    assert sent.body["tags"] == {"items": ["provisioner-ssh"]}
    assert emu.instance(ZONE, "first")["tags"]["items"] == ["provisioner-ssh"]
    ours = [r for r in emu.firewalls.values() if r["name"].startswith("provisioner")]
    assert [r["name"] for r in ours] == ["provisioner-allow-ssh-default"]
    (rule,) = ours
    assert rule["sourceRanges"] == ["198.51.100.0/24"]
    assert rule["targetTags"] == ["provisioner-ssh"]
    assert rule["allowed"] == [{"IPProtocol": "tcp", "ports": ["22"]}]
    assert rule["direction"] == "INGRESS" and rule["network"].endswith("/global/networks/default")
    assert emu.reachable_on_22(ZONE, inst.name, source="198.51.100.7")
    assert not emu.reachable_on_22(ZONE, inst.name, source="203.0.113.10")  # not in ssh_cidrs
    # an instance without our tag is not reached by it
    emu.add_instance(ZONE, "untagged")
    assert not emu.reachable_on_22(ZONE, "untagged", source="198.51.100.7")

    # the same adapter asks nothing more; a fresh one finds the rule and makes no second
    gets = len(emu.calls("GET", "/global/firewalls/provisioner-allow-ssh-default"))
    gcp.launch(request("second"))
    assert len(emu.calls("GET", "/global/firewalls/provisioner-allow-ssh-default")) == gets
    again = provider(emu, ssh_cidrs=["198.51.100.0/24"]).launch(request("third"))
    assert len(firewall_inserts(emu)) == 1
    assert len(emu.calls("GET", "/global/firewalls/provisioner-allow-ssh-default")) == gets + 1
    assert emu.reachable_on_22(ZONE, again.name, source="198.51.100.7")


def test_the_rule_s_creation_is_awaited_as_a_global_operation(emu: GCPEmulator) -> None:
    emu.delete_firewall("default-allow-ssh")
    emu.slow_operations(2)
    inst = provider(emu).launch(request())
    (op,) = emu.global_operations.values()
    assert op["status"] == "DONE" and "zone" not in op
    assert op["targetLink"].endswith("/global/firewalls/provisioner-allow-ssh-default")
    assert emu.calls("POST", f"/global/operations/{op['name']}/wait")
    assert emu.reachable_on_22(ZONE, inst.name)


def test_a_rule_another_process_made_first_is_used(emu: GCPEmulator) -> None:
    emu.delete_firewall("default-allow-ssh")
    theirs = {
        "name": "provisioner-allow-ssh-default",
        "network": "global/networks/default",
        "allowed": [{"IPProtocol": "tcp", "ports": ["22"]}],
        "sourceRanges": ["0.0.0.0/0"],
        "targetTags": ["provisioner-ssh"],
    }
    emu.lose_firewall_race(theirs)  # made between our get (404) and our insert
    inst = provider(emu).launch(request())
    assert inst.state is MachineState.RUNNING
    assert len(firewall_inserts(emu)) == 1  # it was tried, and met 409 alreadyExists
    assert emu.global_operations == {}
    assert [n for n in emu.firewalls if n.startswith("provisioner")] == [theirs["name"]]
    assert emu.reachable_on_22(ZONE, inst.name)


def test_a_lost_answer_to_the_rule_s_insert_is_retried_as_the_same_insert(
    emu: GCPEmulator,
) -> None:
    emu.delete_firewall("default-allow-ssh")
    emu.lose_responses(1, call="POST /global/firewalls")  # made, then answered 503
    inst = provider(emu).launch(request())
    first, retry = firewall_inserts(emu)
    assert first.query["requestId"] == retry.query["requestId"]  # joined the first operation
    assert len(emu.global_operations) == 1
    assert emu.reachable_on_22(ZONE, inst.name)


def test_a_rule_of_our_name_on_another_network_is_refused_clearly(emu: GCPEmulator) -> None:
    emu.networks.add("gpu-vpc")
    other = {
        "name": "provisioner-allow-ssh-default",
        "network": "global/networks/gpu-vpc",
        "allowed": [{"IPProtocol": "tcp", "ports": ["22"]}],
    }
    assert post_firewall(emu, other)[0] == 200
    with pytest.raises(InvalidRequest) as err:
        provider(emu).launch(request())
    assert err.value.code == "firewallNetworkMismatch" and "gpu-vpc" in str(err.value)
    assert inserts(emu) == []


def test_changed_ssh_cidrs_are_patched_into_the_existing_rule(emu: GCPEmulator) -> None:
    emu.delete_firewall("default-allow-ssh")
    first = provider(emu, ssh_cidrs=["198.51.100.0/24"]).launch(request("first"))
    rule_id = emu.firewalls["provisioner-allow-ssh-default"]["id"]
    # the settings now admit another network: the next launch updates the rule in place
    second = provider(emu, ssh_cidrs=["192.0.2.0/28"]).launch(request("second"))
    [patch] = emu.calls("PATCH", "/global/firewalls/provisioner-allow-ssh-default")
    assert patch.body == {"sourceRanges": ["192.0.2.0/28"]}
    rule = emu.firewalls["provisioner-allow-ssh-default"]
    assert rule["id"] == rule_id and rule["allowed"] == [{"IPProtocol": "tcp", "ports": ["22"]}]
    assert len(firewall_inserts(emu)) == 1
    for name in (first.name, second.name):
        assert emu.reachable_on_22(ZONE, name, source="192.0.2.5")
        assert not emu.reachable_on_22(ZONE, name, source="198.51.100.7")
    # unchanged settings patch nothing
    provider(emu, ssh_cidrs=["192.0.2.0/28"]).launch(request("third"))
    assert len(emu.calls("PATCH")) == 1


def test_unused_network_names_and_removes_only_our_rules_nobody_uses(emu: GCPEmulator) -> None:
    emu.networks.add("gpu-vpc")
    gcp = provider(emu)
    inst = gcp.launch(request("on-default"))
    provider(emu, network="global/networks/gpu-vpc").launch(request("on-gpu-vpc"))
    assert gcp.unused_network() == []  # a machine is on each network
    gcp.stop(inst.ref)
    assert gcp.unused_network() == []  # a stopped machine needs its rule when started again
    gcp.terminate(inst.ref)
    [line] = gcp.unused_network()
    assert "provisioner-allow-ssh-default" in line and "network default" in line
    assert "provisioner-allow-ssh-default" in emu.firewalls  # listing removes nothing
    assert gcp.unused_network(remove=True) == [line]
    assert sorted(n for n in emu.firewalls if n.startswith("provisioner")) == [
        "provisioner-allow-ssh-gpu-vpc"
    ]
    assert "default-allow-ssh" in emu.firewalls  # never a rule that is not ours
    # a later launch on the network makes the rule again
    again = gcp.launch(request("back"))
    assert "provisioner-allow-ssh-default" in emu.firewalls
    assert emu.reachable_on_22(ZONE, again.name, source="203.0.113.9")


def test_the_metadata_key_works_in_a_project_that_turns_os_login_on(emu: GCPEmulator) -> None:
    emu.project_metadata["enable-oslogin"] = "TRUE"
    inst = provider(emu).launch(request())
    items = {i["key"]: i["value"] for i in emu.instance(ZONE, inst.name)["metadata"]["items"]}
    assert items["enable-oslogin"] == "FALSE"
    assert emu.metadata_ssh_login(ZONE, inst.name, "provisioner")
    # without the instance's own value the project's OS Login would turn the key away
    stored = emu.instance(ZONE, inst.name)["metadata"]
    stored["items"] = [i for i in stored["items"] if i["key"] != "enable-oslogin"]
    assert not emu.metadata_ssh_login(ZONE, inst.name, "provisioner")


def test_check_says_when_the_project_turns_os_login_on(emu: GCPEmulator) -> None:
    assert "OS Login" not in provider(emu).check().message
    emu.project_metadata["enable-oslogin"] = "TRUE"
    result = provider(emu).check()
    assert result.ok and "OS Login on" in result.message and "requireOsLogin" in result.message
    assert "\n" not in result.message


def test_an_organization_enforcing_os_login_is_refused_saying_what_to_do(
    emu: GCPEmulator,
) -> None:
    emu.require_os_login()
    with pytest.raises(InvalidRequest) as err:
        provider(emu).launch(request())
    text = str(err.value)
    assert err.value.code == "conditionNotMet"
    assert "constraints/compute.requireOsLogin" in text and "exempt this project" in text
    assert "\n" not in text and emu.instances == {}


def test_the_rule_name_fits_63_characters_and_names_its_network() -> None:
    assert ssh_rule_name("default") == "provisioner-allow-ssh-default"
    long_a, long_b = "a" * 40 + "-x", "a" * 40 + "-y"
    assert len(ssh_rule_name(long_a)) <= 63 and ssh_rule_name(long_a) != ssh_rule_name(long_b)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", ssh_rule_name(long_a))


def post_firewall(emu: GCPEmulator, body: dict) -> tuple[int, dict]:
    url = f"{emu.endpoint}/compute/v1/projects/{emu.project}/global/firewalls"
    request_ = urllib.request.Request(url, json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request_) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_the_emulator_applies_the_firewall_api_s_rules(emu: GCPEmulator) -> None:
    good = {
        "name": "allow-ssh-x",
        "network": "global/networks/default",
        "allowed": [{"IPProtocol": "tcp", "ports": ["22"]}],
        "sourceRanges": ["0.0.0.0/0"],
        "targetTags": ["x"],
    }

    def refused(body: dict) -> tuple[int, str]:
        status, answer = post_firewall(emu, body)
        return status, answer["error"]["errors"][0]["reason"]

    assert refused({**good, "sourceRange": ["0.0.0.0/0"]}) == (400, "invalid")  # unknown field
    assert refused({**good, "network": "default"}) == (400, "invalid")  # "The URL is malformed"
    assert refused({**good, "network": "global/networks/nope"}) == (404, "notFound")
    assert refused({**good, "sourceRanges": ["10.0.0.0/8", "::/0"]}) == (400, "invalid")
    assert refused({**good, "allowed": [{"IPProtocol": "icmp", "ports": ["22"]}]}) == (
        400,
        "invalid",
    )
    assert refused({**good, "priority": 70000}) == (400, "invalid")
    assert post_firewall(emu, good)[0] == 200
    assert refused(good) == (409, "alreadyExists")  # names are unique per project
    # the default network's prepopulated default-allow-ssh reaches every instance on it
    emu.add_instance(ZONE, "plain")
    assert emu.reachable_on_22(ZONE, "plain")
    # a DENY of higher priority (a lower number) wins
    deny = {**good, "name": "deny-ssh", "priority": 100, "targetTags": []}
    deny["denied"] = deny.pop("allowed")
    assert post_firewall(emu, deny)[0] == 200
    assert not emu.reachable_on_22(ZONE, "plain")


def test_an_incompatible_combination_is_never_a_capacity_error() -> None:
    # GCE has reported an unsupported machine/disk pairing under a capacity code
    err = by_code(
        "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
        "[pd-standard, pd-ssd, n4-standard-16] features are not compatible for creating instance.",
        400,
    )
    assert type(err) is InvalidRequest


@pytest.mark.parametrize(
    ("quota", "via", "scope"),
    [
        ("NVIDIA_A100_GPUS", "http", "region"),
        ("NVIDIA_A100_GPUS", "operation", "region"),
        ("GPUS_ALL_REGIONS", "http", "cloud"),
        ("GPUS_ALL_REGIONS", "operation", "cloud"),
    ],
)
def test_quota(emu: GCPEmulator, gcp: GCPProvider, quota: str, via: str, scope: str) -> None:
    emu.exceed_quota(quota, via=via)
    with pytest.raises(QuotaError) as err:
        gcp.launch(request(gpu="A100", spot=False))
    assert err.value.scope == scope
    assert err.value.code in ("quotaExceeded", "QUOTA_EXCEEDED") and quota in str(err.value)
    assert emu.instances == {}


def test_rate_limit_as_403_is_throttling_not_auth(emu: GCPEmulator, gcp: GCPProvider) -> None:
    emu.throttle(2, status=403)
    assert gcp.launch(request()).state is MachineState.RUNNING


def post(emu: GCPEmulator, body: dict, zone: str = ZONE) -> tuple[int, dict]:
    """Send an instances.insert body straight to the emulator: (HTTP status, JSON answer)."""
    url = f"{emu.endpoint}/compute/v1/projects/{emu.project}/zones/{zone}/instances"
    data = json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, method="POST")) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def sent_body(emu: GCPEmulator, gcp: GCPProvider, name: str, **kw: object) -> dict:
    """The insert body the adapter sends for ``request(name, **kw)`` (launched, then deleted)."""
    gcp.launch(request(name, **kw))
    emu.console_delete(ZONE, name)
    return json.loads(json.dumps(inserts(emu)[-1].body))


def test_malformed_request_is_refused_by_the_emulator(emu: GCPEmulator, gcp: GCPProvider) -> None:
    # a2 machines cannot take attachable GPUs: the emulator applies GCP's rules
    with pytest.raises(InvalidRequest) as err:
        gcp.launch(request(gpu="A100", accelerator=T4))
    assert err.value.code == "badRequest"
    assert "[nvidia-tesla-t4, a2-highgpu-1g] features are not compatible" in str(err.value)
    # a field compute_v1.Instance does not know is refused too: replay a good body with one
    good = dict(sent_body(emu, gcp, "good"), name="replayed")
    assert post(emu, {**good, "machineTyp": good["machineType"]})[0] == 400
    assert post(emu, good)[0] == 200


# --- machine series rules -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("instance_type", "gpu", "gpus", "disk"),
    [
        ("a3-ultragpu-8g", "H200", 8, "hyperdisk-balanced"),
        ("a3-megagpu-8g", "H100", 8, "pd-balanced"),
        ("a3-highgpu-8g", "H100", 8, "pd-balanced"),
        ("a2-megagpu-16g", "A100", 16, "pd-balanced"),
        ("a2-ultragpu-1g", "A100-80GB", 1, "pd-balanced"),
        ("g2-standard-4", "L4", 1, "pd-balanced"),
        ("n1-standard-8", "T4", 1, "pd-balanced"),
    ],
)
def test_boot_disk_type_follows_the_machine_series(
    emu: GCPEmulator, gcp: GCPProvider, instance_type: str, gpu: str, gpus: int, disk: str
) -> None:
    accelerator = T4 if instance_type.startswith("n1-") else ""
    req = replace(
        request(spot=False),
        instance_type=instance_type,
        gpu=gpu,
        gpu_count=gpus,
        accelerator=accelerator,
    )
    inst = gcp.launch(req)
    assert inst.state is MachineState.RUNNING and inst.instance_type == instance_type
    (sent,) = inserts(emu)
    assert sent.body["disks"][0]["initializeParams"]["diskType"] == f"zones/{ZONE}/diskTypes/{disk}"


def test_a_boot_disk_the_series_cannot_take_is_refused(
    emu: GCPEmulator, gcp: GCPProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    from providers.gcp import adapter

    # A3 Ultra boots from Hyperdisk only: Persistent Disk is refused, as GCP refuses it
    monkeypatch.setattr(adapter, "boot_disk_type", lambda _: "pd-balanced")
    with pytest.raises(InvalidRequest) as err:
        gcp.launch(request(gpu="H200", spot=False))
    assert err.value.code == "badRequest"
    assert "[pd-balanced, a3-ultragpu-8g] features are not compatible" in str(err.value)
    assert emu.instances == {}
    # ... and N1 (here with a T4) takes no Hyperdisk
    monkeypatch.setattr(adapter, "boot_disk_type", lambda _: "hyperdisk-balanced")
    with pytest.raises(InvalidRequest, match=r"\[hyperdisk-balanced, n1-standard-4\]"):
        gcp.launch(request("n1-on-hyperdisk"))
    # the error is Google's shape: HTTP 400, reason badRequest
    monkeypatch.undo()
    body = sent_body(emu, gcp, "shape", gpu="H200", spot=False)
    body["disks"][0]["initializeParams"]["diskType"] = f"zones/{ZONE}/diskTypes/pd-ssd"
    status, answer = post(emu, body)
    assert status == 400 and answer["error"]["errors"][0]["reason"] == "badRequest"
    # without a diskType an A3 gets the series' default, Hyperdisk Balanced
    del body["disks"][0]["initializeParams"]["diskType"]
    assert post(emu, body)[0] == 200


def test_full_and_partial_resource_urls_are_both_accepted(
    emu: GCPEmulator, gcp: GCPProvider
) -> None:
    body = sent_body(emu, gcp, "partial")
    api = "https://www.googleapis.com/compute/v1"
    zone_path = f"projects/{emu.project}/zones/{ZONE}"
    body["machineType"] = f"{api}/{zone_path}/machineTypes/n1-standard-4"
    body["guestAccelerators"][0]["acceleratorType"] = f"{zone_path}/acceleratorTypes/{T4}"
    body["disks"][0]["initializeParams"]["diskType"] = f"{api}/{zone_path}/diskTypes/pd-balanced"
    assert post(emu, dict(body, name="full-urls"))[0] == 200
    stored = emu.instance(ZONE, "full-urls")
    assert (
        stored is not None
        and stored["machineType"] == f"{api}/{zone_path}/machineTypes/n1-standard-4"
    )
    # a URL naming another zone than the request's is refused
    body["machineType"] = f"projects/{emu.project}/zones/us-central1-b/machineTypes/n1-standard-4"
    status, answer = post(emu, dict(body, name="other-zone"))
    assert status == 400 and "Machine type does not exist" in answer["error"]["message"]


def test_at_most_four_t4_on_an_n1_machine(emu: GCPEmulator, gcp: GCPProvider) -> None:
    four = gcp.launch(request("four-t4", instance_type="n1-standard-16", gpu_count=4))
    assert four.state is MachineState.RUNNING
    with pytest.raises(InvalidRequest) as err:
        gcp.launch(request("eight-t4", instance_type="n1-standard-16", gpu_count=8))
    assert err.value.code == "invalid"
    assert "acceleratorCount': '8'" in str(err.value) and "one of [1, 2, 4]" in str(err.value)
    # eight V100 are a valid N1 shape
    v100 = replace(
        request("eight-v100"),
        instance_type="n1-standard-16",
        gpu="V100",
        gpu_count=8,
        accelerator="nvidia-tesla-v100",
    )
    assert gcp.launch(v100).state is MachineState.RUNNING


# --- state ----------------------------------------------------------------------------------


def test_preempted_and_stopped_are_both_terminated_on_the_wire_told_apart_by_operation(
    emu: GCPEmulator, gcp: GCPProvider
) -> None:
    taken = gcp.launch(request("taken-back"))
    stopped = gcp.launch(request("user-stopped"))
    emu.preempt(ZONE, taken.name)
    gcp.stop(stopped.ref)

    # GCP reports both as TERMINATED; the preempted operation tells them apart
    assert emu.instance(ZONE, taken.name)["status"] == "TERMINATED"
    assert emu.instance(ZONE, stopped.name)["status"] == "TERMINATED"
    got = gcp.get(taken.ref)
    assert got.state is MachineState.PREEMPTED and got.state_reason == "compute.instances.preempted"
    assert gcp.get(stopped.ref).state is MachineState.STOPPED


def test_stop_discards_local_ssd_and_a_deleted_machine_cannot_be_stopped(
    emu: GCPEmulator, gcp: GCPProvider
) -> None:
    inst = gcp.launch(request(spot=False))
    gcp.stop(inst.ref)
    assert emu.calls("POST", "/stop")[0].query["discardLocalSsd"] == "true"
    gcp.terminate(inst.ref)
    with pytest.raises(NotFound):
        gcp.stop(inst.ref)
    # a lookup by numeric id works like one by name
    other = gcp.launch(request("by-id"))
    assert gcp.get(InstanceRef(id=other.id, region=other.region, zone=other.zone)).name == "by-id"


def test_list_managed_filters_by_our_label_on_the_server(
    emu: GCPEmulator, gcp: GCPProvider
) -> None:
    gcp.launch(request("ours-0"))
    emu.add_instance(ZONE, "not-ours", labels={"team": "web"})
    assert [i.name for i in gcp.list_managed()] == ["ours-0"]
    listing = [r for r in emu.requests if r.path.endswith("/aggregated/instances")]
    assert f'labels.{TAG_MANAGED_BY} = "provisioner"' in listing[0].query["filter"]


# --- check ----------------------------------------------------------------------------------


@pytest.fixture
def no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    remove_credentials(monkeypatch, tmp_path)
    return tmp_path


def test_check_with_a_missing_key_file_names_it(
    no_credentials: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = no_credentials / "key.json"
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(missing))
    result = GCPProvider({"project": "p"}).check()
    assert not result.ok and str(missing) in result.message and "\n" not in result.message


def test_import_loads_no_sdk() -> None:
    code = (
        "import sys, providers.gcp; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('google', 'requests')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "[]"


# --- prices ---------------------------------------------------------------------------------


def test_fetch_offers_from_the_billing_catalog(
    emu: GCPEmulator, gcp: GCPProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROVISIONER_GCP_API_KEY", emu.billing_api_key)
    offers = gcp.fetch_offers()
    by = {(o.zone, o.instance_type, o.gpu, o.gpu_count): o for o in offers}

    # SkyPilot's worked examples: host vCPU+RAM SKUs + GPU SKU
    a100 = by[("us-central1-a", "a2-highgpu-1g", "A100", 1)]
    assert a100.price == Decimal("3.67339") and a100.gpu == "A100" and a100.gpu_memory_gb == 40
    assert (a100.vcpus, a100.memory_gb, a100.currency, a100.accelerator) == (12, 85, "USD", "")
    assert a100.spot_price is not None and a100.spot_price < a100.price
    assert by[("us-central1-a", "g2-standard-4", "L4", 1)].price == Decimal("0.70683")
    t4 = by[("us-central1-a", "n1-standard-4", "T4", 1)]
    assert t4.accelerator == "nvidia-tesla-t4"
    assert t4.price == Decimal("0.54000")  # 0.19 host + 0.35 T4
    # the 8-GPU A100 costs 8 GPUs and 8x the host; Mega/vWS/commitment SKUs are not mixed in
    assert by[("us-central1-a", "a2-highgpu-8g", "A100", 8)].price == Decimal("29.38708")
    assert {o.gpu for o in offers} == {"A100", "A100-80GB", "H100", "H200", "L4", "T4", "V100"}
    # A2 Mega: the A2 host and 16 A100; A3 Mega: the A3 host and its own Mega GPU SKU; A3 Ultra:
    # its own host SKUs and H200s; each only in the zones listing its machine type
    assert by[("us-central1-a", "a2-megagpu-16g", "A100", 16)].price == Decimal(
        "55.73950"
    )  # 96 x 0.031611 + 1360 x 0.004237 + 16 x 2.933908
    mega = by[("us-central1-a", "a3-megagpu-8g", "H100", 8)]
    assert mega.price == Decimal("97.94011")  # 208 x 0.0295 + 1872 x 0.0017757 + 8 x 11.06
    ultra = by[("us-central1-b", "a3-ultragpu-8g", "H200", 8)]
    assert ultra.price == Decimal("92.48560")  # 224 x 0.0307 + 2952 x 0.0019 + 8 x 10
    assert (ultra.vcpus, ultra.memory_gb, ultra.gpu_memory_gb) == (224, 2952, 141)
    assert ("us-central1-a", "a3-ultragpu-8g", "H200", 8) not in by  # not listed there
    h100 = by[("us-central1-a", "a3-highgpu-1g", "H100", 1)]
    assert h100.price is None and h100.spot_price is not None  # Spot-only below 8 GPUs
    assert by[("us-central1-a", "a3-highgpu-8g", "H100", 8)].price is not None
    assert "europe-west4-b" in {o.zone for o in offers if o.gpu == "H100"}
    assert all(o.cloud == "gcp" and "Billing Catalog" in o.source for o in offers)

    pages = [r for r in emu.requests if r.path.endswith("/skus")]
    assert [r.query.get("pageToken") for r in pages] == [None, "1", "2"]
    assert all("key" not in r.query and r.headers["x-goog-api-key"] for r in pages)


def test_fetch_offers_honours_configured_zones_and_needs_a_key(
    emu: GCPEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROVISIONER_GCP_API_KEY", emu.billing_api_key)
    offers = provider(emu, zones=["europe-west4-a"]).fetch_offers()
    assert offers and {o.zone for o in offers} == {"europe-west4-a"}

    monkeypatch.setenv("PROVISIONER_GCP_API_KEY", "wrong-key")
    with pytest.raises(AuthError) as err:
        provider(emu).fetch_offers()
    assert "wrong-key" not in str(err.value)
    monkeypatch.delenv("PROVISIONER_GCP_API_KEY")
    with pytest.raises(AuthError, match="PROVISIONER_GCP_API_KEY"):
        provider(emu).fetch_offers()


# --- end to end: `up` fails over past a zone without capacity ---------------------------------


def up(emu: GCPEmulator, home: Path, clock, monkeypatch: pytest.MonkeyPatch, gpu: str, prepare):
    """Plan and `up` a spot ``gpu`` experiment on the emulator; ``prepare(candidates)`` runs
    between the two (to break the cloud where the plan would go). Returns the UpResult."""
    from provisioner import catalog, machines, planning
    from provisioner.app import App
    from provisioner.spec import Experiment
    from tests.conftest import make_settings

    options = {
        "project": emu.project,
        "endpoint": emu.endpoint,
        "pricing_endpoint": emu.endpoint,
        "anonymous": True,
        "retry_base_seconds": 0.001,
        "retry_max_seconds": 0.01,
    }
    settings = make_settings(home, clouds={"gcp": options})
    monkeypatch.setenv("PROVISIONER_GCP_API_KEY", emu.billing_api_key)
    catalog.refresh(settings, "gcp", GCPProvider(options).fetch_offers())
    experiment = Experiment(
        name="vision",
        project="vision",
        owner="ana@example.com",
        ssh_public_key=SSH_KEY,
        startup_script="#!/bin/bash\necho hi",
        resources={"gpu": gpu, "market": "spot", "clouds": ["gcp"], "disk_gb": 100},
    )
    app = App(settings, clock)
    try:
        prepare(planning.plan(app, experiment).candidates)
        return machines.up(app, experiment)
    finally:
        app.close()


def test_up_lands_in_the_next_zone_when_the_first_has_no_capacity(
    emu: GCPEmulator, home: Path, clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    zones: list[str] = []

    def prepare(candidates: list) -> None:
        zones.extend(c.offer.zone for c in candidates[:2])
        emu.exhaust(zones[0])  # the cheapest zone is out of stock

    result = up(emu, home, clock, monkeypatch, "A100:1", prepare)
    first, second = zones
    outcomes = [(a.where, a.outcome) for a in result.attempts]
    assert outcomes == [(f"gcp/{first}", "capacity"), (f"gcp/{second}", "launched")]
    [(zone, _)] = emu.instances
    assert zone == second != first
    [instance] = emu.instances.values()
    assert instance["labels"][TAG_MACHINE] == result.machine.id
    assert instance["scheduling"]["provisioningModel"] == "SPOT"
    assert instance["machineType"].endswith("/a2-highgpu-1g")


def test_up_moves_to_another_zone_when_the_catalog_s_zone_lacks_the_accelerator(
    emu: GCPEmulator, home: Path, clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    tried: list = []

    def prepare(candidates: list) -> None:
        tried.extend(candidates)
        emu.withdraw_accelerator(candidates[0].offer.zone, T4)  # the catalog is out of date

    result = up(emu, home, clock, monkeypatch, "T4:1", prepare)
    lacking = tried[0].offer.zone
    first, *rest = result.attempts
    # "capacity" blocks the zone (an "invalid" outcome would block nothing): any other T4 host
    # there is skipped, and the next candidate elsewhere launches
    assert (first.where, first.outcome) == (f"gcp/{lacking}", "capacity")
    assert "acceleratorTypes" in first.message
    assert all(a.outcome == "skipped" for a in rest if a.where == f"gcp/{lacking}")
    assert rest[-1].outcome == "launched"
    [(zone, _)] = emu.instances
    assert zone != lacking


# --- the first real run, through the CLI --------------------------------------------------------

NIGHTS_UNKNOWN_IDLE = """
name: nights
off_hours: {timezone: America/New_York, windows: [{days: mon-fri, start: "20:00", end: "08:00"}]}
idle: {gpu_util_below: 5, for_minutes: 30, unknown_counts_as_idle: true}
"""


@pytest.mark.slow  # an end-to-end run through the CLI's processes
@pytest.mark.parametrize(
    ("gpu", "machine", "disk"),
    [
        ("T4:1", "n1-standard-4", "pd-balanced"),
        ("H200:8", "a3-ultragpu-8g", "hyperdisk-balanced"),  # A3 Ultra boots from Hyperdisk
    ],
)
def test_first_real_run_through_the_cli_leaves_nothing_billed(
    emu: GCPEmulator,
    home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    gpu: str,
    machine: str,
    disk: str,
) -> None:
    """`catalog refresh`, `up`, a preemption, the sweep's recovery (the VM started again in
    place with its boot disk), a night's idle stop, `down`
    and `gc --terminate`, each through the real CLI against the emulator; then the emulator's
    own books: nothing billing, every machine reachable (external address, our rule admitting
    ssh_cidrs to our tag, the metadata key honoured in an OS Login project) on the boot disk its
    series takes, and no rule of ours left behind."""
    from datetime import UTC, datetime, timedelta

    from tests.conftest import run_cli, sandbox_experiment, write_settings, write_yaml

    emu.delete_firewall("default-allow-ssh")  # only our own rule may open port 22
    emu.project_metadata["enable-oslogin"] = "TRUE"  # the project turns OS Login on
    (tmp_path / "p.yaml").write_text(NIGHTS_UNKNOWN_IDLE)
    monkeypatch.setenv("PROVISIONER_GCP_API_KEY", emu.billing_api_key)
    gcp = {
        "project": emu.project,
        "endpoint": emu.endpoint,
        "pricing_endpoint": emu.endpoint,
        "anonymous": True,
        "regions": ["us-central1"],
        "ssh_cidrs": ["198.51.100.0/24"],
        "retry_base_seconds": 0.001,
        "retry_max_seconds": 0.01,
    }
    cfg = write_settings(home, clouds={"gcp": gcp}, policies=[str(tmp_path / "p.yaml")])
    experiment = sandbox_experiment("train", gpu=gpu, clouds=["gcp"])
    experiment["ssh_public_key"] = SSH_KEY
    spec = write_yaml(tmp_path / "train.yaml", experiment)
    noon = datetime(2026, 11, 6, 17, 0, tzinfo=UTC)  # Friday 12:00 in New York

    def cli(*args: str, at: datetime) -> dict:
        r = run_cli("--config", str(cfg), *args, "-o", "json", now=at)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def reachable(zone: str, name: str) -> bool:
        return (
            emu.reachable_on_22(zone, name, source="198.51.100.20")
            and not emu.reachable_on_22(zone, name, source="203.0.113.10")
            and emu.metadata_ssh_login(zone, name, "provisioner")
        )

    refreshed = run_cli("--config", str(cfg), "catalog", "refresh", "--cloud", "gcp", now=noon)
    assert refreshed.returncode == 0, refreshed.stderr
    # the emulator's addresses are not ours to connect to: `up` must not wait for SSH
    first = cli("up", str(spec), "--no-wait", at=noon)["machine"]
    [(zone, name)] = emu.instances
    assert reachable(zone, name)
    [boot_disk] = [d["source"] for d in emu.instances[(zone, name)]["disks"]]
    emu.preempt(zone, name)  # stopped (instanceTerminationAction STOP), its disk kept
    swept = cli("sweep", at=noon + timedelta(minutes=5))
    [restart] = [a for p in swept["passes"] for a in p["actions"]]
    assert (restart["action"], restart["done"]) == ("start", True)
    assert "started in place" in restart["why"]
    [(zone2, name2)] = emu.instances  # the same VM runs again, with the same boot disk
    again = emu.instances[(zone2, name2)]
    assert (again["id"], again["status"]) == (first["instance_id"], "RUNNING")
    assert [d["source"] for d in emu.instances[(zone, name)]["disks"]] == [boot_disk]
    assert reachable(zone2, name2)
    night = datetime(2026, 11, 7, 2, 0, tzinfo=UTC)  # Friday 21:00 in New York, no heartbeat
    swept = cli("sweep", at=night)
    [stop] = [a for p in swept["passes"] for a in p["actions"]]
    assert (stop["action"], stop["done"]) == ("stop", True)
    assert emu.instances[(zone2, name2)]["status"] == "TERMINATED"  # GCP's word for stopped
    cli("down", "train", at=night + timedelta(minutes=1))
    assert emu.instances == {}  # no instance, running or stopped, bills for its disk
    gc = cli("gc", "--terminate", "--yes", at=night + timedelta(minutes=2))
    assert gc["unused_network"] == {
        "gcp": [
            "firewall rule provisioner-allow-ssh-default (network default, tcp:22 to "
            "provisioner-ssh)"
        ]
    }
    assert [n for n in emu.firewalls if n.startswith("provisioner")] == []

    launches = [r.body for r in inserts(emu)]
    assert len(launches) == 1  # the machine, started again in place: no replacement
    for body in launches:
        [nic] = body["networkInterfaces"]
        assert [a["type"] for a in nic["accessConfigs"]] == ["ONE_TO_ONE_NAT"]
        assert body["tags"]["items"] == ["provisioner-ssh"]
        assert body["scheduling"]["provisioningModel"] == "SPOT"
        assert body["machineType"].endswith(f"/machineTypes/{machine}")
        [boot] = body["disks"]
        assert boot["initializeParams"]["diskType"].endswith(f"/diskTypes/{disk}")
    [rule_insert] = firewall_inserts(emu)
    assert rule_insert.body["sourceRanges"] == ["198.51.100.0/24"]
    assert rule_insert.body["targetTags"] == ["provisioner-ssh"]


def test_last_stop_timestamp_is_read_and_reconcile_bills_to_it(
    emu: GCPEmulator, home: Path, clock
) -> None:
    """lastStopTimestamp, written with GCP's Pacific offset, is when the VM was taken:
    `up` a T4 spot machine, preempt it, reconcile six hours later — usage closed at it."""
    from datetime import timedelta

    from sqlalchemy import select

    from provisioner import machines
    from provisioner.app import App
    from provisioner.models import Event, UsageInterval
    from provisioner.spec import Experiment
    from tests.conftest import make_settings, sandbox_experiment

    options = {
        "project": emu.project,
        "endpoint": emu.endpoint,
        "anonymous": True,
        "retry_base_seconds": 0.001,
        "zones": [ZONE],
    }
    app = App(make_settings(home, clouds={"gcp": options}), clock)
    try:
        exp = sandbox_experiment("train", gpu="T4:1", market="spot", clouds=["gcp"])
        t0 = clock.now()
        m = machines.up(app, Experiment.model_validate(exp)).machine
        clock.advance(timedelta(minutes=7))
        taken = clock.now()
        name = emu_name(emu, m.instance_id or "")
        emu.preempt(ZONE, name, at=taken)
        wire = emu.instance(ZONE, name)["lastStopTimestamp"]
        assert (
            wire
            == (taken - timedelta(hours=8)).replace(tzinfo=None).isoformat(timespec="milliseconds")
            + "-08:00"
        )
        clock.advance(timedelta(hours=6))
        (listed,) = app.provider("gcp").list_managed()
        assert (listed.state, listed.stopped_at) == (MachineState.PREEMPTED, taken)
        machines.reconcile(app)
        with app.db.session() as s:
            last = s.scalars(
                select(Event).where(Event.machine_id == m.id).order_by(Event.id.desc())
            ).first()
            compute = s.scalars(
                select(UsageInterval).where(
                    UsageInterval.machine_id == m.id, UsageInterval.kind == "compute"
                )
            ).one()
    finally:
        app.close()
    assert last is not None
    assert (last.kind, last.at, last.detail["at_source"]) == ("preempted", taken, "cloud")
    assert (compute.started_at, compute.ended_at) == (t0, taken)


def emu_name(emu: GCPEmulator, instance_id: str) -> str:
    (name,) = [n for (_, n), i in emu.instances.items() if str(i["id"]) == instance_id]
    return name
