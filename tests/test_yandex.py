"""The Yandex adapter, running the real ``yandexcloud`` SDK over TLS against the local gRPC
emulator (tests/emulators/yandex.py)."""

from __future__ import annotations

import datetime as dt
import email
import json
import subprocess
import sys
import uuid
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

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
    QuotaError,
    Throttled,
    VolumeRequest,
)
from providers.userdata import file_content
from providers.yandex.adapter import YandexProvider
from tests.contract.yandex import make_provider, running_emulator, tls_material, yc_env
from tests.emulators.yandex import (
    ACTIVE_OPERATIONS_LIMIT,
    DOCUMENTED_GPU_IMAGE,
    FOLDER,
    IAM_TOKEN,
    NOT_ENOUGH_RESOURCES,
    QUOTA_MESSAGES,
    YandexEmulator,
    sku,
)

GIB = 1 << 30
SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEmulatorKey user@host"


@pytest.fixture
def tls():
    return tls_material()


@pytest.fixture
def emu():
    with running_emulator() as emulator:
        yield emulator


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    return yc_env(monkeypatch)


def provider(emu: YandexEmulator, tls=None, **options) -> YandexProvider:
    return make_provider(emu, **options)


@pytest.fixture
def yc(emu, tls, env) -> YandexProvider:
    return provider(emu, tls)


def request(name: str = "exp-1", **kw) -> LaunchRequest:
    fields = {
        "name": name,
        "token": f"intent-{name}",
        "region": "ru-central1",
        "zone": "ru-central1-a",
        "instance_type": "gpu-standard-v3/8g-224c-952gb",
        "gpu": "A100-80GB",
        "gpu_count": 8,
        "spot": False,
        "disk_gb": 200,
        "user_data": "#!/bin/bash\necho training > /tmp/started\n",
        "ssh_public_key": SSH_KEY,
        "labels": {
            TAG_MANAGED_BY: "provisioner",
            TAG_MACHINE: name,
            TAG_PROJECT: "vision",
            TAG_OWNER: "Alice.Smith@Example.COM",
        },
    }
    return LaunchRequest(**(fields | kw))


# --- launch ------------------------------------------------------------------------------------

FAMILIES = [
    ("gpu-standard-v3/8g-224c-952gb", "ru-central1-a", (8, 224, 952)),  # 8×A100 80GB
    ("gpu-standard-v3/1g-28c-119gb", "ru-central1-b", (1, 28, 119)),  # 1×A100 80GB
    ("standard-v3-t4/1g-8c-32gb", "ru-central1-d", (1, 8, 32)),  # T4
    ("gpu-standard-v2/1g-8c-48gb", "ru-central1-a", (1, 8, 48)),  # V100
    ("gpu-standard-v3i/1g-18c-144gb", "ru-central1-d", (1, 18, 144)),  # Gen2 (Yandex's top GPU)
]


@pytest.mark.parametrize("spot", [True, False], ids=["preemptible", "regular"])
@pytest.mark.parametrize(("instance_type", "zone", "shape"), FAMILIES)
def test_launch_puts_the_whole_intent_on_the_wire(emu, yc, instance_type, zone, shape, spot):
    req = request(instance_type=instance_type, zone=zone, spot=spot, gpu_count=shape[0])
    inst = yc.launch(req)

    [call] = emu.calls("InstanceService.Create")
    wire = call.request
    assert call.metadata["authorization"] == f"Bearer {IAM_TOKEN}"
    assert uuid.UUID(call.metadata["idempotency-key"])
    assert wire.folder_id == FOLDER and wire.name == "exp-1" and wire.zone_id == zone
    assert wire.platform_id == instance_type.split("/")[0]
    gpus, cores, ram = shape
    assert (wire.resources_spec.gpus, wire.resources_spec.cores) == (gpus, cores)
    assert wire.resources_spec.memory == ram * GIB
    assert wire.resources_spec.core_fraction == 100
    assert wire.scheduling_policy.preemptible is spot
    # Yandex label rules: lowercase [a-z0-9_-]
    assert dict(wire.labels) == {
        "managed-by": "provisioner",
        "provisioner-machine": "exp-1",
        "provisioner-project": "vision",
        "provisioner-owner": "alice_smith_example_com",
    }
    assert wire.boot_disk_spec.disk_spec.size == 200 * GIB
    # the latest image of the family whose driver serves this platform (Yandex's GPU docs)
    platform = instance_type.split("/")[0]
    family = DOCUMENTED_GPU_IMAGE[platform]
    assert wire.boot_disk_spec.disk_spec.image_id == emu.images[("standard-images", family)]
    assert emu.gpu_driver_works(inst.id)
    assert wire.boot_disk_spec.auto_delete
    nic = wire.network_interface_specs[0]
    assert nic.subnet_id == emu.subnets[zone]
    assert nic.primary_v4_address_spec.HasField("one_to_one_nat_spec")
    assert wire.metadata["ssh-keys"] == f"provisioner:{SSH_KEY}"
    cloud_config = yaml.safe_load(wire.metadata["user-data"])
    assert wire.metadata["user-data"].startswith("#cloud-config\n")
    [script] = cloud_config["write_files"]
    assert "echo training > /tmp/started" in file_content(script)
    assert cloud_config["runcmd"] == [[script["path"]]]
    assert cloud_config["users"][1]["ssh_authorized_keys"] == [SSH_KEY]

    assert inst.state is MachineState.RUNNING
    assert inst.spot is spot
    assert inst.instance_type == instance_type
    assert (inst.region, inst.zone) == ("ru-central1", zone)
    assert inst.machine_id == "exp-1"
    assert inst.public_ip and inst.private_ip
    assert emu.rejected == []


