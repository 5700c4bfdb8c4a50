"""The Azure adapter, driving the unmodified azure-mgmt-compute / azure-mgmt-network SDKs against
the local ARM emulator (tests/emulators/azure.py)."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from providers.azure.adapter import AzureProvider
from providers.base import (
    TAG_MACHINE,
    TAG_MANAGED_BY,
    AuthError,
    CapacityError,
    ConfigurationError,
    InvalidRequest,
    LaunchRequest,
    MachineState,
    NotFound,
    QuotaError,
)
from providers.userdata import decoded
from tests.contract.azure import StaticCredential, make_provider
from tests.emulators.azure import AzureEmulator, price_row

ROOT = Path(__file__).resolve().parent.parent
SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBaVpdKzFzm8BSV3cWXoexq0jBn8Uv3dX2eQ0wq3 ana@laptop"
SCRIPT = "#!/bin/bash\nnvidia-smi > /var/log/gpu.txt\n"


@pytest.fixture
def emulator():
    with AzureEmulator() as emu:
        yield emu


@pytest.fixture
def provider(emulator: AzureEmulator) -> AzureProvider:
    return make_provider(emulator)


def request(
    name: str = "exp-a1b2c3",
    *,
    machine: str = "m-1",
    size: str = "Standard_NC24ads_A100_v4",
    gpu: str = "A100-80GB",
    spot: bool = True,
    region: str = "eastus",
    zone: str = "1",
    **kw: object,
) -> LaunchRequest:
    labels = {
        TAG_MANAGED_BY: "provisioner",
        TAG_MACHINE: machine,
        "provisioner-project": "vision",
        "provisioner-owner": "ana@example.com",
    }
    fields = {"disk_gb": 128, "user_data": SCRIPT, "ssh_public_key": SSH_KEY, **kw}
    return LaunchRequest(
        name=name,
        token=f"pv-{machine}",
        region=region,
        zone=zone,
        instance_type=size,
        gpu=gpu,
        gpu_count=1,
        spot=spot,
        labels=labels,
        **fields,
    )


def vm_puts(emu: AzureEmulator) -> list:
    return [r for r in emu.requests_to("PUT", "/virtualMachines/")]


# --- launch: every GPU family, spot and regular, and what went on the wire --------------------


@pytest.mark.parametrize(
    "size,gpu",
    [
        ("Standard_NC24ads_A100_v4", "A100-80GB"),
        ("Standard_ND96asr_v4", "A100"),
        ("Standard_NC40ads_H100_v5", "H100"),
        ("Standard_NC4as_T4_v3", "T4"),
    ],
)
@pytest.mark.parametrize("spot", [True, False], ids=["spot", "regular"])
def test_launch_puts_the_vm_the_request_describes(emulator, provider, size, gpu, spot):
    inst = provider.launch(request(size=size, gpu=gpu, spot=spot))

    assert inst.state is MachineState.RUNNING and inst.spot is spot
    assert (inst.region, inst.zone, inst.instance_type) == ("eastus", "1", size)
    assert inst.machine_id == "m-1" and inst.private_ip
    [put] = vm_puts(emulator)
    assert put.path.endswith("/virtualMachines/exp-a1b2c3")
    assert put.headers["if-none-match"] == "*"  # create-only: the name is the idempotency key
    body, props = put.body, put.body["properties"]
    assert body["tags"][TAG_MANAGED_BY] == "provisioner" and body["tags"][TAG_MACHINE] == "m-1"
    assert body["zones"] == ["1"]
    assert props["hardwareProfile"]["vmSize"] == size
    assert props["storageProfile"]["osDisk"]["diskSizeGB"] == 128
    assert props["storageProfile"]["imageReference"]["publisher"] == "microsoft-dsvm"
    assert decoded(base64.b64decode(props["osProfile"]["customData"])) == SCRIPT
    assert props["osProfile"]["linuxConfiguration"]["ssh"]["publicKeys"][0]["keyData"] == SSH_KEY
    if spot:
        assert props["priority"] == "Spot"
        assert props["evictionPolicy"] == "Deallocate"
        assert props["billingProfile"] == {"maxPrice": -1}
    else:
        assert props["priority"] == "Regular"
        assert "evictionPolicy" not in props and "billingProfile" not in props
    [nic_put] = emulator.requests_to("PUT", "/networkInterfaces/")
    assert nic_put.body["tags"][TAG_MACHINE] == "m-1"


def test_spot_cap_and_delete_on_eviction_reach_the_wire(emulator, provider):
    provider.launch(request(max_price=Decimal("1.25"), preemption_action="terminate", zone=""))

    [put] = vm_puts(emulator)
    assert put.body["properties"]["evictionPolicy"] == "Delete"
    assert put.body["properties"]["billingProfile"] == {"maxPrice": 1.25}
    assert "zones" not in put.body  # a regional VM when no zone is asked


def test_an_image_from_options_or_request_is_used(emulator):
    emulator.marketplace[("canonical", "ubuntu-24_04-lts", "server")] = ["24.04.202511050"]
    provider = make_provider(emulator, image="canonical:ubuntu-24_04-lts:server:latest")
    provider.launch(request())
    provider.launch(
        request(
            "other-vm",
            machine="m-2",
            image="/subscriptions/s/resourceGroups/g/"
            "providers/Microsoft.Compute/galleries/x/images/cuda/versions/1.0.0",
        )
    )

    first, second = (
        p.body["properties"]["storageProfile"]["imageReference"] for p in vm_puts(emulator)
    )
    assert first == {
        "publisher": "canonical",
        "offer": "ubuntu-24_04-lts",
        "sku": "server",
        "version": "latest",
    }
    assert second["id"].endswith("/images/cuda/versions/1.0.0")


def test_check_resolves_the_marketplace_image_and_says_when_it_is_gone(emulator, provider):
    said = provider.probe()
    assert "microsoft-dsvm:ubuntu-hpc:2204:latest resolves to version 22.04.2025111401" in said
    emulator.marketplace.clear()  # the offer withdrawn from the marketplace
    with pytest.raises(ConfigurationError, match="Artifact: VMImage was not found"):
        provider.probe()


def test_a_gone_image_fails_the_launch_before_anything_is_made(emulator):
    provider = make_provider(emulator, image="microsoft-dsvm:ubuntu-hpc:1804:latest")
    with pytest.raises(ConfigurationError, match=r"clouds\.azure\.image"):
        provider.launch(request())
    assert not emulator.vms and not emulator.nics and not emulator.public_ips
    pinned = make_provider(emulator, image="microsoft-dsvm:ubuntu-hpc:2204:22.04.2025090801")
    pinned.launch(request())  # a pinned version that exists: _Get, then the VM
    assert len(emulator.vms) == 1


def test_no_ssh_key_is_refused_before_anything_is_created(emulator, provider):
    with pytest.raises(InvalidRequest, match="SSH public key"):
        provider.launch(request(ssh_public_key=None))
    assert not emulator.requests_to("PUT", "/")


# --- idempotency ------------------------------------------------------------------------------


def test_same_intent_twice_gives_one_machine(emulator, provider):
    first = provider.launch(request())
    again = provider.launch(request())  # e.g. the first response was lost

    assert again.id == first.id and again.state is MachineState.RUNNING
    assert len(emulator.vms) == 1
    assert len(vm_puts(emulator)) == 2  # the second PUT was refused with 412 and adopted


def test_a_foreign_vm_with_the_same_name_is_refused_and_left_alone(emulator, provider):
    emulator.add_vm("exp-a1b2c3", tags={"team": "other"})

    with pytest.raises(InvalidRequest, match="already exists"):
        provider.launch(request())
    assert emulator.vm("exp-a1b2c3")["tags"] == {"team": "other"}
    assert not emulator.nics and not emulator.public_ips


# --- errors -----------------------------------------------------------------------------------


def test_a_capacity_failure_leaves_no_vm_nic_or_public_ip(emulator, provider):
    emulator.fail_capacity("eastus", "1", code="ZonalAllocationFailed")
    with pytest.raises(CapacityError):
        provider.launch(request(zone="1"))
    # the failed VM, its NIC and its public IP (billed while it exists) were removed
    assert not emulator.vms and not emulator.nics and not emulator.public_ips
    inst = provider.launch(request(zone="2"))  # same name, next zone
    assert inst.zone == "2" and emulator.vm("exp-a1b2c3")["zones"] == ["2"]


def test_a_failed_vm_left_by_an_earlier_attempt_is_replaced(emulator):
    provider = make_provider(emulator, retry_attempts=2)
    emulator.fail_capacity("eastus", code="AllocationFailed", times=1)
    emulator.throttle(2, method="DELETE")  # the clean-up after the failure is throttled away
    with pytest.raises(CapacityError):
        provider.launch(request())
    assert emulator.vm("exp-a1b2c3")["properties"]["provisioningState"] == "Failed"

    inst = provider.launch(request())  # the same intent again, capacity back

    assert inst.state is MachineState.RUNNING
    assert emulator.vm("exp-a1b2c3")["properties"]["provisioningState"] == "Succeeded"


def test_sku_not_available_on_the_put_is_a_capacity_error(emulator, provider):
    emulator.fail_capacity("eastus", code="SkuNotAvailable", synchronous=True)

    with pytest.raises(CapacityError) as err:
        provider.launch(request())
    assert err.value.code == "SkuNotAvailable"
    assert not emulator.nics and not emulator.public_ips  # refused before any VM existed


def test_quota_is_a_region_quota_error(emulator, provider):
    emulator.fail_quota("eastus", spot=True)

    with pytest.raises(QuotaError) as err:
        provider.launch(request())
    assert err.value.scope == "region"
    assert err.value.code == "OperationNotAllowed" and "LowPriorityCores" in str(err.value)
    assert not emulator.vms and not emulator.nics and not emulator.public_ips


@pytest.mark.parametrize(
    "code,status,kind",
    [
        ("AuthorizationFailed", 403, AuthError),
        ("InvalidParameter", 400, InvalidRequest),
        ("QuotaExceeded", 409, QuotaError),
        ("OverconstrainedAllocationRequest", 409, CapacityError),
    ],
)
def test_arm_error_codes_map_to_the_taxonomy(emulator, provider, code, status, kind):
    emulator.fail_next_create(code, f"{code} from ARM", status=status)

    with pytest.raises(kind) as err:
        provider.launch(request())
    assert err.value.code == code
    assert not emulator.nics and not emulator.public_ips  # made for the refused VM: gone


def test_a_throttling_storm_is_ridden_out_without_a_second_machine(emulator, provider):
    emulator.throttle(3, method="PUT", path_contains="/virtualMachines/")
    emulator.throttle(2, path_contains="/operations/")  # also while waiting on the operation

    inst = provider.launch(request())

    assert inst.state is MachineState.RUNNING
    assert len(emulator.vms) == 1
    assert len(vm_puts(emulator)) == 4  # 3 refused, 1 accepted; the wait resumed, no re-PUT


def test_the_emulator_refuses_a_malformed_vm(emulator, provider):
    """The emulator's strictness, through the SDK: a Regular VM with an eviction policy, and a
    misspelt property, are refused as ARM would."""
    from azure.core.exceptions import HttpResponseError

    compute, _ = provider._clients()
    size = {"hardwareProfile": {"vmSize": "Standard_NC4as_T4_v3"}}
    base = {"location": "eastus", "properties": size}
    for body in (
        {**base, "properties": {**base["properties"], "evictionPolicy": "Delete"}},
        {**base, "properties": {**base["properties"], "hardwareProfle": {}}},
    ):
        with pytest.raises(HttpResponseError) as err:
            compute.virtual_machines.begin_create_or_update("provisioner", "bad", body)
        assert err.value.status_code == 400


# --- networking: a public IP and our SSH group ------------------------------------------------


def test_launch_gives_a_vm_reachable_over_ssh_with_outbound_internet(emulator, provider):
    inst = provider.launch(request())

    assert inst.public_ip and inst.public_ip == emulator.public_ip_of("exp-a1b2c3")
    assert emulator.reachable("exp-a1b2c3", 22)  # from any internet address by default
    assert not emulator.reachable("exp-a1b2c3", 80)  # nothing else is opened
    assert emulator.outbound_internet("exp-a1b2c3")
    [ip_put] = emulator.requests_to("PUT", "/publicIPAddresses/exp-a1b2c3-ip")
    assert ip_put.body["sku"]["name"] == "Standard"
    assert ip_put.body["properties"]["publicIPAllocationMethod"] == "Static"
    assert ip_put.body["tags"] == dict(request().labels)
    [nic_put] = emulator.requests_to("PUT", "/networkInterfaces/")
    config = nic_put.body["properties"]["ipConfigurations"][0]["properties"]
    assert config["publicIPAddress"]["id"].endswith("/publicIPAddresses/exp-a1b2c3-ip")
    assert config["publicIPAddress"]["properties"] == {"deleteOption": "Delete"}
    group = nic_put.body["properties"]["networkSecurityGroup"]["id"]
    assert group.endswith("/networkSecurityGroups/provisioner-ssh-eastus")


def test_get_and_list_managed_read_the_public_ip_from_its_resource(emulator, provider):
    emulator.page_size = 1  # the public IP listing has pages too
    first = provider.launch(request())
    second = provider.launch(request("exp-d4e5f6", machine="m-2", zone="2"))

    assert provider.get(first.ref).public_ip == emulator.public_ip_of("exp-a1b2c3")
    listed = {i.name: i.public_ip for i in provider.list_managed()}
    assert listed == {"exp-a1b2c3": first.public_ip, "exp-d4e5f6": second.public_ip}
    assert first.public_ip != second.public_ip


def test_ssh_cidrs_decide_who_reaches_port_22(emulator):
    provider = make_provider(emulator, ssh_cidrs=["198.51.100.0/24", "192.0.2.10/32"])
    provider.launch(request())

    assert emulator.reachable("exp-a1b2c3", 22, source="198.51.100.9")
    assert emulator.reachable("exp-a1b2c3", 22, source="192.0.2.10")
    assert not emulator.reachable("exp-a1b2c3", 22, source="203.0.113.7")
    [group] = emulator.nsgs.values()
    [rule] = group["properties"]["securityRules"]
    assert rule["properties"]["sourceAddressPrefixes"] == ["198.51.100.0/24", "192.0.2.10/32"]


def test_the_ssh_group_is_created_once_per_region_and_found_again(emulator, provider):
    provider.launch(request())
    provider.launch(request("exp-d4e5f6", machine="m-2"))
    other = make_provider(emulator)  # another process, its own cache
    other.launch(request("exp-g7h8i9", machine="m-3"))
    other.launch(request("exp-j1k2l3", machine="m-4", region="westus2"))

    puts = emulator.requests_to("PUT", "/networkSecurityGroups/")
    assert [p.path.rsplit("/", 1)[-1] for p in puts] == [
        "provisioner-ssh-eastus",
        "provisioner-ssh-westus2",
    ]
    assert len(emulator.nsgs) == 2
    for group in emulator.nsgs.values():
        assert group["tags"] == {TAG_MANAGED_BY: "provisioner"}
    assert all(emulator.reachable(n) for n in ("exp-a1b2c3", "exp-g7h8i9", "exp-j1k2l3"))


def test_a_user_made_group_of_that_name_is_used_as_it_is(emulator, provider):
    _, network = provider._clients()
    body = {"location": "eastus", "properties": {"securityRules": []}}
    network.network_security_groups.begin_create_or_update(
        "provisioner", "provisioner-ssh-eastus", body
    ).result()

    provider.launch(request())

    assert len(emulator.requests_to("PUT", "/networkSecurityGroups/")) == 1  # the user's own
    assert not emulator.reachable("exp-a1b2c3")  # their rules, not ours


def test_changed_ssh_cidrs_rewrite_our_rule_on_the_next_launch(emulator):
    """ssh_cidrs edited after the first launch: the next process's launch rewrites our rule
    (that rule alone, by its own PUT) and the machine already in the group follows it; with
    settings unchanged nothing is sent."""
    make_provider(emulator, ssh_cidrs=["203.0.113.0/24"]).launch(request())
    assert emulator.reachable("exp-a1b2c3", source="203.0.113.7")

    make_provider(emulator, ssh_cidrs=["198.51.100.0/24", "192.0.2.10/32"]).launch(
        request("exp-d4e5f6", machine="m-2")
    )
    for vm in ("exp-a1b2c3", "exp-d4e5f6"):
        assert emulator.reachable(vm, source="198.51.100.9")
        assert emulator.reachable(vm, source="192.0.2.10")
        assert not emulator.reachable(vm, source="203.0.113.7")  # revoked
    [group] = emulator.nsgs.values()
    assert len(group["properties"]["networkInterfaces"]) == 2  # associations kept
    rule_puts = emulator.requests_to("PUT", "/securityRules/provisioner-ssh")
    assert len(rule_puts) == 1
    make_provider(emulator, ssh_cidrs=["198.51.100.0/24", "192.0.2.10/32"]).launch(
        request("exp-g7h8i9", machine="m-3")
    )
    assert len(emulator.requests_to("PUT", "/securityRules/")) == 1
    group_puts = emulator.requests_to("PUT", "/networkSecurityGroups/")
    assert [r.path.rsplit("/", 1)[-1] for r in group_puts if "/securityRules/" not in r.path] == [
        "provisioner-ssh-eastus"  # made once, never replaced whole
    ]


def test_gc_lists_and_removes_our_network_pieces_no_vm_uses(emulator, provider):
    """A crashed `up` left a public IP and a NIC without a VM; a person's own public IP sits in
    the same resource group. gc names (then removes) ours only; our NSG goes once no VM is in
    it, and the next launch makes it again."""
    from functools import partial

    kept = provider.launch(request())
    crashed = request("exp-crash1", machine="m-9")
    _, network = provider._clients()
    ip = provider._wait(
        partial(
            network.public_ip_addresses.begin_create_or_update,
            "provisioner",
            "exp-crash1-ip",
            provider._network.ip_body(crashed),
        )
    )
    provider._wait(
        partial(
            network.network_interfaces.begin_create_or_update,
            "provisioner",
            "exp-crash1-nic",
            provider._network.nic_body(crashed, ip.id, provider._network.ssh_group("eastus")),
        )
    )
    network.public_ip_addresses.begin_create_or_update(
        "provisioner",
        "my-bastion-ip",
        {
            "location": "eastus",
            "sku": {"name": "Standard"},
            "properties": {"publicIPAllocationMethod": "Static"},
        },
    ).result()
    emulator.page_size = 1  # every listing crosses pages

    lines = provider.unused_network()
    assert len(lines) == 2
    assert "network interface exp-crash1-nic (eastus" in lines[0]
    assert f"public IP exp-crash1-ip (eastus, {ip.ip_address}" in lines[1]
    assert make_provider(emulator).unused_network(remove=True) == lines
    assert sorted(p["name"] for p in emulator.public_ips.values()) == [
        "exp-a1b2c3-ip",
        "my-bastion-ip",
    ]
    assert [n["name"] for n in emulator.nics.values()] == ["exp-a1b2c3-nic"]
    assert emulator.reachable("exp-a1b2c3")  # the machine in use kept everything

    provider.terminate(kept.ref)
    [line] = provider.unused_network(remove=True)
    assert line.startswith("network security group provisioner-ssh-eastus (eastus")
    assert emulator.nsgs == {}
    provider.launch(request("exp-d4e5f6", machine="m-2"))  # the group is made again
    assert emulator.reachable("exp-d4e5f6")


def test_the_emulator_enforces_arms_networking_rules(emulator, provider):
    """Through the SDK: what ARM refuses (Standard + Dynamic, deleting a public IP or NSG in use,
    an NSG rule priority out of range) and what it keeps billing (a public IP whose deleteOption
    was set only in its own body outlives its VM)."""
    from azure.core.exceptions import HttpResponseError

    _, network = provider._clients()
    rg = "provisioner"

    def refused(code: str, begin, *args) -> None:
        with pytest.raises(HttpResponseError) as err:
            begin(rg, *args).result()
        assert err.value.status_code == 400 and err.value.error.code == code

    dynamic = {"location": "eastus", "sku": {"name": "Standard"}, "properties": {}}
    refused(
        "StandardSkuPublicIPAddressesMustBeStatic",
        network.public_ip_addresses.begin_create_or_update,
        "dyn-ip",
        dynamic,
    )
    bad_rule = {
        "name": "r",
        "properties": {"protocol": "Tcp", "access": "Allow", "direction": "Inbound"},
    }
    bad_rule["properties"]["priority"] = 50
    refused(
        "SecurityRuleInvalidPriority",
        network.network_security_groups.begin_create_or_update,
        "g",
        {"location": "eastus", "properties": {"securityRules": [bad_rule]}},
    )

    # deleteOption in the public IP's own body is not kept: the IP outlives its VM and bills.
    own = {
        "location": "eastus",
        "sku": {"name": "Standard"},
        "properties": {"publicIPAllocationMethod": "Static", "deleteOption": "Delete"},
    }
    leak = network.public_ip_addresses.begin_create_or_update(rg, "leak-ip", own).result()
    assert leak.delete_option is None  # not echoed, as ARM does
    inst = provider.launch(request())
    nic = network.network_interfaces.get(rg, "exp-a1b2c3-nic")
    nic.ip_configurations[0].public_ip_address = {"id": leak.id}  # no deleteOption on the NIC
    network.network_interfaces.begin_create_or_update(rg, "exp-a1b2c3-nic", nic).result()
    refused("PublicIPAddressCannotBeDeleted", network.public_ip_addresses.begin_delete, "leak-ip")
    refused(
        "InUseNetworkSecurityGroupCannotBeDeleted",
        network.network_security_groups.begin_delete,
        "provisioner-ssh-eastus",
    )
    emulator.console_delete(inst.name)  # the VM, and its NIC by deleteOption

    assert not emulator.nics
    left = {p["name"]: p["properties"] for p in emulator.public_ips.values()}
    assert sorted(left) == ["exp-a1b2c3-ip", "leak-ip"]  # both detached and still billing
    assert all("ipConfiguration" not in props for props in left.values())


# --- state: preempted vs stopped; stop / start / terminate -------------------------------------


def test_an_eviction_is_read_from_the_activity_log(emulator, provider):
    evicted = provider.launch(request("evicted-vm", machine="m-1"))
    emulator.evict("evicted-vm")
    got = provider.get(evicted.ref)
    assert got.state is MachineState.PREEMPTED and "evictSpotVM" in got.state_reason
    assert emulator.power_state("evicted-vm") == "deallocated"  # as a user stop would leave it


def test_when_a_vm_was_evicted_or_deallocated_is_read_from_the_wire(emulator, provider):
    """An eviction is dated by its Activity Log event, a deallocate by the instance view's
    ProvisioningState/succeeded time (PowerState statuses carry none)."""
    from datetime import datetime

    def at(text: str) -> datetime:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))

    evicted = provider.launch(request("evicted-vm", machine="m-1"))
    stopped = provider.launch(request("stopped-vm", machine="m-2", spot=False))
    emulator.evict("evicted-vm")
    provider.stop(stopped.ref)
    [evict] = [e for e in emulator.activity if "evictSpotVM" in e["operationName"]["value"]]
    [dealloc] = [e for e in emulator.activity if "deallocate" in e["operationName"]["value"]]
    assert provider.get(evicted.ref).stopped_at == at(evict["eventTimestamp"])
    got = {i.name: i for i in provider.list_managed()}
    assert (got["stopped-vm"].state, got["stopped-vm"].stopped_at) == (
        MachineState.STOPPED,
        at(dealloc["eventTimestamp"]),
    )
    assert got["evicted-vm"].stopped_at == at(evict["eventTimestamp"])
    provider.start(stopped.ref)
    assert provider.get(stopped.ref).stopped_at is None  # running: nothing stopped it


def test_eviction_through_the_sdk_simulation_reads_preempted(emulator, provider):
    inst = provider.launch(request())
    compute, _ = provider._clients()
    compute.virtual_machines.simulate_eviction("provisioner", "exp-a1b2c3")
    assert provider.get(inst.ref).state is MachineState.PREEMPTED


def test_an_evicted_delete_policy_vm_is_gone(emulator, provider):
    inst = provider.launch(request(preemption_action="terminate"))
    emulator.evict("exp-a1b2c3")

    with pytest.raises(NotFound):
        provider.get(inst.ref)
    assert provider.list_managed() == []
    # deleteOption=Delete took them along (the public IP's, as set on the NIC's reference)
    assert not emulator.nics and not emulator.disks and not emulator.public_ips


def test_stop_deallocates_and_terminate_takes_the_nic_public_ip_and_disk(emulator, provider):
    inst = provider.launch(request(spot=False))
    provider.stop(inst.ref)
    assert emulator.power_state("exp-a1b2c3") == "deallocated"  # not merely powered off
    assert emulator.requests_to("POST", "/deallocate")
    assert provider.get(inst.ref).public_ip == inst.public_ip  # static: kept while stopped
    provider.terminate(inst.ref)
    assert not emulator.vms and not emulator.nics and not emulator.disks
    assert not emulator.public_ips  # nothing of the machine's left billing
    assert len(emulator.nsgs) == 1  # the shared SSH group stays for the next machine


def test_start_without_capacity_is_a_capacity_error(emulator, provider):
    inst = provider.launch(request())
    provider.stop(inst.ref)
    emulator.fail_capacity("eastus", code="AllocationFailed")

    with pytest.raises(CapacityError):
        provider.start(inst.ref)
    assert provider.get(inst.ref).state is MachineState.STOPPED


def test_a_powered_off_vm_reads_still_billed_and_stop_deallocates_it(emulator, provider):
    inst = provider.launch(request())
    compute, _ = provider._clients()
    compute.virtual_machines.begin_power_off("provisioner", "exp-a1b2c3").result()
    got = provider.get(inst.ref)
    # powered off but allocated: Azure bills it until deallocated, so it is not yet stopped
    assert got.state is MachineState.STOPPING and "PowerState/stopped" in got.state_reason
    assert got.halted_billing and "exp-a1b2c3" in emulator.billed_vms()

    provider.stop(inst.ref)
    assert emulator.power_state("exp-a1b2c3") == "deallocated"
    after = provider.get(inst.ref)
    assert after.state is MachineState.STOPPED and not after.halted_billing


# --- listing ----------------------------------------------------------------------------------


def test_list_managed_in_a_missing_resource_group_is_empty(emulator):
    assert make_provider(emulator, resource_group="nothing-here").list_managed() == []


# --- check ------------------------------------------------------------------------------------


def test_check_without_credentials_imports_no_sdk():
    code = (
        "import sys, providers.azure.adapter as a; r = a.AzureProvider({}).check(); "
        "print(r.ok, any(m == 'azure' or m.startswith('azure.') for m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AZURE_", "MSI_", "IDENTITY_"))}
    env["PATH"] = "/nonexistent"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
    )
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_check_names_a_missing_resource_group(emulator):
    result = make_provider(emulator, resource_group="missing-rg").check()
    assert not result.ok and "missing-rg was not found" in result.message


def test_check_reports_refused_credentials(emulator):
    result = make_provider(emulator, credential=StaticCredential("stale")).check()
    assert not result.ok and "refused" in result.message
    assert "InvalidAuthenticationToken" in result.message and "\n" not in result.message


def test_importing_the_adapter_loads_no_sdk():
    code = (
        "import sys, providers.azure; "
        "print([m for m in sys.modules if m == 'azure' or m.startswith('azure.')])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stderr


# --- prices -----------------------------------------------------------------------------------


PRICE_ROWS = [
    price_row("eastus", "Standard_NC24ads_A100_v4", 3.673),
    price_row("eastus", "Standard_NC24ads_A100_v4", 0.4444, spot=True),
    price_row("eastus", "Standard_NC24ads_A100_v4", 0.7346, low_priority=True),
    price_row("eastus", "Standard_NC24ads_A100_v4", 4.407, windows=True),
    price_row("eastus", "Standard_NC24ads_A100_v4", 0.61, spot=True, windows=True),
    price_row("westus2", "Standard_NC24ads_A100_v4", 3.9),
    price_row("westus2", "Standard_NC24ads_A100_v4", 0.6159, spot=True),
    price_row("eastus", "Standard_NC40ads_H100_v5", 6.98),
    price_row("eastus", "Standard_NC40ads_H100_v5", 0.9981, spot=True),
    price_row("eastus", "Standard_ND96isr_H100_v5", 98.32),
    price_row("eastus", "Standard_NC4as_T4_v3", 0.526),
    price_row("eastus", "Standard_NC4as_T4_v3", 0.0526, spot=True),
    price_row("eastus", "Standard_NC4as_T4_v3", 0.752, windows=True),
    price_row("eastus", "Standard_D4s_v5", 0.192),  # not a GPU size
]


def test_fetch_offers_reads_linux_and_spot_prices_across_pages(emulator, provider):
    emulator.prices = list(PRICE_ROWS)
    emulator.prices_page_size = 2  # the A100 query in eastus has 5 rows: 3 pages

    offers = {(o.region, o.instance_type): o for o in provider.fetch_offers()}

    a100 = offers[("eastus", "Standard_NC24ads_A100_v4")]
    assert (a100.price, a100.spot_price) == (Decimal("3.673"), Decimal("0.4444"))
    assert (a100.gpu, a100.gpu_count, a100.gpu_memory_gb, a100.vcpus) == ("A100-80GB", 1, 80, 24)
    assert a100.zone == "" and a100.currency == "USD" and "Retail Prices" in a100.source
    assert offers[("westus2", "Standard_NC24ads_A100_v4")].spot_price == Decimal("0.6159")
    h100x8 = offers[("eastus", "Standard_ND96isr_H100_v5")]
    assert (h100x8.gpu, h100x8.gpu_count, h100x8.spot_price) == ("H100", 8, None)
    assert offers[("eastus", "Standard_NC4as_T4_v3")].price == Decimal("0.526")
    assert set(offers) == {
        ("eastus", "Standard_NC24ads_A100_v4"),
        ("westus2", "Standard_NC24ads_A100_v4"),
        ("eastus", "Standard_NC40ads_H100_v5"),
        ("eastus", "Standard_ND96isr_H100_v5"),
        ("eastus", "Standard_NC4as_T4_v3"),
    }
    crossed = [r for r in emulator.requests_to("GET", "/api/retail/prices") if "$skip" in r.query]
    assert crossed  # NextPageLink was followed


# --- end to end: `up` fails over past a region without capacity -------------------------------


def test_up_lands_in_the_next_region_when_the_first_has_no_capacity(emulator, home, clock):
    from provisioner import catalog, machines
    from provisioner.app import App
    from provisioner.spec import Experiment
    from tests.conftest import make_settings

    emulator.prices = list(PRICE_ROWS)
    options = {
        "subscription_id": emulator.subscription_id,
        "endpoint": emulator.base_url,
        "pricing_endpoint": emulator.base_url,
        "regions": ["eastus", "westus2"],
        "retry_base_seconds": 0.001,
        "retry_max_seconds": 0.002,
        "poll_seconds": 0.001,
    }
    settings = make_settings(home, clouds={"azure": options})
    provider = AzureProvider(options, credential=StaticCredential())
    catalog.refresh(settings, "azure", provider.fetch_offers())
    emulator.fail_capacity("eastus", code="AllocationFailed")  # the cheapest region is full
    experiment = Experiment(
        name="vision",
        project="vision",
        owner="ana@example.com",
        ssh_public_key=SSH_KEY,
        startup_script=SCRIPT,
        resources={"gpu": "A100-80GB:1", "market": "spot", "clouds": ["azure"], "disk_gb": 100},
    )
    app = App(settings, clock)
    app.use_provider("azure", provider)  # the emulator's credential, not DefaultAzureCredential
    try:
        result = machines.up(app, experiment)
    finally:
        app.close()

    outcomes = [(a.where, a.outcome) for a in result.attempts]
    assert outcomes == [("azure/eastus", "capacity"), ("azure/westus2", "launched")]
    [vm] = emulator.vms.values()
    assert vm.body["location"] == "westus2"
    assert vm.body["tags"][TAG_MACHINE] == result.machine.id


# --- the first real run, through the CLI -------------------------------------------------------

NIGHTS_UNKNOWN_IDLE = """
name: nights
off_hours: {timezone: America/New_York, windows: [{days: mon-fri, start: "20:00", end: "08:00"}]}
idle: {gpu_util_below: 5, for_minutes: 30, unknown_counts_as_idle: true}
"""


@pytest.fixture
def tls_emulator(tmp_path, monkeypatch):
    """The ARM emulator over TLS, also the Microsoft identity platform a service principal
    signs in to: the CLI in a subprocess gets its credential the way a user's does, through
    azure-identity's EnvironmentCredential (AZURE_AUTHORITY_HOST, REQUESTS_CA_BUNDLE)."""
    from tests.contract.azure import scrub_credentials
    from tests.emulators.azure import CLIENT_ID, CLIENT_SECRET, TENANT
    from tests.emulators.tls import self_signed_localhost

    cert, key = self_signed_localhost()
    ca = tmp_path / "emulator-ca.pem"
    ca.write_bytes(cert)
    bin_dir = tmp_path / "bin"  # no az / azd on the PATH
    bin_dir.mkdir()
    scrub_credentials(monkeypatch, bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}")
    with AzureEmulator(tls=(cert, key)) as emu:
        emu.cli_env = {
            "AZURE_CLIENT_ID": CLIENT_ID,
            "AZURE_CLIENT_SECRET": CLIENT_SECRET,
            "AZURE_TENANT_ID": TENANT,
            "AZURE_AUTHORITY_HOST": emu.base_url,
            "REQUESTS_CA_BUNDLE": str(ca),
        }
        yield emu


