"""Volumes mount on every machine family the catalog offers: the device each family's guest
shows (AWS Xen ``/dev/xvdf`` against Nitro's NVMe link), the disk type each family takes (GCP
Hyperdisk on A3 Ultra), and a volume that did not mount never silent (provisioner-job refuses
the job, saying why)."""

from __future__ import annotations

import csv
import gzip
import json
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from providers import disks
from providers.aws import devices
from providers.aws.volumes import EbsVolumes
from providers.base import InstanceRef, InvalidRequest, Volume, VolumeRequest, VolumeState
from providers.gcp import disktypes
from provisioner import startup

CATALOG = Path(__file__).parent.parent / "provisioner" / "data" / "catalog"
VOLUME_ID = "vol-0123456789abcdef0"


def catalog_types(cloud: str) -> Counter[str]:
    with open(CATALOG / f"{cloud}.csv", newline="") as f:
        return Counter(row["instance_type"] for row in csv.DictReader(f))


# --- AWS: which families are Xen, from DescribeInstanceTypes ---------------------------------


def test_every_aws_type_in_the_catalog_is_xen_or_nvme_as_describe_instance_types_says():
    """moto ships a snapshot of DescribeInstanceTypes: where it knows a catalog type, our table
    agrees with its ``EbsInfo.NvmeSupport``; p3 (absent there) is Xen by the EC2 docs."""
    import moto

    snapshot = Path(moto.__file__).parent / "ec2" / "resources" / "instance_types.json.gz"
    described = json.loads(gzip.decompress(snapshot.read_bytes()))
    rows = catalog_types("aws")
    for itype in rows:
        info = described.get(itype)
        if info is not None:
            nvme = info.get("EbsInfo", {}).get("NvmeSupport")
            assert devices.is_xen(itype) == (nvme == "unsupported"), itype
    xen = {t: n for t, n in rows.items() if devices.is_xen(t)}
    assert set(xen) == {"p3.2xlarge", "p3.8xlarge", "p3.16xlarge"}
    assert sum(xen.values()) == 81  # the catalog rows whose volume shows as /dev/xvdf
    assert not devices.is_xen("p3dn.24xlarge")  # built on Nitro, unlike p3


def ebs(index: int = 0) -> Volume:
    return Volume(VOLUME_ID, "data-1", "us-east-1", "use1-az1", 10, VolumeState.AVAILABLE)


def test_the_device_follows_the_family_xvd_on_xen_the_nvme_link_on_nitro():
    assert EbsVolumes.device(ebs(), 0, "p3.2xlarge") == "/dev/xvdf"
    assert EbsVolumes.device(ebs(), 2, "p3.16xlarge") == "/dev/xvdh"
    nvme = "/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol0123456789abcdef0"
    for itype in ("p4d.24xlarge", "g5.xlarge", "g4dn.metal", "p5.48xlarge"):
        assert EbsVolumes.device(ebs(), 0, itype) == nvme


# --- the mount script on a fake device tree (bubblewrap: a tmpfs /dev of our making) ---------

needs_tools = pytest.mark.skipif(
    not shutil.which("bwrap")
    or not all(shutil.which(t) or os.path.exists(f"/sbin/{t}") for t in ("mkfs.ext4", "blkid")),
    reason="needs bubblewrap, mkfs.ext4 and blkid",
)