def test_user_cloud_config_is_kept_beside_our_key(emu, yc):
    config = "#cloud-config\npackages: [htop]\n"
    yc.launch(request(user_data=config))
    wire = emu.calls("InstanceService.Create")[0].request
    parts = [
        p.get_payload(decode=True).decode()
        for p in email.message_from_string(wire.metadata["user-data"]).walk()
        if not p.is_multipart()
    ]
    ours, theirs = (yaml.safe_load(p) for p in parts)
    assert theirs == {"packages": ["htop"]}
    assert ours["users"][1]["ssh_authorized_keys"] == [SSH_KEY]
    assert wire.metadata["ssh-keys"] == f"provisioner:{SSH_KEY}"


def test_image_can_be_an_id_or_a_family(emu, yc):
    emu.images[("standard-images", "ubuntu-2204-lts-cuda")] = "fd8cudaimage00000001"
    emu.images[("standard-images", "custom")] = "fd8pinnedimage000001"
    yc.launch(request("a", image="ubuntu-2204-lts-cuda"))
    yc.launch(request("b", image="fd8pinnedimage000001"))
    a, b = (
        c.request.boot_disk_spec.disk_spec.image_id for c in emu.calls("InstanceService.Create")
    )
    assert (a, b) == ("fd8cudaimage00000001", "fd8pinnedimage000001")


def test_every_platform_boots_the_image_its_gpus_need_or_is_refused(emu, yc):
    """One image for every platform left A100 and T4i without a driver; a platform Yandex
    documents no image for is refused before any call unless the user names one."""
    from providers.yandex.prices import PLATFORMS

    for n, platform in enumerate(sorted(PLATFORMS)):
        gpus, cpus, ram = PLATFORMS[platform].shapes[0]
        req = request(f"p{n}", instance_type=f"{platform}/{gpus}g-{cpus}c-{ram}gb")
        req = replace(req, zone=sorted(PLATFORMS[platform].zones)[0])
        if platform not in DOCUMENTED_GPU_IMAGE:
            with pytest.raises(InvalidRequest, match="documents no GPU image") as err:
                yc.launch(req)
            assert err.value.code == "NoImage"
            continue
        inst = yc.launch(req)
        assert emu.gpu_driver_works(inst.id), platform
    wrong = yc.launch(request("wrong", instance_type="gpu-standard-v3/1g-28c-119gb",
                              image="ubuntu-2004-lts-gpu"))  # fmt: skip
    assert not emu.gpu_driver_works(wrong.id)  # what the emulator would catch


def test_a_shape_the_platform_does_not_have_is_refused_before_any_call(emu, yc):
    with pytest.raises(InvalidRequest, match="allowed shape"):
        yc.launch(request(instance_type="gpu-standard-v3/3g-84c-357gb"))
    with pytest.raises(InvalidRequest, match="<platform>"):
        yc.launch(request(instance_type="gpu-standard-v3/8"))
    assert emu.requests == []


def test_the_api_refusing_a_request_is_invalid_request(emu, yc):
    with pytest.raises(InvalidRequest) as err:
        yc.launch(request(image="fd8doesnotexist00001"))
    assert err.value.code == "INVALID_ARGUMENT"
    assert "not found" in str(err.value)
    emu.rejected.clear()  # refused on purpose


# --- errors ------------------------------------------------------------------------------------


def test_a_throttling_storm_is_ridden_out_without_a_second_machine(emu, yc):
    emu.throttle(2, methods={"InstanceService.Create"})  # the folder's active-operations limit
    unavailable = grpc.StatusCode.UNAVAILABLE
    emu.throttle(2, unavailable, "Service is unavailable", methods={"OperationService.Get"})
    inst = yc.launch(request())
    assert inst.state is MachineState.RUNNING
    assert len(emu.instances) == 1
    assert len(emu.calls("InstanceService.Create")) == 3
    assert len(emu.calls("OperationService.Get")) == 3


@pytest.mark.parametrize("in_call", [False, True], ids=["operation", "call"])
@pytest.mark.parametrize("code", ["RESOURCE_EXHAUSTED", "INTERNAL"])
def test_a_zone_without_stock_is_a_capacity_error_naming_the_zone(emu, yc, code, in_call):
    """Yandex documents the words ("Not enough resources"), not the code nor whether Create or
    its operation fails: each combination is a CapacityError, tried once, nothing left over."""
    emu.capacity_exhausted.add("ru-central1-a")
    emu.capacity_code = getattr(grpc.StatusCode, code)
    emu.capacity_in_call = in_call
    with pytest.raises(CapacityError) as err:
        yc.launch(request())
    assert err.value.code == code
    assert NOT_ENOUGH_RESOURCES in str(err.value) and "ru-central1-a" in str(err.value)
    assert len(emu.calls("InstanceService.Create")) == 1  # no retry: the next zone is tried
    assert emu.instances == {}