@pytest.mark.slow  # an end-to-end run through the CLI's processes
def test_first_real_run_through_the_cli_leaves_nothing_billed(tls_emulator, home, tmp_path):
    """`up`, a Spot eviction, the sweep's recovery (no room to start the VM again in place: a
    new one), a night's idle stop and `down`, each through
    the real CLI signed in as a service principal; then the emulator's own books: no VM left
    running or stopped-but-allocated, no NIC, public IP or disk after `down`, and every VM had
    a Standard static public IP, our NSG admitting 22 from ssh_cidrs, admin user provisioner."""
    import json
    from datetime import UTC, datetime, timedelta

    from tests.conftest import run_cli, sandbox_experiment, write_settings, write_yaml
    from tests.emulators.azure import TENANT

    emu = tls_emulator
    (tmp_path / "p.yaml").write_text(NIGHTS_UNKNOWN_IDLE)
    azure = {
        "subscription_id": emu.subscription_id,
        "endpoint": emu.base_url,
        "regions": ["eastus"],
        "ssh_cidrs": ["198.51.100.0/24"],
        "disable_instance_discovery": True,  # the emulator is an authority Microsoft never saw
        "retry_base_seconds": 0.001,
        "retry_max_seconds": 0.002,
        "poll_seconds": 0.001,
    }
    cfg = write_settings(home, clouds={"azure": azure}, policies=[str(tmp_path / "p.yaml")])
    spec = write_yaml(
        tmp_path / "train.yaml",
        {**sandbox_experiment("train", gpu="T4:1", clouds=["azure"]), "ssh_public_key": SSH_KEY},
    )
    noon = datetime(2026, 11, 6, 17, 0, tzinfo=UTC)  # Friday 12:00 in New York

    def cli(*args: str, at: datetime) -> dict:
        r = run_cli("--config", str(cfg), *args, "-o", "json", now=at, env=emu.cli_env)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def vm_name(machine: dict) -> str:
        return machine["instance_id"].rsplit("/", 1)[-1]

    first = cli("up", str(spec), "--no-wait", at=noon)["machine"]
    assert emu.reachable(vm_name(first), source="198.51.100.9")
    assert not emu.reachable(vm_name(first), source="203.0.113.7")  # not in ssh_cidrs
    emu.evict(vm_name(first))  # Azure takes the Spot VM back: deallocated, its disk kept
    emu.fail_capacity("eastus", code="AllocationFailed", times=1)  # no room to start it again
    swept = cli("sweep", at=noon + timedelta(minutes=5))
    [relaunch] = [a for p in swept["passes"] for a in p["actions"]]
    assert (relaunch["action"], relaunch["done"]) == ("relaunch", True)
    assert (
        "no room to start it in place" in relaunch["why"] and "AllocationFailed" in relaunch["why"]
    )
    assert len(emu.requests_to("POST", f"/virtualMachines/{vm_name(first)}/start")) == 1
    [replacement] = emu.vms.values()  # the evicted VM is deleted, not kept (its disk bills)
    assert replacement.power == "running"
    second = replacement.body["name"]
    assert second != vm_name(first) and emu.reachable(second, source="198.51.100.9")
    night = datetime(2026, 11, 7, 2, 0, tzinfo=UTC)  # Friday 21:00 in New York, no heartbeat
    swept = cli("sweep", at=night)
    [stop] = [a for p in swept["passes"] for a in p["actions"]]
    assert (stop["action"], stop["done"]) == ("stop", True)
    assert emu.power_state(second) == "deallocated"  # not merely powered off: that bills
    assert emu.billed_vms() == []
    cli("down", "train", at=night + timedelta(minutes=1))

    assert emu.vms == {} and emu.nics == {} and emu.public_ips == {} and emu.disks == {}
    signed_in = emu.requests_to("POST", f"/{TENANT}/oauth2/v2.0/token")
    assert signed_in and all(r.body["grant_type"] == "client_credentials" for r in signed_in)
    vm_puts = [r.body for r in emu.requests_to("PUT", "/virtualMachines/")]
    assert len(vm_puts) == 2  # the first VM and its replacement, nothing more
    for body in vm_puts:
        assert body["properties"]["osProfile"]["adminUsername"] == "provisioner"
        assert body["properties"]["priority"] == "Spot"
    for body in [r.body for r in emu.requests_to("PUT", "/publicIPAddresses/")]:
        assert body["sku"]["name"] == "Standard"
        assert body["properties"]["publicIPAllocationMethod"] == "Static"
    nics = [r.body for r in emu.requests_to("PUT", "/networkInterfaces/")]
    assert len(nics) == 2 and all(n["properties"]["networkSecurityGroup"] for n in nics)
    [group] = emu.nsgs.values()  # kept for the next machine; `gc` removes it when unused
    [rule] = group["properties"]["securityRules"]
    assert rule["properties"]["sourceAddressPrefix"] == "198.51.100.0/24"
    assert rule["properties"]["destinationPortRange"] == "22"
    swept = cli("gc", "--terminate", "--yes", at=night + timedelta(minutes=2))
    assert swept["orphans"] == [] and swept["not_asked"] == {}
    assert swept["unused_network"] == {
        "azure": [
            "network security group provisioner-ssh-eastus (eastus, resource group provisioner)"
        ]
    }
    assert emu.nsgs == {}


def test_a_service_principal_signs_in_through_azure_identity_or_is_refused(
    tls_emulator, monkeypatch
):
    """No credential object handed in: DefaultAzureCredential finds the service principal in
    the environment and signs in at AZURE_AUTHORITY_HOST; a wrong secret is refused there, in
    one line that does not repeat the secret."""
    emu = tls_emulator
    for name, value in emu.cli_env.items():
        monkeypatch.setenv(name, value)
    options = {
        "subscription_id": emu.subscription_id,
        "endpoint": emu.base_url,
        "disable_instance_discovery": True,
    }
    ok = AzureProvider(options).check()
    assert ok.ok and "service principal (environment)" in ok.message
    assert emu.requests_to("GET", "/v2.0/.well-known/openid-configuration")

    monkeypatch.setenv("AZURE_CLIENT_SECRET", "a-secret-since-rotated")
    refused = AzureProvider(options).check()
    assert not refused.ok and "AADSTS7000215" in refused.message
    assert "a-secret-since-rotated" not in refused.message and "\n" not in refused.message
    assert all("client_secret" not in (r.body or {}) for r in emu.requests)  # never recorded
