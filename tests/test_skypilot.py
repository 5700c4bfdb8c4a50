"""SkyPilot task files run (issue #34, point 2): task files taken verbatim from SkyPilot's own
examples (tests/data/skypilot, with their source and commit) through `plan` and `up`; every
field SkyPilot has mapped or refused with file, line, field and reason (docs/SKYPILOT.md's
table, checked against the code here); numbers and booleans in an experiment's `env`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from policies.problems import DocumentError
from provisioner import skypilot
from provisioner.skypilot_resources import SKYPILOT_RESOURCES, accelerator_alternatives
from provisioner.spec import load_experiment
from tests.conftest import ROOT, sandbox_experiment, write_settings, write_yaml

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

DATA = Path(__file__).parent / "data" / "skypilot"
TABLE = ROOT / "docs" / "SKYPILOT.md"


def line_of(path: Path, text: str) -> int:
    """The 1-based line of the first line of ``path`` starting (after spaces) with ``text``."""
    lines = path.read_text().splitlines()
    return 1 + next(i for i, t in enumerate(lines) if t.strip().startswith(text))


def errors(r) -> list[str]:
    return [t.removeprefix("error: ") for t in r.err.splitlines() if t.startswith("error: ")]


# ---- the verbatim examples through `plan` ----------------------------------------------------


def test_detectron2_example_plans_v100_on_demand_offers(home, cli):
    r = cli("plan", str(DATA / "detectron2_app.yaml"), "--top", "500", "-o", "json")
    assert r.code == 0, r.err
    plan = json.loads(r.out)
    assert (plan["experiment"], plan["gpu"], plan["market"]) == (
        "detectron2-app",
        "V100:1",
        "reserved",
    )
    assert plan["candidates"] and {c["cloud"] for c in plan["candidates"]} >= {"aws", "gcp"}
    assert all(
        (c["gpu"], c["gpu_count"], c["market"]) == ("V100", 1, "reserved")
        for c in plan["candidates"]
    )


def test_lora_example_refuses_each_field_it_cannot_honour_at_once(home, cli):
    path = DATA / "lora.yaml"
    r = cli("plan", str(path))
    assert r.code == 2 and "Traceback" not in r.err
    assert errors(r) == [
        f"{path}:{line_of(path, 'HF_TOKEN:')}: envs.HF_TOKEN: required: give it with "
        "--env HF_TOKEN=VALUE",
        f"{path}:{line_of(path, '/configs:')}: file_mounts./configs: copying ./configs to "
        "/configs is not supported yet: put it in workdir (copied to the machine) and use it "
        "from there",
        f"{path}:{line_of(path, '/output:')}: file_mounts./output: buckets not supported yet "
        "(object storage mounts)",
    ]
    given = cli("plan", str(path), "--env", "HF_TOKEN=hf_x")  # as `sky launch --env`
    assert given.code == 2 and not any("HF_TOKEN" in e for e in errors(given))
    assert len(errors(given)) == 2


def test_falcon_example_refuses_secrets_and_its_bucket(home, cli):
    path = DATA / "falcon.yaml"
    r = cli("plan", str(path), "--env", "OUTPUT_BUCKET_NAME=b")
    assert r.code == 2
    assert [e.split(": ", 2)[1] for e in errors(r)] == ["secrets", "file_mounts./results"]
    assert f"{path}:{line_of(path, 'secrets:')}: secrets: secrets are not supported" in r.err


def test_num_nodes_2_is_refused_naming_the_field_and_its_line(home, cli):
    path = DATA / "distributed_train.yaml"
    r = cli("up", str(path))
    assert r.code == 2 and "Traceback" not in r.err
    assert errors(r) == [
        f"{path}:{line_of(path, 'num_nodes:')}: num_nodes: 2 nodes: a multi-node cluster is not "
        "supported, provisioner runs a task on one machine (num_nodes: 1)"
    ]
    assert "launched" not in r.out


def test_llama3_example_refuses_service_gpu_alternatives_and_ports(home, cli):
    path = DATA / "llama3.yaml"
    r = cli("plan", str(path))
    assert r.code == 2
    fields = [e.split(": ", 2)[1] for e in errors(r)]
    assert fields == ["service", "resources.accelerators", "resources.ports"]
    assert "8 alternatives (L4:8, A10G:8, A10:8, A100:4, A100:8, A100-80GB:2" in r.err
    assert f"{path}:{line_of(path, 'accelerators:')}: resources.accelerators" in r.err


def test_gpt2_example_any_of_becomes_the_clouds_provisioner_rents(home, cli, tmp_path):
    """Verbatim, its gs:// file mount is refused; without it (the one change), its any_of
    plans on gcp, aws and azure, A100:8 on demand, gcp on the image it names."""
    path = DATA / "gpt2_train.yaml"
    r = cli("plan", str(path))
    assert r.code == 2
    assert errors(r) == [
        f"{path}:{line_of(path, 'file_mounts:') + 1}: file_mounts.~/.cache/huggingface: "
        "buckets not supported yet (object storage mounts)"
    ]
    task = yaml.safe_load(path.read_text())
    del task["file_mounts"]
    loaded = skypilot.load(write_yaml(tmp_path / "gpt2.yaml", task), actor=lambda: "ana@x.org")
    res = loaded.experiment.resources
    assert (str(res.gpu), res.market, res.clouds) == ("A100:8", "reserved", ["gcp", "aws", "azure"])
    assert res.image == {"gcp": task["resources"]["any_of"][0]["image_id"]}
    assert res.disk_gb == 256  # SkyPilot's default
    assert (
        "resources.any_of: fluidstack, kubernetes, lambda, paperspace, runpod left out "
        "(clouds provisioner does not rent)" in loaded.notes
    )


def test_a_task_without_accelerators_is_refused_and_gpus_gives_them(home, cli):
    path = DATA / "minimal.yaml"
    r = cli("plan", str(path))
    assert r.code == 2
    assert errors(r) == [
        f"{path}:{line_of(path, 'resources:')}: resources: no accelerators: provisioner rents "
        "GPU machines; add accelerators: (T4:1, A100:8) or give --gpus"
    ]
    plan = cli("plan", str(path), "--gpus", "H100:8", "-o", "json")  # infra: aws kept
    assert plan.code == 0, plan.err
    got = json.loads(plan.out)
    assert (got["gpu"], got["market"]) == ("H100:8", "reserved")
    assert {c["cloud"] for c in got["candidates"]} == {"aws"}


# ---- `up` on the sandbox -------------------------------------------------------------------


def test_up_runs_the_minimal_example_on_the_sandbox(home, cli):
    cfg = write_settings(home)
    path = DATA / "minimal.yaml"
    r = cli("--config", str(cfg), "up", str(path), "--gpus", "T4:1", "--cloud", "sandbox")
    assert r.code == 0, r.err
    assert "launched minimal on sandbox" in r.out
    assert "running setup\nhello, SkyPilot!\n" in r.out
    assert "run exited 0: minimal stopped" in r.out
    st = json.loads(cli("--config", str(cfg), "status", "minimal", "-o", "json").out)
    assert st["project"] == "skypilot"  # the task file's folder: SkyPilot has no project


TASK = """\
name: My_Task.v2
workdir: code
resources:
  accelerators: {T4: 4}
  cloud: sandbox
  use_spot: true
  disk_size: 64GB
