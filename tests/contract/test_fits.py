"""Every startup fits its cloud (docs/LIMITS.md).

The largest startup a cloud can get — the agent and its guard with the heartbeat endpoint (so
its token is in), the team's pull key, eight volumes' mount script, a preemption-notice action, a
16 KB user script and the SSH key — is built the way ``up`` builds it (``boot.startup_for``, which
``launch_intent`` itself calls) and launched through every cloud's real SDK against its
emulator, each of which enforces the cloud's documented limit (EC2's 16 KB: the AWS emulator's
RunInstances check, tests/emulators/aws.py, moto having none), with 500 bytes to spare at least.
What the cloud received decodes back (gunzip, base64) to the agent, its guard and the user's
script (the job supervisor is not in it: the first SSH call installs it). A startup past a
cloud's limit is refused by the emulator with the cloud's own error, and by ``plan``/``up``
before anything is launched.
"""

from __future__ import annotations

import base64
import email
import json
import random
import string
from collections.abc import Iterator
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

import providers
from providers.base import ProviderError
from providers.limits import check_startup, startup_size
from providers.userdata import decoded, file_content
from provisioner import boot, fits, startup
from provisioner.app import App
from provisioner.pyshrink import shrink
from provisioner.spec import load_experiment
from tests.conftest import make_settings, run_cli, write_settings, write_yaml
from tests.contract.harness import Harness
from tests.contract.test_contract import open_harness

CLOUDS = [c for c in providers.REGISTRY if providers.spec(c).limits is not None]
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFq3Ndq9dL1H4gQ1kP3xYyZbVn2sT7uW8eR0cM5aJ6hK ana@lab"
ENDPOINT = "https://provisioner-scheduler.research.example.com:8787"


