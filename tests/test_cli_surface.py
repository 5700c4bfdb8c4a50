"""Every command and subcommand of the CLI, discovered from the Typer app (a new command is
covered the day it is added): its help at 80 columns, bad arguments, and ``-o json`` on a
state with a machine — no traceback, exit codes 0/1/2, JSON that parses, also for errors.

Runs in-process through the real entry point (:func:`provisioner.cli.main.main`), so the exit
codes and error handling are the ones a user gets; the few things only a process can show
(Ctrl-C) are in tests/test_cli_machines.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer

from provisioner.app import App
from provisioner.cli.main import app as cli_app  # importing main registers every command
from provisioner.clock import ManualClock
from provisioner.settings import load_settings
from tests.conftest import TEST_START, sandbox_experiment, write_settings, write_yaml

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture


def commands() -> list[tuple[str, ...]]:
    """Every command path of the app: ("status",), ("catalog", "refresh"), …"""
    root = typer.main.get_command(cli_app)
    out: list[tuple[str, ...]] = []

    def walk(cmd, path: tuple[str, ...]) -> None:
        subs = getattr(cmd, "commands", None)
        if path:
            out.append(path)
        for name, sub in (subs or {}).items():
            walk(sub, (*path, name))

    walk(root, ())
    return out


def params(path: tuple[str, ...]):
    cmd = typer.main.get_command(cli_app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd.params


def has_output(path: tuple[str, ...]) -> bool:
    return any("--output" in p.opts for p in params(path))


@pytest.fixture
def fleet(home: Path, tmp_path: Path):
    """Settings with the sandbox and one running machine ``exp`` (project demo)."""
    from provisioner import machines
    from provisioner.spec import Experiment

    cfg = write_settings(home)
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("exp"))
    a = App(load_settings(cfg), ManualClock(TEST_START))
    machines.up(a, Experiment.model_validate(sandbox_experiment("exp")))
    a.close()
    return cfg, spec


def test_discovery_finds_every_command():
    found = commands()
    assert len(found) >= 18  # today's; a lower count means discovery broke, not a smaller CLI
    for must in [("status",), ("events",), ("catalog", "refresh"), ("scheduler", "run")]:
        assert must in found


def test_help_of_every_command_fits_80_columns_without_bool(cli):
    for path in [(), *commands()]:
        r = cli(*path, "--help")
        assert r.code == 0, (path, r.err)
        assert "<bool>" not in r.out, path
        long = [ln for ln in r.out.splitlines() if len(ln) > 80]
        assert long == [], (path, long)
        cut = [ln for ln in r.out.splitlines() if ln.endswith("...") and "Usage:" not in ln]
        assert cut == [], (path, cut)  # each command's sentence whole, not "the others..."
        assert "Usage:" in r.out


def test_top_level_usage_and_version(cli):
    from importlib.metadata import version

    r = cli("--version")
    assert (r.code, r.out.strip()) == (0, f"provisioner {version('gpu-provisioner')}")
    assert cli().code in (0, 2)  # no arguments: the help, never a traceback
    r = cli("stauts")
    assert r.code == 2 and "No such command" in r.err


def test_every_command_with_bad_arguments_is_exit_2(cli):
    for path in commands():
        r = cli(*path, "--no-such-flag")
        assert r.code == 2, (path, r.code, r.err)
        assert "Error:" in r.err and "Traceback" not in r.err, (path, r.err)
        required = [p for p in params(path) if p.required]
        if required:  # each command whose arguments are required, without them
            r = cli(*path)
            assert r.code == 2 and "Missing" in r.err, (path, r.err)
        if has_output(path):
            r = cli(*path, "-o", "yaml")
            assert r.code == 2 and "'yaml' is not one of" in r.err, (path, r.err)
            # a usage error under -o json is a JSON object on stdout too
            r = cli(*path, "--no-such-flag", "-o", "json")
            assert r.code == 2, path
            assert json.loads(r.out) == {"error": "No such option: --no-such-flag", "exit_code": 2}


#: Values for the arguments and required options of every command, by parameter name. A new
#: command with a parameter missing here fails the test below: add a sample for it.
SAMPLES = {
    "spec": "{spec}",
    "name": "exp",
    "names": "exp",
    "until": "23:00",
    "duration": "30m",  # autostop NAME 30m
    "cloud": "sandbox",
    "command": None,  # ssh's trailing command: optional
    "endpoint": None,  # agent and scheduler run are daemons: not run here
    "token_file": None,
    "job_ids": None,  # cancel NAME [JOB]... (or --all)
}
# run until stopped, or exec ssh; selftest runs a machine for minutes (tests/test_selftest.py)
DAEMONS = {("agent",), ("scheduler", "run"), ("ssh",), ("selftest",)}


def argv_for(path: tuple[str, ...], spec: Path) -> list[str]:
    argv = list(path)
    for p in params(path):
        if p.name not in SAMPLES and (p.required or p.param_type_name == "argument"):
            pytest.fail(f"{' '.join(path)}: add a sample value for {p.name!r} to SAMPLES")
        value = SAMPLES.get(p.name)
        if value is None or not (p.required or p.param_type_name == "argument"):
            continue
        value = value.format(spec=spec)
        argv += [value] if p.param_type_name == "argument" else [p.opts[0], value]
    return argv


def test_every_command_with_json_output_prints_json(cli, fleet):
    cfg, spec = fleet
    runnable = [p for p in commands() if p not in DAEMONS and has_output(p)]
    assert {("status",), ("plan",), ("events",), ("down",), ("catalog",)} <= set(runnable)
    # down last: the others see the running machine
    runnable.sort(key=lambda p: p == ("down",))
    for path in runnable:
        argv = argv_for(path, spec)
        r = cli("--config", str(cfg), *argv, "-o", "json")
        assert r.code in (0, 1, 2), (argv, r.code, r.err)
        assert "Traceback" not in r.err, (argv, r.err)
        data = json.loads(r.out)  # parseable, also when it failed
        if r.code:
            assert data["exit_code"] == r.code and data["error"], (argv, data)
    # the table form of each too, at 80 columns
    for path in runnable:
        r = cli("--config", str(cfg), *argv_for(path, spec))
        assert r.code in (0, 1, 2) and "Traceback" not in r.err, (path, r.err)


def test_json_is_typed_consistently(cli, fleet):
    cfg, spec = fleet
    (m,) = json.loads(cli("--config", str(cfg), "status", "-o", "json").out)
    for key in ("created_at", "launched_at"):
        assert "T" in m[key] and m[key].endswith("+00:00"), m[key]
    assert isinstance(m["gpu_count"], int)
    rate = m["rate_per_hour"]["amount"]
    assert isinstance(rate, str) and "E" not in rate and len(rate.split(".")[-1]) <= 9
    plan = json.loads(cli("--config", str(cfg), "plan", str(spec), "-o", "json").out)
    c = plan["candidates"][0]
    assert isinstance(c["memory_gb"], int | float) and isinstance(c["vcpus"], int)
    for amount in (c["price_per_hour"]["amount"], c["price_per_hour_base"]["amount"]):
        assert isinstance(amount, str) and "E" not in amount and not amount.endswith(".0")
    ev = json.loads(cli("--config", str(cfg), "events", "-o", "json").out)
    assert ev and all("T" in e["at"] for e in ev)


def test_status_and_plan_at_80_columns_keep_names_state_and_prices_whole(cli, fleet, tmp_path):
    cfg, spec = fleet
    from provisioner import machines
    from provisioner.spec import Experiment

    a = App(load_settings(cfg), ManualClock(TEST_START))
    long = "llama-finetune-lora-ablation-7"
    machines.up(a, Experiment.model_validate(sandbox_experiment(long, gpu="A100:8")))
    a.close()
    r = cli("--config", str(cfg), "status", "--no-refresh")
    lines = r.out.splitlines()
    assert all(len(ln) <= 80 for ln in lines), lines
    row = next(ln for ln in lines if ln.startswith(long))
    assert " running " in row and "USD" in row and "…" not in r.out
    assert "11.00 USD" in row  # the 8×A100 spot rate, whole
    r = cli("--config", str(cfg), "plan", str(spec), "--top", "50")
    assert all(len(ln) <= 80 for ln in r.out.splitlines() if ln[:1].isdigit() or ln[:2] == "# ")
    assert "…" not in r.out and "USD" in r.out


def test_wide_terminals_show_more_columns(cli, fleet, monkeypatch):
    cfg, _ = fleet
    narrow = cli("--config", str(cfg), "status", "--no-refresh").out.splitlines()[0].split()
    monkeypatch.setenv("COLUMNS", "200")
    wide = cli("--config", str(cfg), "status", "--no-refresh").out.splitlines()[0].split()
    assert {"TYPE", "MARKET"} <= set(wide) - set(narrow)
    assert {"NAME", "STATUS", "PRICE/H", "SPENT"} <= set(narrow)