def test_a_preemptible_start_in_a_zone_without_stock_is_a_capacity_error(emu, yc):
    spot = yc.launch(request(spot=True))
    yc.stop(spot.ref)
    emu.capacity_exhausted.add(spot.ref.zone)
    with pytest.raises(CapacityError, match=NOT_ENOUGH_RESOURCES) as err:
        yc.start(spot.ref)
    assert spot.ref.zone in str(err.value)
    assert yc.get(spot.ref).state is not MachineState.RUNNING


@pytest.mark.parametrize("details", [False, True], ids=["text", "text+QuotaFailure"])
@pytest.mark.parametrize("quota", sorted(QUOTA_MESSAGES))
def test_a_used_up_quota_is_a_quota_error_at_once(emu, yc, quota, details):
    emu.quota_exceeded = quota
    emu.quota_details = details
    with pytest.raises(QuotaError) as err:
        yc.launch(request())
    assert err.value.code == "RESOURCE_EXHAUSTED" and err.value.scope == "region"
    assert QUOTA_MESSAGES[quota] in str(err.value)
    assert len(emu.calls("InstanceService.Create")) == 1  # not retried as a rate limit
    assert emu.instances == {}


def test_a_quota_failure_in_the_details_is_a_quota_error_whatever_the_text(emu, yc, monkeypatch):
    """The public yandex.cloud.quota.QuotaFailure detail alone is enough (whether Compute sends
    one is unconfirmed; the text here is deliberately one the adapter does not know)."""
    monkeypatch.setitem(QUOTA_MESSAGES, "compute.instanceGpus.count", "over the limit")
    emu.quota_exceeded = "compute.instanceGpus.count"
    emu.quota_details = True
    with pytest.raises(QuotaError, match="over the limit"):
        yc.launch(request())
    assert len(emu.calls("InstanceService.Create")) == 1


def test_the_active_operations_limit_is_retried_with_the_same_key(emu, yc):
    emu.throttle(3, methods={"InstanceService.Create"})
    assert emu._throttles[0].message == ACTIVE_OPERATIONS_LIMIT
    yc.launch(request())
    keys = {c.metadata["idempotency-key"] for c in emu.calls("InstanceService.Create")}
    assert len(emu.calls("InstanceService.Create")) == 4 and len(keys) == 1
    assert len(emu.instances) == 1


def test_an_unknown_resource_exhausted_is_retried_a_bounded_number_of_times(emu, tls, env):
    """RESOURCE_EXHAUSTED is documented as "the request limit exceeded": a text we do not know
    is retried like one, never forever, and never taken for capacity or a quota."""
    yc = provider(emu, tls, retry_attempts=3)
    emu.throttle(
        100, message="Something Yandex has not documented", methods={"InstanceService.Create"}
    )
    with pytest.raises(Throttled, match="Something Yandex has not documented"):
        yc.launch(request())
    assert len(emu.calls("InstanceService.Create")) == 3
    assert emu.instances == {}


# --- states ------------------------------------------------------------------------------------


def test_a_preemption_is_read_from_the_preempt_operation(emu, yc):
    spot = yc.launch(request("spot-1", spot=True))
    emu.preempt(spot.id)
    got = yc.get(spot.ref)
    assert got.state is MachineState.PREEMPTED and "PreemptInstance" in (got.state_reason or "")
    assert emu.calls("InstanceService.ListOperations")  # the history was read
    # the Instance has no stop time: the preempt operation's modified_at dates it
    [op] = [o.pb for o in emu._ops.values() if o.pb.description == "Preempt instance"]
    assert got.stopped_at == op.modified_at.ToDatetime(dt.UTC)


def test_a_preemption_missing_from_the_history_is_not_dated(emu, yc):
    spot = yc.launch(request(spot=True))
    emu.preempt(spot.id, record_operation=False)
    assert yc.get(spot.ref).stopped_at is None  # reconcile falls back to the agent's heartbeat


def test_a_preemption_missing_from_the_history_still_reads_preempted(emu, yc):
    """Whether Yandex lists the preemption or not, a machine that went down with no stop
    after its start was not stopped by anyone."""
    spot = yc.launch(request(spot=True))
    yc.stop(spot.ref)
    yc.start(spot.ref)
    emu.preempt(spot.id, record_operation=False)
    assert yc.get(spot.ref).state is MachineState.PREEMPTED


def test_a_repeated_stop_or_start_is_not_sent_again(emu, yc):
    inst = yc.launch(request())
    yc.stop(inst.ref)
    yc.stop(inst.ref)
    assert len(emu.calls("InstanceService.Stop")) == 1
    yc.start(inst.ref)
    yc.start(inst.ref)
    assert len(emu.calls("InstanceService.Start")) == 1


