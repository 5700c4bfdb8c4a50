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


def run_job_out(tmp_path: Path, state: Path) -> tuple[str, str]:
    sup = tmp_path / "provisioner-job"
    sup.write_text(startup.supervisor_script())
    home = tmp_path / "home"
    job = home / ".provisioner" / "jobs" / "run"
    job.mkdir(parents=True, exist_ok=True)
    (job / "cmd").write_text("echo the job ran\n")
    env = {**os.environ, "PV_HOME": str(home), "PV_STATE": str(state), "PV_VOLUME_WAIT": "4"}
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
    from tests.test_gcp import ZONE, provider, request
    from tests.emulators.gcp import GCPEmulator

    with GCPEmulator() as emu:
        gcp = provider(emu)
        machine = gcp.launch(request("h200-box", gpu="H200"))
        ref = InstanceRef(id=machine.id, region=machine.region, zone=ZONE, name=machine.name)

        def volume(name: str, disk_type: str) -> Volume:
            return gcp.create_volume(
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
        gcp.attach_volume(right.ref, ref, 0)
        assert gcp.get_volume(right.ref).attached_to == machine.id
        assert emu.disks[(ZONE, "hd-1")]["type"].endswith("/diskTypes/hyperdisk-balanced")
        wrong = volume("pd-1", "pd-balanced")
        with pytest.raises(InvalidRequest) as refused:
            gcp.attach_volume(wrong.ref, ref, 1)
        assert "[pd-balanced, a3-ultragpu-8g] features are not compatible" in str(refused.value)
        assert gcp.get_volume(wrong.ref).attached_to is None