def fake_bin(tmp_path: Path) -> Path:
    """``mount`` and ``mountpoint`` that record instead of mounting (no root needed)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "mount").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/mounted\n')
    (bin_ / "mountpoint").write_text("#!/bin/sh\nexit 1\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    return bin_


def run_in_dev_tree(
    tmp_path: Path, script: str, tree: dict[str, str | None]
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with a /dev holding only ``tree``: path → None (a blank 8 MB disk image
    there) or a symlink target, as udev makes them."""
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    disk_dir = tmp_path / "devdisk"
    disk_dir.mkdir(exist_ok=True)
    argv = ["bwrap", "--bind", "/", "/", "--dev", "/dev", "--bind", str(disk_dir), "/dev/disk"]
    for path, target in tree.items():
        if target is None:
            image = images / Path(path).name
            image.write_bytes(b"\0" * 8 * 1024 * 1024)
            argv += ["--bind", str(image), path]
        else:
            assert path.startswith("/dev/disk/")
            link = disk_dir / path.removeprefix("/dev/disk/")
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(target)
    (tmp_path / "mount.sh").write_text(script)
    env = {
        **os.environ,
        "PATH": f"{fake_bin(tmp_path)}:/usr/sbin:/sbin:{os.environ['PATH']}",
        "PV_FSTAB": str(tmp_path / "fstab"),
        "PV_STATE": str(tmp_path / "state"),
        "PV_WAIT_SECONDS": "2",
    }
    return subprocess.run(
        [*argv, "bash", str(tmp_path / "mount.sh")], env=env, capture_output=True, text=True
    )


NITRO_TREE: dict[str, str | None] = {
    "/dev/nvme0n1": None,  # the root volume
    "/dev/nvme1n1": None,  # ours, by discovery order: named only by its by-id link
    "/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol0123456789abcdef0": "../../nvme1n1",
}
XEN_TREE: dict[str, str | None] = {"/dev/xvda": None, "/dev/xvdf": None}


@needs_tools
@pytest.mark.parametrize(
    ("itype", "tree", "device"),
    [
        ("p3.2xlarge", XEN_TREE, "/dev/xvdf"),
        ("p4d.24xlarge", NITRO_TREE, "/dev/nvme1n1"),
        ("g5.xlarge", NITRO_TREE, "/dev/nvme1n1"),
    ],
)
def test_the_rendered_mount_script_finds_the_volume_on_xen_and_on_nitro(
    tmp_path, itype, tree, device
):
    script = startup.mount_script([(EbsVolumes.device(ebs(), 0, itype), "/data")])
    r = run_in_dev_tree(tmp_path, script, tree)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "mounted").read_text().split("\n")[0] == f"{device} /data"
    [line] = (tmp_path / "fstab").read_text().splitlines()
    assert line.startswith("UUID=") and line.endswith(" /data auto defaults,nofail 0 2")
    state = tmp_path / "state"
    assert (state / "volumes").read_text() == "/data\n"
    assert not (state / "volumes.pending").exists() and not (state / "volumes.failed").exists()


@needs_tools
def test_a_volume_that_never_appears_is_said_and_recorded_not_silently_skipped(tmp_path):
    """The old script on a p3: it waited for the NVMe link that Xen never makes."""
    nitro_path = EbsVolumes.device(ebs(), 0, "p4d.24xlarge")
    r = run_in_dev_tree(tmp_path, startup.mount_script([(nitro_path, "/data")]), XEN_TREE)
    assert r.returncode == 0  # the boot goes on: the agent still gets installed after it
    assert "volume at /data is not mounted" in r.stderr and "did not appear in 2s" in r.stderr
    state = tmp_path / "state"
    assert (state / "volumes.failed").read_text().startswith(f"/data: its disk {nitro_path} did")
    assert not (state / "volumes.pending").exists() and not (tmp_path / "mounted").exists()


# --- provisioner-job: no job runs while a volume is not mounted ------------------------------


def run_job_out(tmp_path: Path, state: Path, job_env: str = "", **env_: str) -> tuple[str, str]:
    """``provisioner-job run`` of a job whose env file is ``job_env``: (its exit, its output)."""
    sup = tmp_path / "provisioner-job"
    sup.write_text(startup.supervisor_script())
    home = tmp_path / "home"
    job = home / ".provisioner" / "jobs" / "run"
    job.mkdir(parents=True, exist_ok=True)
    (job / "cmd").write_text("echo the job ran\n")
    (job / "env").write_text(job_env)
    env = {**os.environ, "PV_HOME": str(home), "PV_STATE": str(state), "PV_VOLUME_WAIT": "4"}
    env.update(env_)
    r = subprocess.run(
        ["sh", str(sup), "run", "run"], env=env, capture_output=True, text=True, timeout=60
    )
    return (job / "exit").read_text().strip(), r.stdout