# --- listing -----------------------------------------------------------------------------------


def test_list_follows_next_page_token(emu, yc):
    ours = [yc.launch(request(f"m-{i}")).id for i in range(5)]
    emu.add_instance("bastion", labels={"team": "infra"})
    emu.add_instance("lookalike", labels={"managed-by": "terraform", TAG_MACHINE: "m-0"})
    emu.page_size_cap = 2
    assert sorted(i.id for i in yc.list_managed()) == sorted(ours)
    lists = emu.calls("InstanceService.List")
    assert len(lists) == 4  # 7 machines, 2 per page
    assert [c.request.page_token for c in lists][1:] == ["2", "4", "6"]


# --- check -------------------------------------------------------------------------------------


def test_check_without_a_folder_says_so(emu, tls, env):
    result = provider(emu, tls, folder_id=None).check()
    assert not result.ok and "YC_FOLDER_ID" in result.message


def service_account_key(path: Path) -> bytes:
    """Write an authorized-key JSON file as ``yc iam key create`` does; return its public key."""
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    key = {"id": "ajekey0001", "service_account_id": "ajesa00001", "private_key": pem.decode()}
    path.write_text(json.dumps(key))
    return private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def test_service_account_key_file_is_exchanged_for_an_iam_token(emu, tls, env, tmp_path):
    public = service_account_key(tmp_path / "sa.json")
    emu.service_account_keys["ajekey0001"] = ("ajesa00001", public)
    env.delenv("YC_IAM_TOKEN")
    env.setenv("YC_SERVICE_ACCOUNT_KEY_FILE", str(tmp_path / "sa.json"))

    result = provider(emu, tls).check()
    assert result.ok, result.message
    assert "service account key" in result.message
    [exchange] = emu.calls("IamTokenService.Create")
    assert exchange.request.jwt
    [listing] = emu.calls("InstanceService.List")
    assert listing.metadata["authorization"].startswith("Bearer t1.issued-")


def test_a_key_the_cloud_refuses_is_an_auth_error_in_one_line(emu, tls, env, tmp_path):
    service_account_key(tmp_path / "sa.json")  # never registered with the cloud
    env.delenv("YC_IAM_TOKEN")
    env.setenv("YC_SERVICE_ACCOUNT_KEY_FILE", str(tmp_path / "sa.json"))
    yc = provider(emu, tls)
    result = yc.check()
    assert not result.ok and "\n" not in result.message
    assert "UNAUTHENTICATED" in result.message
    with pytest.raises(AuthError):
        yc.launch(request())
    assert emu.calls("InstanceService.Create") == []


def test_oauth_token_works_and_is_flagged_as_deprecated(emu, tls, env):
    emu.oauth_tokens.add("y0_oauth")
    env.delenv("YC_IAM_TOKEN")
    env.setenv("YC_TOKEN", "y0_oauth")
    result = provider(emu, tls).check()
    assert result.ok and "deprecat" in result.message


def test_an_unreadable_key_file_is_reported_without_its_content(emu, tls, env, tmp_path):
    bad = tmp_path / "sa.json"
    bad.write_text("not json: PRIVATE-KEY-MATERIAL")
    env.delenv("YC_IAM_TOKEN")
    env.setenv("YC_SERVICE_ACCOUNT_KEY_FILE", str(bad))
    result = provider(emu, tls).check()
    assert not result.ok
    assert "YC_SERVICE_ACCOUNT_KEY_FILE" in result.message
    assert "PRIVATE-KEY-MATERIAL" not in result.message
    assert emu.requests == []


# --- prices ------------------------------------------------------------------------------------

PAST = dt.datetime(2022, 4, 13, tzinfo=dt.UTC)
OLDER = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
FUTURE = dt.datetime(2099, 1, 1, tzinfo=dt.UTC)
# RU_CLOUDS.md §1.4 table A (RUB/h incl. VAT, from 2022-04-13): name → (regular, preemptible)
RATES = {
    ("compute.vm.gpu.gpu-standard", "compute.vm.gpu.gpu-standard.preemptible"): ("249.52", "62.40"),
    ("compute.vm.cpu.c100", "compute.vm.cpu.c100.preemptible"): ("1.12", "0.34"),
    ("compute.vm.ram", "compute.vm.ram.preemptible"): ("0.39", "0.12"),
    ("compute.vm.gpu.gpu-standard.v2", "compute.vm.gpu.gpu-standard.preemptible.v2"): (
        "249.52",
        "62.40",
    ),
    ("compute.vm.cpu.c100.v2", "compute.vm.cpu.c100.preemptible.v2"): ("1.19", "0.32"),
    ("compute.vm.ram.v2", "compute.vm.ram.preemptible.v2"): ("0.31", "0.07"),
    ("compute.vm.gpu.gpu-standard.v3", "compute.vm.gpu.gpu-standard.preemptible.v3"): (
        "371.70",
        "148.68",
    ),
    (
        "compute.vm.cpu.c100.gpu-standard.v3",
        "compute.vm.cpu.c100.gpu-standard.preemptible.v3",
    ): ("0.90", "0.36"),
    ("compute.vm.ram.gpu-standard.v3", "compute.vm.ram.gpu-standard.preemptible.v3"): (
        "0.28",
        "0.11",
    ),
    ("compute.vm.gpu.standard.v3-t4", "compute.vm.gpu.standard.v3-t4.preemptible"): (
        "64.00",
        "16.00",
    ),
    ("compute.vm.cpu.c100.v3", "compute.vm.cpu.c100.preemptible.v3"): ("1.05", "0.29"),
    ("compute.vm.ram.v3", "compute.vm.ram.preemptible.v3"): ("0.28", "0.07"),
}


