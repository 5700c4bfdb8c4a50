"""Images that exist: `check` and `up` resolve the cloud's image as a launch would and say plainly
when it is missing, deprecated or obsolete. GCP, against the emulator's image families (Google's
Deep Learning VM family list, cited in tests/emulators/gcp.py)."""

from __future__ import annotations

import json
import re

import pytest

from providers.gcp import DEFAULT_IMAGE
from tests.conftest import sandbox_experiment, write_settings, write_yaml
from tests.emulators.gcp import DLVM_PROJECT, GCPEmulator

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

OLD_FAMILY = f"projects/{DLVM_PROJECT}/global/images/family/common-cu124-debian-11"


@pytest.fixture
def emu():
    with GCPEmulator() as emulator:
        yield emulator


def settings(emu: GCPEmulator, home, **gcp: object):
    options = {
        "project": emu.project,
        "endpoint": emu.endpoint,
        "pricing_endpoint": emu.endpoint,
        "anonymous": True,
        "regions": ["us-central1"],
        "retry_base_seconds": 0.001,
        "retry_max_seconds": 0.01,
        **gcp,
    }
    return write_settings(home, clouds={"gcp": options})


def check(cli, cfg) -> dict:
    r = cli("--config", str(cfg), "check", "-o", "json")
    return {c["cloud"]: c for c in json.loads(r.out)}


def test_the_default_gcp_image_is_a_current_family_that_resolves(cli, emu, home):
    assert DEFAULT_IMAGE.endswith("/family/common-cu128-ubuntu-2204-nvidia-570")
    gcp = check(cli, settings(emu, home))["gcp"]
    assert gcp["ok"], gcp["message"]
    assert "resolves to common-cu128-ubuntu-2204-nvidia-570-v" in gcp["message"]


def test_check_says_plainly_that_a_retired_family_no_longer_resolves(cli, emu, home):
    gcp = check(cli, settings(emu, home, image=OLD_FAMILY))["gcp"]
    assert not gcp["ok"]
    assert gcp["message"] == (
        f"gcp: image family common-cu124-debian-11 of project {DLVM_PROJECT} does not resolve "
        "(every image in it is deprecated, or it never existed): set clouds.gcp.image to a "
        f"current one, e.g. {DEFAULT_IMAGE}"
    )


def test_check_names_a_deprecated_image_and_its_replacement(cli, emu, home):
    emu.add_image("team-images", "cuda-old", state="DEPRECATED", replacement="cuda-new")
    gcp = check(cli, settings(emu, home, image="projects/team-images/global/images/cuda-old"))
    assert gcp["gcp"]["ok"]  # a deprecated image still launches, with GCP's warning
    assert "image cuda-old is DEPRECATED (use cuda-new)" in gcp["gcp"]["message"]


@pytest.mark.parametrize(
    ("image", "words"),
    [
        (OLD_FAMILY, "image family common-cu124-debian-11 of project"),
        ("projects/team-images/global/images/cuda-gone", "image cuda-gone is OBSOLETE"),
    ],
    ids=["retired-family", "obsolete-image"],
)
def test_up_refuses_an_image_gcp_would_not_launch_and_launches_nothing(
    cli, emu, home, tmp_path, image, words
):
    emu.add_image("team-images", "cuda-gone", state="OBSOLETE")
    cfg = settings(emu, home, image=image)
    spec = write_yaml(tmp_path / "e.yaml", sandbox_experiment("train", clouds=["gcp"]))
    r = cli("--config", str(cfg), "up", str(spec), "--no-wait")
    assert r.code != 0
    assert words in " ".join((r.out + r.err).split())
    assert "any of 1 candidate tried" in r.err  # a setting: the whole cloud is out, said once
    assert "Traceback" not in r.err
    assert emu.instances == {}  # nothing launched, nothing billing


def test_up_launches_from_the_default_family(cli, emu, home, tmp_path):
    spec = write_yaml(tmp_path / "e.yaml", sandbox_experiment("train", clouds=["gcp"]))
    r = cli("--config", str(cfg := settings(emu, home)), "up", str(spec), "--no-wait")
    assert r.code == 0, r.err
    [instance] = emu.instances.values()
    [boot] = [d for d in instance["disks"] if d.get("boot")]
    assert boot["initializeParams"]["sourceImage"] == DEFAULT_IMAGE
    assert cli("--config", str(cfg), "down", "train", "--yes").code == 0


# --- AWS: the DLAMI's public SSM parameter, then DescribeImages ---------------------------------


@pytest.fixture
def aws(monkeypatch):
    from tests.contract.aws import clean_emulator

    with clean_emulator(monkeypatch) as emulator:
        yield emulator


def test_aws_check_resolves_the_dlami_parameter_to_an_image_that_exists(aws):
    from tests.contract.aws import make_provider

    result = make_provider(aws).check()
    assert result.ok, result.message
    ami = aws.ubuntu_ami("us-east-1")  # what the emulator's parameter names
    assert re.search(rf"; image {ami} \(ubuntu/images/[^)]+\) in us-east-1$", result.message)


def test_aws_check_says_plainly_when_the_default_image_cannot_be_resolved(aws):
    from tests.contract.aws import make_provider
    from tests.emulators.aws import DLAMI_PARAMETER

    del aws.public_parameters[DLAMI_PARAMETER]  # the parameter is gone (the family retired)
    result = make_provider(aws).check()
    assert not result.ok
    assert result.message.startswith(
        f"aws: no default GPU image in us-east-1: SSM parameter {DLAMI_PARAMETER} could not be "
        "read; set images: {us-east-1: ami-…} in the aws settings"
    )


def test_aws_check_says_when_the_ami_named_in_settings_does_not_exist(aws):
    from tests.contract.aws import make_provider

    result = make_provider(aws, image="ami-0123456789abcdef0").check()
    assert not result.ok
    assert result.message.startswith(
        "aws: image ami-0123456789abcdef0 not found in us-east-1 (InvalidAMIID.NotFound): set image"
    )


# --- Yandex: ImageService.GetLatestByFamily ------------------------------------------------------


@pytest.fixture
def yandex(monkeypatch):
    from tests.contract.yandex import running_emulator, yc_env

    yc_env(monkeypatch)
    with running_emulator() as emulator:
        yield emulator


def test_yandex_check_resolves_each_documented_gpu_family(yandex):
    from tests.contract.yandex import make_provider

    result = make_provider(yandex).check()
    assert result.ok, result.message
    assert result.message.endswith(
        "; images ubuntu-2004-lts-gpu → fd8gpuimage000000001, ubuntu-2204-lts-cuda-12-2 → "
        "fd8cuda122image00002, ubuntu-2004-lts-secureboot-cuda-12-2 → fd8sbcuda122image003"
    )


def test_yandex_check_says_plainly_when_a_family_is_gone(yandex):
    from tests.contract.yandex import make_provider

    del yandex.images[("standard-images", "ubuntu-2204-lts-cuda-12-2")]  # retired
    result = make_provider(yandex).check()
    assert not result.ok
    assert result.message == (
        "yandex: image family ubuntu-2204-lts-cuda-12-2 not found in standard-images (NOT_FOUND): "
        "set clouds.yandex.image to a family or image id that exists"
    )