def user_script(size: int = 16 * 1024) -> str:
    """A user's setup script of ``size`` bytes, as people write them for a GPU box: system
    packages, a pinned Python environment, dataset shards fetched and checked against their
    SHA-256 (hashes do not compress: a real script's hardest part), a training config written
    out, environment settings and a service. Varied shell text, not one line repeated: it
    compresses about as a real one does (~3x), so what fits here fits a user's own."""
    rnd = random.Random(16384)
    hexs = lambda n: "".join(rnd.choice("0123456789abcdef") for _ in range(n))  # noqa: E731
    apt = [
        "build-essential",
        "cmake",
        "ninja-build",
        "git",
        "git-lfs",
        "curl",
        "wget",
        "jq",
        "htop",
        "tmux",
        "unzip",
        "pigz",
        "libssl-dev",
        "libffi-dev",
        "libjpeg-dev",
        "libpng-dev",
        "libopenmpi-dev",
        "openmpi-bin",
        "nvtop",
        "python3-venv",
        "python3-dev",
        "libaio-dev",
        "numactl",
        "rsync",
        "aria2",
        "zstd",
        "pv",
        "ffmpeg",
        "sox",
    ]
    pip = [
        "torch",
        "torchvision",
        "torchaudio",
        "transformers",
        "datasets",
        "accelerate",
        "deepspeed",
        "peft",
        "bitsandbytes",
        "sentencepiece",
        "tokenizers",
        "safetensors",
        "einops",
        "xformers",
        "wandb",
        "tensorboard",
        "hydra-core",
        "omegaconf",
        "rich",
        "typer",
        "pyarrow",
        "pandas",
        "scikit-learn",
        "scipy",
        "numpy",
        "evaluate",
        "flash-attn",
        "triton",
        "ninja",
        "packaging",
        "huggingface-hub",
        "webdataset",
        "timm",
        "lightning",
    ]
    lines = [
        "#!/bin/bash",
        "# Setup for the vision-language pretraining runs (team: multimodal).",
        "set -euo pipefail",
        'log() { printf "%s [setup] %s\\n" "$(date -u +%FT%TZ)" "$*" '
        "| tee -a /var/log/setup.log; }",
        "export DEBIAN_FRONTEND=noninteractive",
        "log 'installing system packages'",
        "apt-get update -q",
        f"apt-get install -y -q --no-install-recommends {' '.join(apt)}",
        "python3 -m venv /opt/venv && . /opt/venv/bin/activate",
        "pip install --upgrade pip wheel setuptools",
    ]
    for name in pip:
        ver = f"{rnd.randint(0, 4)}.{rnd.randint(0, 40)}.{rnd.randint(0, 12)}"
        lines.append(f"pip install --no-cache-dir '{name}=={ver}'  # pinned {hexs(7)}")
    lines += [
        "mkdir -p /data/shards /data/cache /data/checkpoints",
        "fetch() {  # url sha256 dest",
        '  for try in 1 2 3 4 5; do curl -fsSL --retry 3 -o "$3.part" "$1" && break; '
        "sleep $((try * 7)); done",
        '  echo "$2  $3.part" | sha256sum -c - && mv "$3.part" "$3"',
        "}",
    ]
    i = 0
    while sum(len(x) + 1 for x in lines) < size - 2_500:
        split = rnd.choice(["train", "val", "laion-sub", "cc12m", "coco", "vqa", "ocr"])
        lines.append(
            f"fetch https://datasets.research.example.com/vlm/{split}/shard-{i:05d}.tar "
            f"{hexs(64)} /data/shards/{split}-{i:05d}.tar"
        )
        i += 1
    lines += [
        "cat > /opt/train/config.yaml <<'EOF'",
        "model: {name: vit-l-14-llm-7b, dtype: bfloat16, grad_checkpointing: true}",
        "optim: {lr: 2.0e-4, weight_decay: 0.05, betas: [0.9, 0.95], warmup_steps: 2000}",
        "data: {shards: /data/shards, batch_size: 256, workers: 12, shuffle_buffer: 20000}",
        "schedule: {steps: 120000, eval_every: 2000, save_every: 5000, keep_last: 3}",
        "logging: {project: vlm-pretrain, entity: multimodal, log_every: 50}",
        "EOF",
        "cat >> /etc/environment <<'EOF'",
        "NCCL_IB_DISABLE=0",
        "NCCL_SOCKET_IFNAME=ens",
        "NCCL_DEBUG=WARN",
        "HF_HOME=/data/cache/hf",
        "TORCH_CUDA_ARCH_LIST=8.0;8.6;9.0",
        "OMP_NUM_THREADS=8",
        "EOF",
        "cat > /etc/systemd/system/tensorboard.service <<'EOF'",
        "[Unit]",
        "Description=TensorBoard for the training runs",
        "After=network-online.target",
        "[Service]",
        "ExecStart=/opt/venv/bin/tensorboard --logdir /data/checkpoints --port 6006 --bind_all",
        "Restart=on-failure",
        "[Install]",
        "WantedBy=multi-user.target",
        "EOF",
        "systemctl daemon-reload && systemctl enable --now tensorboard.service",
        "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv "
        "| tee -a /var/log/setup.log",
        "log 'setup done'",
    ]
    text = "\n".join(lines) + "\n"
    while len(text) < size:  # to the byte: comments, as scripts end with notes
        text += "# " + "".join(rnd.choice(string.ascii_lowercase + " ") for _ in range(70)) + "\n"
    return text[:size]


def incompressible(size: int) -> str:
    """A script of ``size`` bytes that no compression shrinks (an embedded blob)."""
    rnd = random.Random(size)
    blob = base64.b64encode(bytes(rnd.getrandbits(8) for _ in range(size))).decode()
    return ("#!/bin/sh\n: " + blob)[:size]


@pytest.fixture
def app(home: Path, clock: Any) -> Iterator[App]:
    """Settings naming the endpoint agents report to: the token is in the startup."""
    clouds = {c: {} for c in CLOUDS}
    a = App(make_settings(home, clouds=clouds, scheduler={"endpoint_url": ENDPOINT}), clock)
    yield a
    a.close()