def test_a_job_on_a_machine_whose_volume_did_not_mount_is_refused_with_the_reason(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "volumes").write_text(f"{tmp_path / 'data'}\n")
    (state / "volumes.failed").write_text(f"{tmp_path / 'data'}: its disk /dev/xvdf did not …\n")
    code, out = run_job_out(tmp_path, state)
    assert code == "97"
    assert f"the job did not run: no volume is mounted at {tmp_path / 'data'}" in out
    assert "its disk /dev/xvdf did not" in out and "the job ran" not in out


def test_a_job_runs_once_its_volumes_are_mounted_and_on_a_machine_without_volumes(tmp_path):
    state = tmp_path / "state"
    code, out = run_job_out(tmp_path, state)  # no volumes: nothing to wait for
    assert (code, out) == ("0", "the job ran\n")
    state.mkdir()
    (state / "volumes").write_text("/\n")  # a mount point on any machine
    code, out = run_job_out(tmp_path, state)
    assert (code, out) == ("0", "the job ran\n")


def test_a_job_waits_out_the_mounting_then_says_it_is_still_mounting(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "volumes.pending").write_text("")
    (state / "volumes").write_text(f"{tmp_path / 'data'}\n")
    code, out = run_job_out(tmp_path, state)
    assert code == "97" and "still mounting after 4s" in out


def test_a_job_started_before_the_mount_script_began_waits_for_its_volume(tmp_path):
    """SSH answers before cloud-init runs the startup script: the job's env names its volumes
    (PV_VOLUMES, as `up` writes it), so it waits for them to be mounted, then runs."""
    import shlex

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    mounted = tmp_path / "mounted-now"
    (bin_ / "mountpoint").write_text(f'#!/bin/sh\n[ -e "{mounted}" ]\n')
    (bin_ / "mountpoint").chmod(0o755)
    path = {"PATH": f"{bin_}:{os.environ['PATH']}", "PV_VOLUME_WAIT": "60"}
    job_env = f"export PV_VOLUMES={shlex.quote('/data' + chr(10) + '/ckpt')}\n"
    # the mount script, once cloud-init runs it: a process of its own, as on the machine
    later = subprocess.Popen(["sh", "-c", f"sleep 3 && touch {shlex.quote(str(mounted))}"])
    try:
        code, out = run_job_out(tmp_path, tmp_path / "no-state-yet", job_env, **path)
    finally:
        later.kill()
        later.wait()
    assert (code, out) == ("0", "the job ran\n")
    mounted.unlink()
    path["PV_VOLUME_WAIT"] = "2"  # never mounted: refused, saying so
    code, out = run_job_out(tmp_path, tmp_path / "no-state-yet", job_env, **path)
    assert code == "97"
    assert "no volume is mounted at /data /ckpt" in out and "mounted nothing in 2s" in out


# --- GCP: the disk type each series takes ----------------------------------------------------


def test_every_gcp_series_in_the_catalog_gets_a_disk_type_it_takes():
    rows = catalog_types("gcp")
    hyperdisk = {t: n for t, n in rows.items() if disks.volume_type("gcp", t) != "pd-balanced"}
    assert hyperdisk == {"a3-ultragpu-8g": 9}  # the catalog rows that take Hyperdisk only
    for itype in rows:
        kind = disks.volume_type("gcp", itype)
        assert disks.refusal("gcp", itype, kind) is None
    assert disks.volume_type("gcp", "a4-highgpu-8g") == "hyperdisk-balanced"
    why = disks.refusal("gcp", "a3-ultragpu-8g", "pd-balanced")
    assert why and "a3-ultragpu takes hyperdisk-balanced disks, not pd-balanced" in why
    assert disks.refusal("gcp", "n1-standard-8", "hyperdisk-balanced")
    assert disks.refusal("gcp", "a3-highgpu-8g", "hyperdisk-balanced") is None
    assert disks.refusal("gcp", "a3-megagpu-8g", "pd-balanced") is None
    # a volume recorded before types were kept was made pd-balanced
    assert disks.refusal("gcp", "a3-ultragpu-8g", "")
    assert disks.refusal("aws", "p3.2xlarge", "") is None
    assert disktypes.series("g2-standard-8") == "g2-standard"