envs:
  LR: 0.001
  EPOCHS: 3
  DEBUG: true
  TOKEN:
setup: |
  echo "setup sees $EPOCHS epochs"
run: |
  for i in {1..2}; do echo "step $i of $EPOCHS debug=$DEBUG gpus=$SKYPILOT_NUM_GPUS_PER_NODE"; done
  [[ -n "$TOKEN" ]] && echo "token $TOKEN"
  sh train.sh
"""


def test_up_runs_a_task_with_its_envs_workdir_and_bash(home, cli, tmp_path, monkeypatch):
    """Not from the examples: every mapped field at once, on the sandbox. The workdir is
    relative to the current directory, as in SkyPilot."""
    cfg = write_settings(home)
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.sh").write_text('echo "lr=$LR"\n')
    path = tmp_path / "task.yaml"
    path.write_text(TASK)
    monkeypatch.chdir(tmp_path)
    missing = cli("--config", str(cfg), "up", str(path))
    assert missing.code == 2
    assert errors(missing) == [f"{path}:12: envs.TOKEN: required: give it with --env TOKEN=VALUE"]
    monkeypatch.setenv("TOKEN", "from-my-shell")
    r = cli("--config", str(cfg), "up", str(path), "--env", "TOKEN", "--env", "EPOCHS=2")
    assert r.code == 0, r.err
    assert "note: name My_Task.v2: the machine is my-task-v2" in r.err
    assert "sbx-t4-4 (4×T4, spot)" in r.out and "disk 64 GB" in r.out
    assert (
        "setup sees 2 epochs\n"
        "step 1 of 2 debug=True gpus=4\n"
        "step 2 of 2 debug=True gpus=4\n"
        "token from-my-shell\n"
        "lr=0.001\n"
    ) in r.out


# ---- the rule, the table, the forms -------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "skypilot_task"),
    [
        ({"name": "x", "resources": {"accelerators": "A100:8"}}, True),
        ({"envs": {"A": "1"}, "run": "echo"}, True),
        ({"num_nodes": 1, "resources": {"gpu": "A100:8"}}, False),  # an experiment's key wins
        ({"name": "x", "project": "p", "resources": {"gpu": "T4"}, "file_mounts": {}}, False),
        ({"name": "x", "run": "echo"}, False),  # nothing only SkyPilot has: --format skypilot
        ("not a mapping", False),
    ],
)
def test_which_kind_a_file_is(data, skypilot_task):
    assert skypilot.is_skypilot(data) is skypilot_task


def test_format_says_what_the_keys_do_not(home, cli, tmp_path):
    path = write_yaml(tmp_path / "job.yaml", {"name": "job", "run": "echo hi"})
    as_experiment = cli("plan", str(path))
    assert as_experiment.code == 2 and "project: Field required" in as_experiment.err
    as_task = cli("plan", str(path), "--format", "skypilot")
    assert as_task.code == 2 and "resources: no accelerators" in as_task.err
    given = cli("plan", str(path), "--format", "skypilot", "--gpus", "T4")
    assert given.code == 0, given.err
    told = cli("plan", str(DATA / "detectron2_app.yaml"), "--format", "experiment")
    assert told.code == 2 and "project: Field required" in told.err


def _table() -> list[tuple[str, str]]:
    """(SkyPilot field, the rest of its row) of docs/SKYPILOT.md's mapping table."""
    rows = re.findall(r"^\| `([a-z_.]+)` \|(.*)$", TABLE.read_text(), re.M)
    assert len(rows) > 30
    return rows


