"""experiment.yaml: every mistake is reported with file, line and field, exit 2, no traceback."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from provisioner.errors import ConfigError
from provisioner.spec import load_experiment
from tests.conftest import EXAMPLES, run_cli

GOOD = """\
name: llama
project: nlp
owner: ana@example.com
resources:
  gpu: A100:8
  market: spot
lifecycle:
  max_lifetime: 48h
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


def problems(tmp_path: Path, text: str) -> list:
    with pytest.raises(ConfigError) as e:
        load_experiment(write(tmp_path, text))
    return e.value.problems


def test_examples_load():
    exp = load_experiment(EXAMPLES / "experiment.yaml")
    assert (exp.resources.gpu.type, exp.resources.gpu.count) == ("A100", 8)
    assert exp.resources.max_price_per_hour.amount == 40
    assert exp.lifecycle.max_lifetime == timedelta(hours=48)
    quick = load_experiment(EXAMPLES / "quickstart.yaml", actor=lambda: "you@example.com")
    assert quick.resources.clouds == ["sandbox"] and quick.owner == "you@example.com"


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        ("A100:8", ("A100", 8, None)),
        ("h100", ("H100", 1, None)),
        ("A100:80GB:4", ("A100", 4, 80)),
        ({"type": "T4", "count": 2}, ("T4", 2, None)),
        ({"type": "A100", "count": 8, "memory": "80GB"}, ("A100", 8, 80)),
    ],
)
def test_gpu_shorthands(tmp_path, gpu, expected):
    text = GOOD.replace("gpu: A100:8", "gpu: " + json.dumps(gpu))
    g = load_experiment(write(tmp_path, text)).resources.gpu
    assert (g.type, g.count, g.memory_gb) == expected


def test_unknown_gpu_names_line_and_field(tmp_path):
    (p,) = problems(tmp_path, GOOD.replace("A100:8", "A1000:8"))
    assert (p.line, p.field) == (5, "resources.gpu.type")
    assert "A1000" in p.message and "known" in p.message


def test_every_error_is_reported_at_once(tmp_path):
    text = GOOD.replace("market: spot", "market: cheap").replace("48h", "two days")
    text = text.replace("owner: ana@example.com\n", "owner: ana@example.com\ncolour: blue\n")
    got = {(p.line, p.field) for p in problems(tmp_path, text)}
    assert got == {(4, "colour"), (7, "resources.market"), (9, "lifecycle.max_lifetime")}


def test_missing_field_points_at_its_parent(tmp_path):
    (p,) = problems(tmp_path, GOOD.replace("  gpu: A100:8\n", ""))
    assert p.field == "resources.gpu" and p.line == 4 and "required" in p.message.lower()


def test_yaml_syntax_error_has_line(tmp_path):
    (p,) = problems(tmp_path, GOOD.replace("market: spot", "market: [spot"))
    assert p.line is not None and p.line >= 6 and "invalid YAML" in p.message


def test_duplicate_key_is_an_error(tmp_path):
    (p,) = problems(tmp_path, GOOD + "name: other\n")
    assert (p.line, p.field, p.message) == (9, "name", "duplicate key")


def test_bad_price_and_name(tmp_path):
    text = GOOD.replace("name: llama", "name: Llama_2").replace(
        "market: spot", "market: spot\n  max_price_per_hour: 30 dollars"
    )
    got = {p.field: p for p in problems(tmp_path, text)}
    assert got["name"].line == 1 and "lowercase" in got["name"].message
    assert got["resources.max_price_per_hour"].line == 7


def test_not_a_mapping_and_empty(tmp_path):
    assert "mapping" in problems(tmp_path, "- a\n- b\n")[0].message
    assert "empty" in problems(tmp_path, "")[0].message


def test_cli_reports_file_line_field_exit_2_without_traceback(tmp_path):
    p = write(tmp_path, GOOD.replace("A100:8", "A1000:8"))
    r = run_cli("plan", str(p))
    assert r.returncode == 2
    assert f"{p}:5: resources.gpu.type: unknown GPU type 'A1000'" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_cli_missing_file(tmp_path):
    r = run_cli("plan", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "file not found" in r.stderr and "Traceback" not in r.stderr
