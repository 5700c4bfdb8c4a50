"""Broken input, generated: never a traceback, every message names file, line and field, exit 2."""

from __future__ import annotations

import io
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from provisioner.errors import ConfigError
from provisioner.settings import load_settings
from provisioner.spec import load_experiment

VALID = {
    "name": "llama",
    "project": "nlp",
    "owner": "ana@example.com",
    "resources": {
        "gpu": "A100:8",
        "market": "spot",
        "clouds": ["aws", "gcp"],
        "max_price_per_hour": "40 USD",
        "disk_gb": 200,
        "min_vcpus": 32,
    },
    "lifecycle": {
        "max_lifetime": "48h",
        "on_preemption": "relaunch",
        "idle": {"gpu_util_below": 5, "for_minutes": 30},
    },
    "labels": {"team": "nlp"},
}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["A100:x", "-1 USD", "99999999999999h", "spot ", "", "nan"]),
)
values = st.recursive(
    scalars,
    lambda c: st.one_of(
        st.lists(c, max_size=3), st.dictionaries(st.text(max_size=6), c, max_size=3)
    ),
    max_leaves=6,
)


def paths(d, prefix=()):
    for k, v in d.items():
        yield (*prefix, k)
        if isinstance(v, dict):
            yield from paths(v, (*prefix, k))


ALL_PATHS = list(paths(VALID))


def parent_of(doc, path):
    """The mapping that holds ``path``'s last key, or None where earlier changes cut the path."""
    for k in path[:-1]:
        doc = doc.get(k) if isinstance(doc, dict) else None
    return doc if isinstance(doc, dict) else None


@st.composite
def broken_documents(draw):
    doc = yaml.safe_load(yaml.safe_dump(VALID))
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(ALL_PATHS))
        parent = parent_of(doc, path)
        if parent is None:
            continue
        action = draw(st.sampled_from(["delete", "replace", "add"]))
        if action == "delete":
            parent.pop(path[-1], None)
        elif action == "replace":
            parent[path[-1]] = draw(values)
        else:
            parent[draw(st.text(min_size=1, max_size=8))] = draw(values)
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def garbled(text: str, data) -> str:
    i = data.draw(st.integers(0, max(0, len(text) - 1)))
    junk = data.draw(
        st.sampled_from([":", "- ", "[", "{", "\t", "'", "&a", "*b", "!!python/object "])
    )
    return text[:i] + junk + text[i:]


def check_problems(e: ConfigError, file: Path, text: str) -> None:
    assert e.problems
    for p in e.problems:
        assert p.file == str(file)
        if text.strip():
            # YAML also breaks lines at \x85, \u2028, \u2029: count them as it does
            assert p.line is not None and 1 <= p.line <= len(text.splitlines()) + 1, p
        assert p.message
        assert (
            p.field is not None
            or "YAML" in p.message
            or "mapping" in p.message
            or "empty" in p.message
        ), p


FAST = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FAST
@given(text=broken_documents())
def test_broken_experiments_are_reported_not_raised(tmp_path, text):
    f = tmp_path / "exp.yaml"
    f.write_text(text)
    try:
        load_experiment(f)
    except ConfigError as e:
        check_problems(e, f, text)


@FAST
@given(data=st.data())
def test_garbled_yaml_is_reported_with_a_line(tmp_path, data):
    text = garbled(yaml.safe_dump(VALID, sort_keys=False), data)
    f = tmp_path / "exp.yaml"
    f.write_text(text)
    try:
        load_experiment(f)
    except ConfigError as e:
        check_problems(e, f, text)


SETTINGS_VALID = {
    "currency": "USD",
    "rates": {"RUB": 80},
    "clouds": {"aws": {"regions": ["us-east-1"]}},
    "smtp": {"host": "localhost", "port": 25, "security": "none"},
    "prices": {"sbercloud": {"p3.2xlarge.8": {"price": 300}}},
}
SETTINGS_PATHS = list(paths(SETTINGS_VALID))