def test_the_docs_table_lists_every_field_the_code_knows():
    # SkyPilot's internal fields left out; the keys both kinds have (volumes is a list of
    # network disks in an experiment, a mapping in a task) put in
    internal = {"file_mounts_mapping", "_metadata"}
    known = (skypilot.SKYPILOT_ONLY - internal) | {"name", "workdir", "setup", "run", "volumes"}
    known |= {f"resources.{k}" for k in SKYPILOT_RESOURCES}
    assert {f for f, _ in _table()} == known


#: a value each refused field is refused with (any other: "x")
_REFUSED_WITH = {
    "num_nodes": 2,
    "file_mounts": {"/data": "s3://bucket/data"},
    "resources.disk_tier": "ultra",
    "resources.accelerators": {"A100": 8, "H100": 8},
}


@pytest.mark.parametrize("field", [f for f, rest in _table() if "**refused**" in rest])
def test_each_field_the_table_refuses_is_refused_with_its_line(field, tmp_path):
    task: dict = {"name": "t", "resources": {"accelerators": "T4:1"}, "run": "echo"}
    value = _REFUSED_WITH.get(field, "x")
    if field.startswith("resources."):
        task["resources"][field.split(".", 1)[1]] = value
    else:
        task[field] = value
    path = write_yaml(tmp_path / "t.yaml", task)
    with pytest.raises(DocumentError) as e:
        skypilot.load(path, actor=lambda: "ana@x.org", fmt="skypilot")
    [problem] = [p for p in e.value.problems if (p.field or "").startswith(field)]
    leaf = (problem.field or "").rsplit(".", 1)[-1]  # file_mounts: at its /data
    assert problem.line == line_of(path, f"{leaf}:") and problem.message


