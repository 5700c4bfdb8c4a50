"""The README's examples are real: each YAML block loads as what it claims to be."""

from __future__ import annotations

import re

from policies.loader import load as load_policies
from provisioner.settings import load_settings
from provisioner.spec import load_experiment
from tests.conftest import ROOT


def blocks() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_yaml_examples_load(tmp_path, monkeypatch):
    monkeypatch.setenv("PROVISIONER_HOME", str(tmp_path))
    kinds = []
    for i, text in enumerate(blocks()):
        f = tmp_path / f"block{i}.yaml"
        f.write_text(text)
        if text.startswith("name:") and "resources:" in text:
            load_experiment(f)
            kinds.append("experiment")
        elif text.startswith("name:"):
            load_policies([f])
            kinds.append("policy")
        else:
            load_settings(f)
            kinds.append("settings")
    # + scheduler:, + identity: and a policy with per_owner
    assert sorted(kinds) == ["experiment", "policy", "policy", "settings", "settings", "settings"]


def test_shipped_configs_load(tmp_path, monkeypatch):
    monkeypatch.setenv("PROVISIONER_HOME", str(tmp_path))
    for f in sorted((ROOT / "configs/settings").glob("*.yaml")):
        load_settings(f)
    assert load_policies([ROOT / "configs/policies"])
    for f in sorted((ROOT / "configs/examples").glob("*.yaml")):
        load_experiment(f, actor=lambda: "you@example.com")  # the quickstart names no owner