def test_the_gcp_emulator_refuses_a_persistent_disk_on_a3_ultra_as_compute_engine_does():
    """Made of the type the series takes, it attaches; a pd-balanced volume on the same A3
    Ultra machine ends UNSUPPORTED_OPERATION, after the machine is up (what the planner now
    prevents)."""
    from tests.emulators.gcp import GCPEmulator
    from tests.test_gcp import ZONE, provider, request

    with GCPEmulator() as emu:
        gcp = provider(emu)
        machine = gcp.launch(request("h200-box", gpu="H200"))
        ref = InstanceRef(id=machine.id, region=machine.region, zone=ZONE, name=machine.name)

        def volume(name: str, disk_type: str) -> Volume:
            return gcp.volumes.create(
                VolumeRequest(
                    name=name,
                    token=f"pv-{name}",
                    region="us-central1",
                    zone=ZONE,
                    size_gb=10,
                    disk_type=disk_type,
                )
            )

        right = volume("hd-1", disks.volume_type("gcp", "a3-ultragpu-8g"))
        gcp.volumes.attach(right.ref, ref, 0)
        assert gcp.volumes.get(right.ref).attached_to == machine.id
        assert emu.disks[(ZONE, "hd-1")]["type"].endswith("/diskTypes/hyperdisk-balanced")
        wrong = volume("pd-1", "pd-balanced")
        with pytest.raises(InvalidRequest) as refused:
            gcp.volumes.attach(wrong.ref, ref, 1)
        assert "[pd-balanced, a3-ultragpu-8g] features are not compatible" in str(refused.value)
        assert gcp.volumes.get(wrong.ref).attached_to is None


# --- `up` through the AWS emulator: the script waits where the guest will see the disk ---------


def startup_text(wire: dict) -> str:
    """The user data RunInstances carried, as the machine reads it (base64; gzip; MIME parts)."""
    import base64
    import email

    raw = base64.b64decode(wire["UserData"])
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    message = email.message_from_bytes(raw)
    parts = [p.get_payload(decode=True) for p in message.walk() if not p.is_multipart()]
    if not message.is_multipart():
        parts = [raw]
    texts = [(gzip.decompress(b) if b[:2] == b"\x1f\x8b" else b).decode() for b in parts if b]
    for text in list(texts):  # a #cloud-config's files, as cloud-init writes them
        if text.startswith("#cloud-config"):
            import yaml

            for f in yaml.safe_load(text).get("write_files") or []:
                body = f.get("content", "").encode()
                if "b64" in f.get("encoding", "") or "base64" in f.get("encoding", ""):
                    body = base64.b64decode(body)
                if "gz" in f.get("encoding", ""):
                    body = gzip.decompress(body)
                texts.append(body.decode())
    return "\n".join(texts)