@pytest.mark.parametrize(
    ("value", "alternatives"),
    [
        ("A100:8", [("A100", 8)]),
        ("H100", [("H100", 1)]),
        ("a10g:2", [("A10G", 2)]),
        ({"A100": 8}, [("A100", 8)]),
        ({"L4:8": None, "A100:4": None}, [("L4", 8), ("A100", 4)]),  # YAML's {L4:8, A100:4}
        (["V100:1", "T4:1"], [("V100", 1), ("T4", 1)]),
        ("{'V100:1', 'V100:1'}", [("V100", 1)]),  # a set written as a string
    ],
)
def test_skypilot_accelerator_forms(value, alternatives):
    assert accelerator_alternatives(value) == (alternatives, None)


def test_fractional_and_unknown_gpus_are_refused_at_accelerators(tmp_path):
    assert "fractional GPUs" in str(accelerator_alternatives("T4:0.5")[1])
    path = write_yaml(tmp_path / "k.yaml", {"resources": {"accelerators": "K80:1"}})
    with pytest.raises(DocumentError) as e:
        skypilot.load(path, actor=lambda: "ana@x.org")
    [p] = e.value.problems
    assert (p.line, p.field) == (
        2,
        "resources.accelerators",
    ) and "unknown GPU type 'K80'" in p.message


def test_where_cpus_memory_disk_and_cost_map(tmp_path):
    task = {
        "name": "t",
        "resources": {
            "accelerators": "A100:8",
            "infra": "aws/us-east-1/us-east-1a",
            "cpus": "32+",
            "memory": 128,
            "disk_size": "1TB",
            "max_hourly_cost": 40,
            "labels": {"team": "nlp"},
            "autostop": 30,
        },
    }
    loaded = skypilot.load(write_yaml(tmp_path / "t.yaml", task), actor=lambda: "ana@x.org")
    e = loaded.experiment
    r = e.resources
    assert (r.clouds, r.regions, r.zones) == (["aws"], ["us-east-1"], ["us-east-1a"])
    assert (r.min_vcpus, str(r.min_memory_gb), r.disk_gb) == (32, "128", 1024)
    assert str(r.max_price_per_hour) == "40.00 USD" and e.labels == {"team": "nlp"}
    assert e.lifecycle.autostop is not None and e.lifecycle.autostop.total_seconds() == 1800
    assert "memory: 128 taken as at least 128" in loaded.notes


def test_an_unknown_cloud_is_refused_at_its_field(tmp_path):
    path = write_yaml(tmp_path / "t.yaml", {"resources": {"accelerators": "T4", "cloud": "lambda"}})
    with pytest.raises(DocumentError) as e:
        skypilot.load(path, actor=lambda: "ana@x.org")
    [p] = e.value.problems
    assert (p.line, p.field) == (3, "resources.cloud") and "unknown cloud 'lambda'" in p.message


# ---- experiment files: numbers and booleans in env --------------------------------------------