def largest(tmp_path: Path, script: str) -> Any:
    """The experiment with everything a startup can carry."""
    spec = {
        "name": "vlm-pretrain-largest-startup",
        "project": "multimodal",
        "owner": "ana@example.com",
        "resources": {"gpu": "A100:8", "market": "spot"},
        "startup_script": script,
        "ssh_public_key": KEY,
        "run": "python train.py --config /opt/train/config.yaml",
        "volumes": [
            {"name": f"shards-{i}", "size_gb": 500, "path": f"/data/volumes/shards-{i}"}
            for i in range(8)  # provisioner.spec.MAX_VOLUMES
        ],
        "lifecycle": {
            "on_preemption_notice": {"signal": "SIGUSR1", "to": "python train.py --config .*"}
        },
    }
    return load_experiment(write_yaml(tmp_path / "largest.yaml", spec))


def render(app: App, experiment: Any, cloud: str) -> str:
    mounts = [(fits.sample_device(i), v.path) for i, v in enumerate(experiment.volumes)]
    data = boot.startup_for(app, experiment, cloud, mounts)
    assert data is not None
    return data


def unwrap(text: str) -> str:
    """Everything a cloud-init document carries, decoded: its files (b64, gz+b64) and parts."""
    if text.startswith(("Content-Type: multipart/", "MIME-Version:")):
        return "\n".join(
            unwrap(p.get_payload(decode=True).decode())
            for p in email.message_from_string(text).walk()
            if not p.is_multipart()
        )
    if text.startswith("#cloud-config"):
        config = yaml.safe_load(text)
        files = [file_content(f) for f in config.get("write_files", [])]
        return "\n".join([json.dumps(config), *(unwrap(f) for f in files)])
    return text


def received(harness: Harness) -> str:
    """The startup data the cloud accepted for the last launch, decoded as the machine does."""
    name, emu = harness.name, getattr(harness, "emu", None)
    if name == "aws":
        return decoded(base64.b64decode(emu.run_instances_requests[-1]["UserData"]))
    if name == "gcp":
        body = harness._inserts()[-1].body  # type: ignore[attr-defined]
        items = {i["key"]: i["value"] for i in body["metadata"]["items"]}
        return items["startup-script"]
    if name == "azure":  # the creating PUT's: a later one (a disk attached) carries none
        puts = harness._vm_puts()  # type: ignore[attr-defined]
        profiles = [r.body["properties"].get("osProfile", {}) for r in puts]
        data = [p["customData"] for p in profiles if "customData" in p][-1]
        return decoded(base64.b64decode(data))
    if name == "yandex":
        return emu.calls("InstanceService.Create")[-1].request.metadata["user-data"]
    if name == "sbercloud":
        body = harness._creates()[-1].body  # type: ignore[attr-defined]
        return decoded(base64.b64decode(body["server"]["user_data"]))
    raise AssertionError(name)


def test_the_user_script_is_what_a_user_sends() -> None:
    script = user_script()
    assert len(script.encode()) == 16 * 1024
    import gzip

    ratio = len(script) / len(gzip.compress(script.encode()))
    assert 2.0 < ratio < 4.5, ratio  # as real shell text compresses, neither blob nor padding


#: What the largest startup leaves free of each cloud's limit at least, for what the agent grows
#: by (docs/LIMITS.md has the figures).
MARGIN = 500