def billing_fixture() -> list:
    skus = []
    for (regular, preemptible), (r, p) in RATES.items():
        # an older price superseded, and an announced future one not yet in force
        skus.append(sku(regular, [(OLDER, "1.00"), (PAST, r), (FUTURE, "999.00")]))
        skus.append(sku(preemptible, [(PAST, p), (FUTURE, "999.00")]))
    skus.append(sku("compute.vm.ram.v3", [(PAST, "5.55")], currency="USD"))  # another currency
    skus.append(sku("storage.bucket.standard", [(PAST, "2.01")]))
    return skus


def test_fetch_offers_prices_every_shape_from_the_billing_skus(emu, yc):
    emu.skus = billing_fixture()
    emu.page_size_cap = 5
    offers = yc.fetch_offers()
    by = {(o.instance_type, o.zone): o for o in offers}

    # RU_CLOUDS.md §1.4 table C, computed there independently from the same rates
    expected = {
        "gpu-standard-v3/8g-224c-952gb": ("3441.76", "1374.80"),
        "gpu-standard-v3/1g-28c-119gb": ("430.22", "171.85"),
        "standard-v3-t4/1g-4c-16gb": ("72.68", "18.28"),
        "standard-v3-t4/1g-32c-128gb": ("133.44", "34.24"),
        "gpu-standard-v2/8g-64c-384gb": ("2191.36", "546.56"),
        "gpu-standard-v1/4g-32c-384gb": ("1183.68", "306.56"),
    }
    for instance_type, (price, spot) in expected.items():
        o = by[(instance_type, "ru-central1-a")]
        assert (o.price, o.spot_price) == (Decimal(price), Decimal(spot)), instance_type
        assert o.currency == "RUB" and o.cloud == "yandex" and o.region == "ru-central1"

    a100 = by[("gpu-standard-v3/8g-224c-952gb", "ru-central1-b")]
    assert (a100.gpu, a100.gpu_count, a100.gpu_memory_gb) == ("A100-80GB", 8, 80)
    assert (a100.vcpus, a100.memory_gb) == (224, Decimal(952))
    assert ("gpu-standard-v3/1g-28c-119gb", "ru-central1-d") not in by  # A100 is not sold in -d
    assert by[("standard-v3-t4/1g-8c-32gb", "ru-central1-d")].price == Decimal("81.36")
    gen2 = by[("gpu-standard-v3i/8g-180c-1440gb", "ru-central1-d")]
    assert gen2.price is None and gen2.spot_price is None  # its SKU names are not published
    assert len(emu.calls("SkuService.List")) == 6  # 26 SKUs, 5 per page
    assert all(c.request.currency == "RUB" for c in emu.calls("SkuService.List"))


def test_fetched_offers_feed_the_planner(emu, yc):
    from provisioner.money import Rates
    from provisioner.planner import plan
    from provisioner.spec import Experiment

    emu.skus = billing_fixture()
    experiment = Experiment.model_validate(
        {
            "name": "t4-job",
            "project": "vision",
            "owner": "alice",
            "resources": {"gpu": "T4:1", "market": "spot", "clouds": ["yandex"]},
        }
    )
    ranked = plan(experiment, yc.fetch_offers(), Rates("RUB", {}), enabled_clouds={"yandex"})
    best = ranked.candidates[0]
    assert best.offer.instance_type == "standard-v3-t4/1g-4c-16gb"
    assert best.price.amount == Decimal("18.28") and best.spot


# --- end to end ------------------------------------------------------------------------------


def yandex_app(emu, tls, home, clock):
    """An App whose yandex cloud is the emulator (TLS with the test's own CA)."""
    from provisioner.app import App
    from provisioner.settings import Settings

    options = {
        "folder_id": FOLDER,
        "endpoint": emu.endpoint,
        "root_certificates_file": str(tls[2]),
        "poll_seconds": 0,
        "retry_base_seconds": 0.001,
    }
    return App(Settings(home=home, clouds={"yandex": options}), clock)


def t4_run(market: str):
    """The experiment the end-to-end runs launch: one T4 on Yandex."""
    from provisioner.spec import Experiment

    return Experiment.model_validate(
        {
            "name": "t4-run",
            "project": "vision",
            "owner": "ana@example.com",
            "resources": {"gpu": "T4:1", "market": market, "clouds": ["yandex"]},
        }
    )