def test_an_experiment_env_takes_numbers_and_booleans_as_skypilot_does(tmp_path):
    spec = sandbox_experiment("nums")
    spec["env"] = {"STEPS": 3, "LR": 0.5, "DEBUG": True, "NAME": "x"}
    exp = load_experiment(write_yaml(tmp_path / "e.yaml", spec))
    # str() of each, as sky/task.py Task.from_yaml_config converts envs
    assert exp.env == {"STEPS": "3", "LR": "0.5", "DEBUG": "True", "NAME": "x"}
    spec["env"] = {"EMPTY": None}
    with pytest.raises(DocumentError) as e:
        load_experiment(write_yaml(tmp_path / "e.yaml", spec))
    assert [p.field for p in e.value.problems] == ["env.EMPTY"]


def test_an_experiment_with_numbers_in_env_runs_them_and_env_overrides(home, cli, tmp_path):
    cfg = write_settings(home)
    spec = sandbox_experiment("nums")
    spec["env"] = {"STEPS": 3, "DEBUG": False}
    spec["run"] = 'echo "steps=$STEPS debug=$DEBUG lr=$LR"'
    path = write_yaml(tmp_path / "nums.yaml", spec)
    r = cli("--config", str(cfg), "up", str(path), "--env", "LR=0.1")
    assert r.code == 0, r.err
    assert "steps=3 debug=False lr=0.1\n" in r.out
    bad = cli("--config", str(cfg), "plan", str(path), "--gpus", "A100:8")
    assert bad.code == 2 and "--gpus and --cloud change a SkyPilot task" in bad.err


def test_skypilot_names_in_an_experiment_file_are_said_to_be_so(home, cli, tmp_path):
    spec = sandbox_experiment("mixed")
    spec["resources"]["accelerators"] = "A100:8"
    spec["num_nodes"] = 1
    path = write_yaml(tmp_path / "mixed.yaml", spec)
    r = cli("plan", str(path))
    assert r.code == 2
    assert (
        f"{path}:{line_of(path, 'accelerators:')}: resources.accelerators: accelerators is "
        "SkyPilot's name; an experiment's is gpu (read as an experiment: it has owner, "
        "project; docs/SKYPILOT.md)"
    ) in r.err
    assert "num_nodes: num_nodes is a SkyPilot task field (read as an experiment" in r.err


BAD_TASK = """\
name: 123
workdir: no-such-dir
num_nodes: "2"
envs:
  lower_key: 1
  LIST: [1]
resources:
  accelerators: A100:8
  cpus: many
  disk_size: true
  use_spot: maybe
  image_id: docker:nvcr.io/nvidia/pytorch:24.01-py3
  cloud: aws
"""


def test_every_bad_value_is_one_error_at_its_line(home, cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_TASK)
    r = cli("plan", str(path))
    assert r.code == 2 and "Traceback" not in r.err
    assert [e.split(": ", 2)[1] for e in errors(r)] == [
        "workdir",
        "num_nodes",
        "envs.lower_key",
        "envs.LIST",
        "resources.cpus",
        "resources.disk_size",
        "resources.use_spot",
        "resources.image_id",
    ]
    assert f"no directory {tmp_path / 'no-such-dir'} (relative to the current directory)" in r.err
    assert "container images (docker:) are not supported" in r.err


def test_yaml_1_1_words_for_use_spot_as_skypilot_reads_them(tmp_path):
    task = {"resources": {"accelerators": "T4", "use_spot": "yes"}}
    loaded = skypilot.load(write_yaml(tmp_path / "t.yaml", task), actor=lambda: "ana@x.org")
    assert loaded.experiment.resources.market == "spot"
    assert loaded.experiment.name == "sky-t" and loaded.notes[0].startswith("no name")


def test_the_dashboard_plans_a_task_file_too(app):
    from provisioner.views.plan import plan_page

    page = plan_page(app, path=str(DATA / "detectron2_app.yaml"), owner=lambda: "ana@x.org")
    assert not page.problems and page.view is not None
    assert str(page.view.experiment.resources.gpu) == "V100:1"
    refused = plan_page(app, path=str(DATA / "distributed_train.yaml"), owner=lambda: "ana@x.org")
    assert [p.split(": ", 2)[1] for p in refused.problems] == ["num_nodes"]