@pytest.mark.parametrize("cloud", CLOUDS)
def test_the_largest_startup_launches_on_every_cloud(
    cloud: str, app: App, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = user_script()
    experiment = largest(tmp_path, script)
    data = render(app, experiment, cloud)
    limits = providers.spec(cloud).limits
    assert limits is not None
    ssh_user = providers.spec(cloud).ssh_user
    size = startup_size(limits, data, KEY, ssh_user)
    assert size <= limits.startup_max - MARGIN, (cloud, size, limits.startup_max)
    assert fits.too_large(app, experiment, cloud) is None
    with open_harness(cloud, monkeypatch, tmp_path) as harness:
        provider = harness.provider()
        inst = provider.launch(harness.launch_request("big", user_data=data, ssh_public_key=KEY))
        assert inst.id in harness.machines()
        got = unwrap(received(harness))
    for name, text in startup.agent_sources(cloud).items():  # the whole agent and its guard
        assert text in got, name
    guard = resources.files("provisioner").joinpath("agent_guard.py").read_text()
    assert shrink(guard) in got  # the guard whole, as the package has it
    own = boot.guard_of(app, boot.SAMPLE_MACHINE, experiment, ssh_user)
    assert json.dumps(own, sort_keys=True) in got  # its guard.json: it guards itself from boot
    assert fits.SAMPLE_TOKEN in got and ENDPOINT in got  # with its token and endpoint
    assert script.removeprefix("#!/bin/bash\n").rstrip() in got  # the user's script, whole
    assert "/data/volumes/shards-7" in got  # the mounts
    assert "SIGUSR1" in got  # the preemption-notice action
    if limits.key_in_startup:
        assert KEY in got


def test_a_startup_truly_past_ec2s_limit_is_turned_down_with_the_numbers(
    app: App, tmp_path: Path
) -> None:
    """A user script that is itself past EC2's 16 KB gzipped (24 KB of an embedded blob:
    base64 text, gzipping to about 18 KB): AWS is turned down with its size and the limit; the
    other clouds take it with everything else."""
    experiment = largest(tmp_path, incompressible(24 * 1024))
    big = fits.too_large(app, experiment, "aws")
    assert big is not None and big.size > 16_384
    limits = providers.spec("aws").limits
    assert limits is not None
    data = render(app, experiment, "aws")
    assert render(app, experiment, "aws") == data  # the same startup, the same bytes
    assert big.size == startup_size(limits, data, KEY, providers.spec("aws").ssh_user)
    assert f"{big.size:,} bytes on aws" in str(big) and "at most 16,384" in str(big)
    assert [c for c in CLOUDS if fits.too_large(app, experiment, c) is not None] == ["aws"]


#: What each cloud answers a startup past its limit (providers/<cloud> LIMITS cite them).
REFUSALS = {
    "aws": "User data is limited to 16384 bytes",
    "gcp": "is too large: maximum size 262144",
    "azure": "maximum length of 87380 characters",
    "yandex": "metadata value is over 256 KB",
    "sbercloud": "user_data longer than 32 KB",
}


@pytest.mark.parametrize("cloud", CLOUDS)
def test_each_emulator_refuses_a_startup_past_its_cloud_limit(
    cloud: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limits = providers.spec(cloud).limits
    assert limits is not None
    # base64 text gzips to ~3/4: this much is past the limit whatever the envelope
    script = incompressible(int(limits.startup_max * 1.45) + 2_048)
    # past the adapter's own check (sbercloud refuses before sending): the cloud's answer
    monkeypatch.setattr("providers.sbercloud.userdata.check_startup", lambda *a, **k: None)
    with open_harness(cloud, monkeypatch, tmp_path) as harness:
        provider = harness.provider(retry_attempts=1)
        with pytest.raises(ProviderError) as err:
            provider.launch(harness.launch_request("big", user_data=script, ssh_public_key=KEY))
        assert harness.machines() == []
        if cloud == "yandex":  # its harness fails a test whose requests were refused: expected
            harness.emu.rejected.clear()  # type: ignore[attr-defined]
    assert REFUSALS[cloud] in str(err.value), str(err.value)


def test_the_measure_matches_what_each_adapter_sends() -> None:
    """What ``plan`` measures is what the adapter puts on the wire: the one function both use."""
    for cloud in CLOUDS:
        limits = providers.spec(cloud).limits
        assert limits is not None
        assert check_startup(cloud, limits, user_script(), KEY, "provisioner") is None


# --- plan and up refuse what fits no cloud, before anything is launched -----------------------


def test_plan_and_up_refuse_a_startup_that_fits_no_cloud(home: Path, tmp_path: Path) -> None:
    cfg = write_settings(home, clouds={"aws": {}})
    spec = write_yaml(
        tmp_path / "exp.yaml",
        {
            "name": "blob",
            "project": "p",
            "owner": "ana@example.com",
            "resources": {"gpu": "T4:1", "market": "any", "clouds": ["aws"]},
            "startup_script": incompressible(30 * 1024),  # an embedded blob: 30 KB whatever
        },
    )
    for command in ("plan", "up"):
        r = run_cli("--config", str(cfg), command, str(spec))
        assert r.returncode == 2, r.stdout + r.stderr
        assert "Traceback" not in r.stderr
        [line] = [ln for ln in r.stderr.splitlines() if "startup_script" in ln]
        assert f"{spec}: startup_script:" in line
        assert "aws" in line and "16,384" in line and "bytes" in line  # cloud, size, limit
    status = run_cli("--config", str(cfg), "status", "--all")
    assert "blob" not in status.stdout  # nothing was launched, nothing recorded


def test_plan_keeps_the_clouds_a_startup_fits(home: Path, tmp_path: Path) -> None:
    """30 KB that do not compress: past AWS's 16 KB, inside Azure's 64 KB (its offers stay)."""
    cfg = write_settings(home, clouds={"aws": {}, "azure": {}})
    spec = write_yaml(
        tmp_path / "exp.yaml",
        {
            "name": "blob",
            "project": "p",
            "owner": "ana@example.com",
            "resources": {"gpu": "T4:1", "market": "any", "clouds": ["aws", "azure"]},
            "startup_script": incompressible(30 * 1024),
        },
    )
    r = run_cli("--config", str(cfg), "plan", str(spec), "--output", "json")
    assert r.returncode == 0, r.stderr
    import json

    plan = json.loads(r.stdout)
    assert {c["cloud"] for c in plan["candidates"]} == {"azure"}
    [reason] = [k for k in plan["rejected"] if "startup_script" in k]
    assert f"{spec}: startup_script: the startup data is" in reason
    assert "on aws" in reason and "16,384" in reason


def test_the_same_startup_is_the_same_bytes() -> None:
    """A retried launch sends what the first one sent; the measure is the launch's size."""
    from providers.limits import startup_payload

    limits = providers.spec("aws").limits
    assert limits is not None
    script = "#cloud-config\npackages: [htop]\n"  # a MIME multipart beside our config
    first = startup_payload(limits, script, KEY, "provisioner")
    assert first == startup_payload(limits, script, KEY, "provisioner")


@pytest.mark.parametrize(
    ("cloud", "fold", "label", "refusal"),
    [
        ("aws", "providers.aws.network._unreserved", "aws:team", "reserved for internal use"),
        ("azure", "providers.azure.adapter.arm_tags", "team/ml", "The tag name 'team/ml'"),
    ],
)
def test_a_label_the_cloud_reserves_is_folded_and_the_cloud_refuses_it_raw(
    cloud: str,
    fold: str,
    label: str,
    refusal: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with open_harness(cloud, monkeypatch, tmp_path) as harness:
        request = harness.launch_request("tags")
        labelled = request.__class__(
            **{**request.__dict__, "labels": {**request.labels, label: "x"}}
        )
        inst = harness.provider().launch(labelled)  # folded: accepted
        assert inst.id in harness.machines()
        monkeypatch.setattr(fold, (lambda k: k) if cloud == "aws" else dict)
        raw = harness.launch_request("raw")
        raw = replace(raw, labels={**raw.labels, label: "x"})
        with pytest.raises(ProviderError) as err:
            harness.provider(retry_attempts=1).launch(raw)
    assert refusal in str(err.value), str(err.value)