def test_up_fails_over_to_the_next_zone_when_the_first_is_out_of_capacity(
    emu, tls, env, home, clock
):
    from provisioner import machines
    from provisioner.spec import Experiment

    app = yandex_app(emu, tls, home, clock)
    experiment = Experiment.model_validate(
        {
            "name": "t4-run",
            "project": "vision",
            "owner": "ana@example.com",
            "resources": {"gpu": "T4:1", "market": "spot", "clouds": ["yandex"]},
            "startup_script": "python train.py",
        }
    )
    emu.capacity_exhausted.add("ru-central1-a")
    try:
        result = machines.up(app, experiment)
    finally:
        app.close()

    tried = [(a.where, a.outcome) for a in result.attempts]
    assert tried[0] == ("yandex/ru-central1-a", "capacity")
    assert tried[-1] == ("yandex/ru-central1-b", "launched")
    [inst] = emu.instances.values()
    assert inst.zone_id == "ru-central1-b" and inst.scheduling_policy.preemptible
    assert inst.labels[TAG_MACHINE] == result.machine.id
    keys = [c.metadata["idempotency-key"] for c in emu.calls("InstanceService.Create")]
    assert len(set(keys)) == 2  # each candidate its own token, so its own key


# --- packaging ---------------------------------------------------------------------------------


