"""The GCP adapter, running the real google-cloud-compute REST transport against the local
Compute Engine emulator (tests/emulators/gcp.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
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
from tests.contract.gcp import make_provider as provider
from tests.contract.gcp import remove_credentials
from tests.emulators.gcp import GCPEmulator

ROOT = Path(__file__).resolve().parent.parent
SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEmulatorKey user@host"
ZONE = "us-central1-a"
FAMILIES = {  # gpu -> (instance type, GPUs, accelerator); a3 below 8 GPUs is Spot-only
    "A100": ("a2-highgpu-1g", 1, ""),
    "H100": ("a3-highgpu-8g", 8, ""),
    "T4": ("n1-standard-4", 1, "nvidia-tesla-t4"),
}


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
    assert body["networkInterfaces"][0].get("nicType") == ("GVNIC" if gpu == "H100" else None)
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


def test_spot_that_should_terminate_is_deleted_on_preemption(
    emu: GCPEmulator, gcp: GCPProvider
) -> None:
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
    "code", ["ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"]
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


def test_malformed_request_is_refused_by_the_emulator(emu: GCPEmulator, gcp: GCPProvider) -> None:
    # a2 machines cannot take attachable GPUs: the emulator applies GCP's rules
    with pytest.raises(InvalidRequest) as err:
        gcp.launch(request(gpu="A100", accelerator="nvidia-tesla-t4"))
    assert err.value.code == "invalid"
    # a field compute_v1.Instance does not know is refused too: replay a good body with one
    gcp.launch(request("good"))
    good = dict(inserts(emu)[-1].body, name="replayed")
    url = f"{emu.endpoint}/compute/v1/projects/{emu.project}/zones/{ZONE}/instances"

    def post(body: dict) -> int:
        data = json.dumps(body).encode()
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data, method="POST")) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert post({**good, "machineTyp": good["machineType"]}) == 400
    assert post(good) == 200


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
    assert {o.gpu for o in offers} == {"A100", "A100-80GB", "H100", "L4", "T4", "V100"}
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


def test_up_lands_in_the_next_zone_when_the_first_has_no_capacity(
    emu: GCPEmulator, home: Path, clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from provisioner import catalog, lifecycle, planning
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
        resources={"gpu": "A100:1", "market": "spot", "clouds": ["gcp"], "disk_gb": 100},
    )
    app = App(settings, clock)
    try:
        first, second = (c.offer.zone for c in planning.plan(app, experiment).candidates[:2])
        emu.exhaust(first)  # the cheapest zone is out of stock
        result = lifecycle.up(app, experiment)
    finally:
        app.close()

    outcomes = [(a.where, a.outcome) for a in result.attempts]
    assert outcomes == [(f"gcp/{first}", "capacity"), (f"gcp/{second}", "launched")]
    [(zone, _)] = emu.instances
    assert zone == second != first
    [instance] = emu.instances.values()
    assert instance["labels"][TAG_MACHINE] == result.machine.id
    assert instance["scheduling"]["provisioningModel"] == "SPOT"
    assert instance["machineType"].endswith("/a2-highgpu-1g")