@FAST
@given(data=st.data())
def test_broken_settings_are_reported(tmp_path, data, monkeypatch):
    monkeypatch.setenv("PROVISIONER_HOME", str(tmp_path))
    doc = yaml.safe_load(yaml.safe_dump(SETTINGS_VALID))
    path = data.draw(st.sampled_from(SETTINGS_PATHS))
    parent_of(doc, path)[path[-1]] = data.draw(values)
    text = yaml.safe_dump(doc, sort_keys=False)
    f = tmp_path / "settings.yaml"
    f.write_text(text)
    try:
        load_settings(f)
    except ConfigError as e:
        check_problems(e, f, text)


POLICY_VALID = {
    "name": "nlp",
    "applies_to": {"projects": ["nlp-*"], "owners": ["*@example.com"]},
    "allow": {"clouds": ["aws"], "gpus": ["A100"], "markets": ["spot"]},
    "max_gpus_per_machine": 8,
    "max_machines": 3,
    "max_price_per_hour": "25 USD",
    "budget": {
        "amount": "5000 USD",
        "period": "month",
        "alerts": {"actual": [50, 100]},
        "on_exhausted": "stop",
        "recipients": ["a@example.com"],
    },
    "off_hours": {
        "timezone": "Europe/Berlin",
        "windows": [{"days": "mon-fri", "start": "20:00", "end": "08:00"}],
        "holidays": {"country": "DE"},
    },
    "idle": {"gpu_util_below": 10, "for_minutes": 20, "action": "stop"},
    "max_lifetime": {"after": "72h", "action": "terminate"},
}
POLICY_PATHS = list(paths(POLICY_VALID))


@FAST
@given(data=st.data())
def test_broken_policies_are_reported(tmp_path, data):
    from policies.loader import PolicyError, load

    doc = yaml.safe_load(yaml.safe_dump(POLICY_VALID))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(POLICY_PATHS))
        parent = parent_of(doc, path)
        if parent is not None:
            parent[path[-1]] = data.draw(values)
    text = yaml.safe_dump(doc, sort_keys=False)
    if data.draw(st.booleans()):
        text = garbled(text, data)
    f = tmp_path / "policy.yaml"
    f.write_text(text)
    try:
        load([f])
    except PolicyError as e:
        check_problems(e, f, text)


def run_main(argv: list[str]) -> tuple[int, str]:
    from provisioner.cli.main import main

    err, out = io.StringIO(), io.StringIO()
    old = sys.argv
    sys.argv = ["provisioner", *argv]
    try:
        with redirect_stderr(err), redirect_stdout(out):
            main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = old
    return code, err.getvalue() + out.getvalue()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=broken_documents())
def test_cli_exits_2_with_a_located_message(tmp_path, text, monkeypatch):
    monkeypatch.setenv("PROVISIONER_HOME", str(tmp_path / "home"))
    f = tmp_path / "exp.yaml"
    f.write_text(text)
    code, output = run_main(["plan", str(f)])
    assert "Traceback" not in output
    if code != 0:
        assert code == 2, output
        assert f"{f}:" in output


@pytest.mark.parametrize(
    "text", ["name: [unclosed\n", "\x00\x01", "resources: !!python/object:os.system ls\n"]
)
def test_hostile_yaml(tmp_path, text):
    f = tmp_path / "exp.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_experiment(f)
    assert "YAML" in str(e.value) or "mapping" in str(e.value)


@pytest.mark.parametrize(
    "value", [24000000000.0, -24000000000.0, "99999999999999h", ".inf", "P99999999D", 1e308, -1]
)
def test_absurd_durations_are_errors_not_overflows(tmp_path, value):
    from policies.loader import PolicyError, load

    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"name": "p", "max_lifetime": value}))
    with pytest.raises(PolicyError) as e:
        load([f])
    assert e.value.problems[0].field.startswith("max_lifetime")
    g = tmp_path / "e.yaml"
    g.write_text(yaml.safe_dump({**VALID, "lifecycle": {"max_lifetime": value}}))
    with pytest.raises(ConfigError) as e:
        load_experiment(g)
    assert e.value.problems[0].field == "lifecycle.max_lifetime"