def test_importing_the_adapter_loads_no_sdk():
    code = (
        "import sys, providers.yandex; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('yandexcloud', 'grpc', 'yandex')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_preemption_recovery_and_down_leave_nothing_on_the_books(emu, tls, env, home, clock):
    """The first real run, on the emulator's own books: a preemptible T4 is taken back (Yandex
    stops it, its disk kept), the scheduler starts it again in place, the user downs it —
    nothing of ours is left, and the machine booted the image whose driver serves its GPUs."""
    from provisioner import machines
    from provisioner.jobs import recover

    app = yandex_app(emu, tls, home, clock)
    experiment = t4_run("spot")
    try:
        first = machines.up(app, experiment).machine
        assert emu.gpu_driver_works(first.instance_id)
        clock.advance(dt.timedelta(hours=2))
        emu.preempt(first.instance_id)
        machines.reconcile(app)
        clock.advance(dt.timedelta(minutes=5))
        disk = emu.instances[first.instance_id].boot_disk.disk_id
        done = recover.run(app)
        assert [(a.action, a.done) for a in done.actions] == [("start", True)]
        second = machines.find(app, "t4-run")
        assert (second.id, second.instance_id, second.status) == (
            first.id,
            first.instance_id,
            "running",
        )
        assert emu.gpu_driver_works(second.instance_id)
        assert set(emu.instances) == {first.instance_id}  # the same VM, its boot disk kept
        assert emu.instances[first.instance_id].boot_disk.disk_id == disk and len(emu.disks) == 1
        assert len(emu.calls("InstanceService.Create")) == 1
        machines.down(app, "t4-run")
    finally:
        app.close()
    assert emu.instances == {}


NIGHTS_UNKNOWN_IDLE = """
name: nights
off_hours: {timezone: Europe/Moscow, windows: [{days: mon-fri, start: "20:00", end: "08:00"}]}
idle: {gpu_util_below: 5, for_minutes: 30, unknown_counts_as_idle: true}
"""


@pytest.mark.slow  # an end-to-end run through the CLI's processes
def test_first_real_run_through_the_cli_leaves_nothing_billed(emu, tls, env, home, tmp_path):
    """`up`, a preemption (Yandex stops the VM), the sweep's recovery (started in place), a
    night's idle stop and
    `down`, each through the real CLI; then the emulator's own books. `down` deletes: no
    instance is left, stopped or not, and no disk. Every machine had a public (one-to-one NAT)
    address, SSH open through the network's default security group, and booted the image
    family Yandex documents for its platform."""
    import json
    from datetime import UTC, datetime, timedelta

    from tests.conftest import run_cli, sandbox_experiment, write_settings, write_yaml

    (tmp_path / "p.yaml").write_text(NIGHTS_UNKNOWN_IDLE)
    yandex = {
        "folder_id": FOLDER,
        "endpoint": emu.endpoint,
        "root_certificates_file": str(tls[2]),
        "zones": ["ru-central1-a"],
        "poll_seconds": 0,
        "retry_base_seconds": 0.001,
    }
    cfg = write_settings(home, clouds={"yandex": yandex}, policies=[str(tmp_path / "p.yaml")])
    spec = write_yaml(
        tmp_path / "train.yaml",
        {**sandbox_experiment("train", gpu="T4:1", clouds=["yandex"]), "ssh_public_key": SSH_KEY},
    )
    noon = datetime(2026, 11, 6, 9, 0, tzinfo=UTC)  # Friday 12:00 in Moscow

    def cli(*args: str, at: datetime) -> dict:
        r = run_cli("--config", str(cfg), *args, "-o", "json", now=at)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    first = cli("up", str(spec), "--no-wait", at=noon)["machine"]["instance_id"]
    assert emu.reachable(first) and emu.gpu_driver_works(first)
    emu.preempt(first)  # Yandex takes the preemptible VM back: STOPPED, its address released
    assert not emu.reachable(first)
    swept = cli("sweep", at=noon + timedelta(minutes=5))
    [restart] = [a for p in swept["passes"] for a in p["actions"]]
    assert (restart["action"], restart["done"]) == ("start", True)
    [second] = emu.instances  # the preempted one started again in place, with its disk
    assert second == first and emu.reachable(second) and emu.gpu_driver_works(second)
    assert len(emu.disks) == 1
    night = datetime(2026, 11, 6, 18, 0, tzinfo=UTC)  # Friday 21:00 in Moscow, no heartbeat
    swept = cli("sweep", at=night)
    [stop] = [a for p in swept["passes"] for a in p["actions"]]
    assert (stop["action"], stop["done"]) == ("stop", True)
    assert emu.billed() == list(emu.disks)  # stopped: only its disk bills
    cli("down", "train", at=night + timedelta(minutes=1))

    assert emu.instances == {} and emu.disks == {} and emu.billed() == []
    swept = cli("gc", at=night + timedelta(minutes=2))  # nothing of ours left to collect
    assert (swept["orphans"], swept["unused_network"], swept["not_asked"]) == ([], {}, {})
    creates = [c.request for c in emu.calls("InstanceService.Create")]
    assert len(creates) == 1  # the machine, started again in place: no replacement
    for create in creates:
        assert create.scheduling_policy.preemptible
        assert create.boot_disk_spec.auto_delete
        nic = create.network_interface_specs[0]
        assert nic.primary_v4_address_spec.HasField("one_to_one_nat_spec")
        assert not nic.security_group_ids  # the network's default group: SSH from anywhere
        image = create.boot_disk_spec.disk_spec.image_id
        assert emu.images[("standard-images", DOCUMENTED_GPU_IMAGE[create.platform_id])] == image


def test_ssh_through_the_default_security_group_follows_what_it_admits(emu, yc):
    """The emulator's default security group (documented: 22/TCP from 0.0.0.0/0) decides, and
    an edited one is honoured; a stopped VM has no public address until it starts again."""
    inst = yc.launch(request())
    assert emu.reachable(inst.id, source="203.0.113.7")
    emu.default_group_ssh_cidrs = ("198.51.100.0/24",)  # the user narrowed the default group
    assert not emu.reachable(inst.id, source="203.0.113.7")
    assert emu.reachable(inst.id, source="198.51.100.20")
    before = yc.get(inst.ref).public_ip
    yc.stop(inst.ref)
    assert yc.get(inst.ref).public_ip is None
    yc.start(inst.ref)
    after = yc.get(inst.ref).public_ip
    assert after and after != before  # a dynamic address is new after a stop


def test_narrowed_ssh_cidrs_get_our_group_made_once_kept_in_step_and_collected(emu, tls, env):
    """ssh_cidrs other than anywhere: the machine joins our labelled group (22/tcp from those,
    all egress) in its subnet's network, made once and found again by another process; a
    later change of ssh_cidrs rewrites the rule in one call; gc deletes the group once no
    instance is in it, and the next launch makes it again."""
    narrow = provider(emu, tls, ssh_cidrs=["198.51.100.0/24"])
    first = narrow.launch(request("exp-1"))
    [group] = emu.security_groups.values()
    assert (
        group.name == "provisioner-ssh-enpnet0001" and group.labels[TAG_MANAGED_BY] == "provisioner"
    )
    assert emu.reachable(first.id, source="198.51.100.9")
    assert not emu.reachable(first.id, source="203.0.113.7")
    assert emu.outbound_internet(first.id)
    provider(emu, tls, ssh_cidrs=["198.51.100.0/24"]).launch(request("exp-2"))
    assert len(emu.calls("SecurityGroupService.Create")) == 1
    assert emu.calls("SecurityGroupService.UpdateRules") == []  # unchanged: nothing sent

    changed = provider(emu, tls, ssh_cidrs=["192.0.2.10/32", "198.51.100.0/24"])
    third = changed.launch(request("exp-3"))
    assert len(emu.calls("SecurityGroupService.UpdateRules")) == 1
    for inst in (first.id, third.id):  # the machines already in the group follow it
        assert emu.reachable(inst, source="192.0.2.10")
        assert emu.reachable(inst, source="198.51.100.9")

    assert changed.unused_network() == []  # machines are in it
    for inst in list(emu.instances):
        changed.terminate(InstanceRef(id=inst, region="ru-central1"))
    [line] = changed.unused_network()
    assert group.id in line and "enpnet0001" in line
    assert provider(emu, tls).unused_network(remove=True) == [line]
    assert emu.security_groups == {}
    again = provider(emu, tls, ssh_cidrs=["198.51.100.0/24"]).launch(request("exp-4"))
    assert emu.reachable(again.id, source="198.51.100.9")
    assert len(emu.calls("SecurityGroupService.Create")) == 2


def test_anywhere_needs_no_group_of_ours(emu, yc):
    inst = yc.launch(request())
    assert emu.calls("SecurityGroupService.Create") == [] and emu.security_groups == {}
    assert emu.reachable(inst.id) and emu.outbound_internet(inst.id)
    assert yc.unused_network() == []


def test_a_restarted_machine_s_new_address_is_what_status_and_ssh_use(emu, tls, env, home, clock):
    """Yandex gives a stopped VM's one-to-one NAT address back and a new one on start: the
    state follows the cloud, so `provisioner ssh` does not knock on someone else's address."""
    from provisioner import machines

    app = yandex_app(emu, tls, home, clock)
    experiment = t4_run("reserved")
    try:
        machines.up(app, experiment)
        machines.reconcile(app)
        before = machines.find(app, "t4-run").public_ip
        clock.advance(dt.timedelta(hours=1))
        machines.stop(app, "t4-run")
        clock.advance(dt.timedelta(hours=1))
        machines.start(app, "t4-run")
        machines.reconcile(app)
        after = machines.find(app, "t4-run")
        cloud = yc_address(app, after.instance_id)
        assert before and cloud and cloud != before
        assert after.public_ip == cloud
        machines.down(app, "t4-run")
    finally:
        app.close()


def yc_address(app, instance_id: str) -> str | None:
    return app.provider("yandex").get(InstanceRef(id=instance_id, region="ru-central1")).public_ip


# --- volumes -----------------------------------------------------------------------------------


def volume_request(name: str = "data", zone: str = "ru-central1-a", **kw) -> VolumeRequest:
    fields = {
        "name": name,
        "token": f"vol-{name}",
        "region": "ru-central1",
        "zone": zone,
        "size_gb": 64,
        "labels": {TAG_MANAGED_BY: "provisioner", TAG_PROJECT: "vision"},
    }
    return VolumeRequest(**(fields | kw))


def test_a_volume_is_a_network_disk_in_the_zone_attached_read_write_by_its_id(emu, yc):
    machine = yc.launch(request())
    volume = yc.volumes.create(volume_request())
    [create] = emu.calls("DiskService.Create")
    sent = create.request
    assert (sent.folder_id, sent.zone_id, sent.type_id) == (FOLDER, "ru-central1-a", "network-ssd")
    assert sent.size == 64 * GIB and sent.name == "data"
    assert sent.labels[TAG_MANAGED_BY] == "provisioner" and sent.labels[TAG_PROJECT] == "vision"
    assert uuid.UUID(create.metadata["idempotency-key"])

    device = yc.volumes.device(volume, 0)
    yc.volumes.attach(volume.ref, machine.ref, 0)
    [attach] = emu.calls("InstanceService.AttachDisk")
    spec = attach.request.attached_disk_spec
    assert (spec.disk_id, spec.auto_delete, spec.mode) == (volume.id, False, spec.READ_WRITE)
    # the machine sees the device name Yandex reflects into /dev/disk/by-id as virtio-<name>
    assert device == f"/dev/disk/by-id/virtio-{spec.device_name}"
    [seen] = [d for d in emu.instances[machine.id].secondary_disks if d.disk_id == volume.id]
    assert seen.device_name == spec.device_name


def test_a_volume_is_found_by_name_when_the_idempotency_key_is_long_forgotten(emu, yc):
    first = yc.volumes.create(volume_request())
    emu._by_key.clear()  # Yandex keeps keys for a time it does not document
    again = yc.volumes.create(volume_request())
    assert again.id == first.id and len(emu.calls("DiskService.Create")) == 1
    [lookup, *_] = emu.calls("DiskService.List")
    assert lookup.request.filter == 'name = "data"'


def test_a_disk_of_that_name_made_for_something_else_is_never_taken(emu, yc):
    foreign = emu.add_disk(
        name="data", zone="ru-central1-a", size=GIB, type_id="network-hdd", labels={}
    )
    volume = yc.volumes.create(volume_request())
    assert volume.id != foreign.id and len(emu.calls("DiskService.Create")) == 1
    assert emu.disks[foreign.id]["pb"].size == GIB  # left as it was


def test_list_volumes_reads_every_page_and_keeps_only_ours(emu, yc):
    ours = [yc.volumes.create(volume_request(f"data-{i}")).id for i in range(3)]
    yc.launch(request())  # its boot disk is in the same list, unlabelled
    emu.add_disk(name="scratch", zone="ru-central1-b", size=GIB, type_id="network-hdd", labels={})
    emu.page_size_cap = 2
    assert sorted(v.id for v in yc.volumes.ours()) == sorted(ours)
    assert len([c for c in emu.calls("DiskService.List") if not c.request.filter]) == 3
    assert yc.volumes.ours(regions=["kz1"]) == []


def test_a_volume_kept_through_its_machine_deleted_bills_until_deleted(emu, yc):
    machine = yc.launch(request())
    volume = yc.volumes.create(volume_request())
    yc.volumes.attach(volume.ref, machine.ref, 0)
    yc.terminate(machine.ref)
    assert emu.instances == {} and list(emu.disks) == [volume.id]  # the boot disk went with it
    assert emu.billed() == [volume.id]
    yc.volumes.delete(volume.ref)
    assert emu.billed() == []