@pytest.mark.parametrize("itype", ["p3.2xlarge", "g4dn.xlarge"])
def test_up_mounts_the_volume_where_the_guest_of_its_family_sees_it(
    itype, home, clock, monkeypatch
):
    from decimal import Decimal

    from providers.base import Offer
    from provisioner import catalog, machines
    from provisioner.app import App
    from provisioner.spec import Experiment
    from tests.conftest import make_settings, sandbox_experiment
    from tests.contract.aws import clean_emulator

    gpu = {"p3.2xlarge": "V100", "g4dn.xlarge": "T4"}[itype]
    offer = Offer(
        "aws", "us-east-1", "use1-az6", itype, gpu, 1, 16, 8, Decimal(61),
        Decimal("3.06"), Decimal("0.9"), "USD", source="test",
    )  # fmt: skip
    with clean_emulator(monkeypatch) as emu:
        options = {"endpoint": emu.endpoint_url, "retry_base_seconds": 0.001}
        app = App(make_settings(home, clouds={"aws": options}), clock)
        try:
            catalog.refresh(app.settings, "aws", [offer])
            d = sandbox_experiment("train", gpu=f"{gpu}:1", market="spot", clouds=["aws"])
            d["volumes"] = [{"name": "ckpt", "size_gb": 10, "path": "/data"}]
            m = machines.up(app, Experiment.model_validate(d)).machine
        finally:
            app.close()
        [guest] = emu.guest_devices(m.instance_id or "").values()
        [wire] = emu.run_instances_requests
    if itype.startswith("p3"):  # Xen: no NVMe link would ever appear
        assert guest == "/dev/xvdf"
    else:
        assert guest.startswith("/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol")
    assert f"pv_mount '{guest}' '/data'" in startup_text(wire)


# --- `plan` on GCP: a volume that exists turns down the families that cannot take its type ----


def gcp_volume(app, disk_type: str | None, zone: str = "us-central1-b") -> None:
    """A live volume ``ckpt`` of project demo in ``zone``, recorded as made of ``disk_type``
    (None: recorded before types were kept)."""
    from decimal import Decimal

    from provisioner.models import VOLUME_MARKET, Machine, Volume
    from provisioner.schema import MachineStatus

    now = app.clock.now()
    spec = {"volume": {"name": "ckpt"}} | ({"disk_type": disk_type} if disk_type else {})
    with app.db.session() as s:
        s.add(
            Machine(
                id="vol1", name="volume:ckpt", project="demo", owner="ana@example.com",
                status=MachineStatus.TERMINATED, spec=spec, created_at=now, cloud="gcp",
                region="us-central1", zone=zone, market=VOLUME_MARKET, currency="USD",
                disk_gb=100, disk_rate=Decimal("0.01"),
            )
        )  # fmt: skip
        s.flush()
        s.add(
            Volume(
                id="vol1", project="demo", name="ckpt", owner="ana@example.com", cloud="gcp",
                region="us-central1", zone=zone, size_gb=100, token="pv-vol1",
                volume_id="ckpt-vol1", status="available", rate=Decimal("0.01"),
                currency="USD", created_at=now,
            )
        )  # fmt: skip


def gcp_plan(app, gpu: str):
    from provisioner.planning import plan
    from provisioner.spec import Experiment
    from tests.conftest import sandbox_experiment

    d = sandbox_experiment("exp", gpu=gpu, market="spot", clouds=["gcp"])
    d["volumes"] = [{"name": "ckpt", "size_gb": 100, "path": "/data"}]
    return plan(app, Experiment.model_validate(d))


@pytest.fixture
def gcp_app(home, clock):
    from provisioner.app import App
    from tests.conftest import make_settings

    app = App(make_settings(home, clouds={"gcp": {"project": "demo-project"}}), clock)
    yield app
    app.close()


@pytest.mark.parametrize("kind", ["pd-balanced", None])
def test_plan_refuses_a3_ultra_for_a_pd_balanced_volume_and_says_why(gcp_app, kind):
    gcp_volume(gcp_app, kind)
    p = gcp_plan(gcp_app, "H200:8")
    assert p.candidates == []
    reason = (
        "volume ckpt is pd-balanced: a3-ultragpu takes hyperdisk-balanced disks, not "
        "pd-balanced (Compute Engine docs"
    )
    [(why, n)] = [(w, n) for w, n in p.rejected.items() if w.startswith(reason)]
    assert n >= 1 and p.examples[why] == "gcp/us-central1-b a3-ultragpu-8g"


def test_a_hyperdisk_volume_keeps_a3_ultra_and_mega_and_turns_down_a2(gcp_app):
    gcp_volume(gcp_app, "hyperdisk-balanced")
    [c] = gcp_plan(gcp_app, "H200:8").candidates
    assert (c.offer.instance_type, c.offer.zone) == ("a3-ultragpu-8g", "us-central1-b")
    h100 = {c.offer.instance_type for c in gcp_plan(gcp_app, "H100:8").candidates}
    assert h100 == {"a3-highgpu-8g", "a3-megagpu-8g"}  # A3 High and Mega take both types
    a100 = gcp_plan(gcp_app, "A100:1")
    assert a100.candidates == []
    assert any(
        "a2-highgpu takes pd-balanced disks, not hyperdisk-balanced" in w for w in a100.rejected
    )


def test_up_on_a3_ultra_makes_a_hyperdisk_volume_that_attaches(home, clock, monkeypatch, tmp_path):
    """The volume is made before the machine, in the first candidate's zone, of the type that
    candidate's series takes: on A3 Ultra it attaches (pd-balanced would end
    UNSUPPORTED_OPERATION after the machine is up, billing)."""
    from decimal import Decimal

    from providers.base import Offer
    from provisioner import catalog, machines
    from provisioner.app import App
    from provisioner.spec import Experiment
    from tests.conftest import make_settings, sandbox_experiment
    from tests.contract.gcp import make_provider, remove_credentials
    from tests.emulators.gcp import GCPEmulator

    remove_credentials(monkeypatch, tmp_path)
    offer = Offer(
        "gcp", "us-central1", "us-central1-b", "a3-ultragpu-8g", "H200", 8, 141, 224,
        Decimal(2952), Decimal("84.8"), Decimal("30.5"), "USD", source="test",
    )  # fmt: skip
    with GCPEmulator() as emu:
        options = make_provider(emu).options.model_dump(mode="json", exclude_defaults=True)
        app = App(make_settings(home, clouds={"gcp": options}), clock)
        try:
            catalog.refresh(app.settings, "gcp", [offer])
            d = sandbox_experiment("big", gpu="H200:8", market="spot", clouds=["gcp"])
            d["volumes"] = [{"name": "ckpt", "size_gb": 100, "path": "/data"}]
            m = machines.up(app, Experiment.model_validate(d)).machine
        finally:
            app.close()
        [(zone, _)] = emu.disks
        [disk] = emu.disks.values()
    assert (m.instance_type, zone) == ("a3-ultragpu-8g", "us-central1-b")
    assert disk["type"].endswith("/diskTypes/hyperdisk-balanced") and disk["users"]


def test_a_cloud_job_is_told_its_volumes_and_a_sandbox_job_is_not(home, clock, monkeypatch):
    """`up` writes the experiment's volume paths into the job's env (PV_VOLUMES), which
    provisioner-job waits for; the sandbox runs jobs itself and gets none."""
    from types import SimpleNamespace

    from provisioner.app import App
    from provisioner.machines import jobs
    from provisioner.spec import Experiment
    from tests.conftest import make_settings, sandbox_experiment

    started: list[dict] = []

    class Recorder:
        def start_job(self, job_id, command, *, env, setup=None):
            started.append(dict(env))

    monkeypatch.setattr(jobs, "runner", lambda app, m: Recorder())
    monkeypatch.setattr(jobs, "_answers", lambda app, m: True)
    monkeypatch.setattr(jobs, "jobs_of", lambda app, m: {"run": None})
    monkeypatch.setattr(jobs, "record_event", lambda *a, **k: None)
    app = App(make_settings(home, clouds={"aws": {"retry_base_seconds": 0.001}}), clock)
    try:
        d = sandbox_experiment("train", clouds=["aws"]) | {"run": "python train.py"}
        d["volumes"] = [
            {"name": "ckpt", "size_gb": 10, "path": "/data"},
            {"name": "set", "size_gb": 10, "path": "/datasets"},
        ]
        d["env"] = {"A": "1"}
        for cloud in ("aws", "sandbox"):
            jobs.start_run(app, SimpleNamespace(cloud=cloud, id="m1", name="train"),
                           Experiment.model_validate(d))  # fmt: skip
    finally:
        app.close()
    assert started == [{"A": "1", "PV_VOLUMES": "/data\n/datasets"}, {"A": "1"}]
