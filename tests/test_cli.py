"""The command line as a user meets it: fast start without cloud SDKs, plan across five clouds
offline, catalog, clean errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from decimal import Decimal

import pytest

from provisioner.clock import CLOCK_ENV
from tests.conftest import (
    EXAMPLES,
    ROOT,
    TEST_START,
    run_cli,
    sandbox_experiment,
    write_settings,
    write_yaml,
)

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

SDK_PREFIXES = (
    "boto3",
    "botocore",
    "google.cloud",
    "azure",
    "yandexcloud",
    "yandex.cloud",
    "huaweicloudsdk",
    "grpc",
)

PROBE = """
import sys

import pytest
sys.argv = ["provisioner", *{args!r}]
from provisioner.entry import main
try:
    main()
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in sys.modules if m.startswith({prefixes!r}))
print("HEAVY=" + ",".join(heavy))
"""


def modules_loaded_by(*args: str, prefixes: tuple[str, ...] = SDK_PREFIXES) -> list[str]:
    """The modules of ``prefixes`` the command loads, run on the tests' clock as ``run_cli``
    runs it (a state it makes is a simulated one, where the other commands may write)."""
    r = subprocess.run(
        [sys.executable, "-c", PROBE.format(args=args, prefixes=prefixes)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, CLOCK_ENV: TEST_START.isoformat()},
    )
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("HEAVY="))
    return [m for m in line.removeprefix("HEAVY=").split(",") if m]


@pytest.mark.slow  # fresh interpreters, each one's modules read
def test_help_and_plan_load_no_cloud_sdk(home):
    assert modules_loaded_by("--help") == []
    assert modules_loaded_by("plan", str(EXAMPLES / "experiment.yaml")) == []
    assert modules_loaded_by("catalog", "--gpu", "H100") == []


@pytest.mark.slow  # fresh interpreters, each one's modules read
def test_help_and_plan_load_no_database_code(home):
    """SQLAlchemy costs ~0.2 s: only commands that use the state pay it (``plan`` only when a
    budget or a machine-count rule applies)."""
    state = ("sqlalchemy", "alembic", "provisioner.state", "provisioner.models")
    assert modules_loaded_by("--help", prefixes=state) == []
    assert modules_loaded_by("plan", str(EXAMPLES / "experiment.yaml"), prefixes=state) == []


def test_plan_loads_no_http_client(home):
    """``plan`` validates an experiment's signals without importing the on-machine agent, whose
    HTTP client it does not need (bench/bench_plan.py times the command)."""
    from provisioner import agent, spec

    assert spec.SIGNALS == agent.SIGNALS
    http = ("provisioner.agent", "urllib.request", "http.client")
    assert modules_loaded_by("plan", str(EXAMPLES / "experiment.yaml"), prefixes=http) == []


def test_help_loads_no_renderer_reader_or_validator(home):
    """`--help` is Typer and our command list: no rich console or markdown, no YAML reader, no
    pydantic (bench/bench_cli.py times it against `sky --help`)."""
    assert modules_loaded_by("--help", prefixes=("rich", "yaml", "pydantic", "markdown_it")) == []


@pytest.mark.slow  # a dozen fresh interpreters, each one's modules read
def test_status_loads_no_database_code_unless_it_has_something_to_write(home):
    """`status` of a SQLite state is standard-library SQL while the clouds find every machine
    as recorded (bench/bench_status.py times it at 1,000 machines); a state to migrate, or a
    machine the sandbox preempted, goes the full way, which records what moved."""
    import providers
    from providers.base import InstanceRef

    state = ("sqlalchemy", "alembic", "provisioner.state", "provisioner.models")
    assert modules_loaded_by("status", prefixes=state)  # a new state: created and migrated
    assert modules_loaded_by("status", prefixes=state) == []
    assert run_cli("status", "-o", "json").stdout.strip() == "[]"
    spec = write_yaml(home.parent / "exp.yaml", sandbox_experiment("one"))
    assert run_cli("up", str(spec)).returncode == 0
    assert modules_loaded_by("status", prefixes=state) == []
    assert modules_loaded_by("status", "--all", "-o", "json", prefixes=state) == []
    [machine] = json.loads(run_cli("status", "-o", "json").stdout)
    assert (machine["name"], machine["status"]) == ("one", "running")
    sandbox = providers.create("sandbox", {"db_path": str(home / "sandbox.db")})
    sandbox.preempt(  # type: ignore[attr-defined]
        InstanceRef(machine["instance_id"], machine["region"], machine["zone"])
    )
    sandbox.close()  # type: ignore[attr-defined]
    assert "provisioner.models" in modules_loaded_by("status", prefixes=state)
    [machine] = json.loads(run_cli("status", "-o", "json").stdout)
    assert machine["status"] == "preempted"  # recorded: the next status reads it as it is
    assert modules_loaded_by("status", prefixes=state) == []


@pytest.mark.slow  # fresh interpreters, each one's modules read
def test_status_of_an_empty_state_loads_no_typer_renderer_or_validator(home):
    """Without a settings file, an empty `status` is the standard library: no Typer or Click,
    no rich (its output is not a terminal), no pydantic or YAML (bench/bench_status.py times
    it); a settings file is still validated (pydantic, still no Typer)."""
    light = ("typer", "click", "rich", "pydantic", "yaml", "provisioner.settings")
    assert run_cli("status").returncode == 0  # creates and migrates the state
    assert modules_loaded_by("status", prefixes=light) == []
    assert modules_loaded_by("status", "--all", "-o", "json", prefixes=light) == []
    cfg = write_settings(home)
    validated = modules_loaded_by("-c", str(cfg), "status", prefixes=("typer", "click", "prov"))
    assert "provisioner.settings" in validated and "typer" not in validated
    spec = write_yaml(home.parent / "exp.yaml", sandbox_experiment("one"))
    assert run_cli("up", str(spec)).returncode == 0
    assert modules_loaded_by("status", "--no-refresh", prefixes=light) == []
    # asking the sandbox builds its adapter with its typed options (pydantic): no Typer still
    assert modules_loaded_by("status", prefixes=light[:3]) == []


def test_the_state_found_without_settings_is_the_one_settings_give(home, tmp_path, monkeypatch):
    """`status` finds the state with the standard library exactly where Settings would, and
    leaves to Settings whatever they must validate or decide."""
    from provisioner.location import FIELDS, HEARTBEAT_GRACE_SECONDS, plain_database_url
    from provisioner.settings import Settings, load_settings

    assert set(FIELDS) == set(Settings.model_fields)
    assert Settings().scheduler.heartbeat_grace_seconds == HEARTBEAT_GRACE_SECONDS
    elsewhere = tmp_path / "elsewhere"
    found = {}
    for name, env in {
        "home": {},
        "home with ~": {"PROVISIONER_HOME": "~/p"},
        "state_url": {"PROVISIONER_STATE_URL": f"sqlite:///{elsewhere}/s.db"},
        "no home": {"PROVISIONER_HOME": None, "HOME": str(tmp_path)},
        "not a setting": {"PROVISIONER_NOT_A_SETTING": "1", "PROVISIONER_SMTP_PASSWORD": "x"},
    }.items():
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.delenv(k) if v is None else m.setenv(k, v)
            found[name] = plain_database_url()
            assert found[name] == load_settings().database_url, name
    assert found["state_url"] == f"sqlite:///{elsewhere}/s.db"
    assert found["home"] == f"sqlite:///{home}/state.db"
    (tmp_path / "a-file").write_text("")
    for name, env in {
        "another setting": {"PROVISIONER_CURRENCY": "EUR"},
        "a nested one": {"provisioner_scheduler__lease_seconds": "60"},
        "lower case": {"provisioner_home": str(elsewhere)},
        "empty": {"PROVISIONER_HOME": ""},
        "home is a file": {"PROVISIONER_HOME": str(tmp_path / "a-file")},
        "a bad URL": {"PROVISIONER_STATE_URL": "mysql://x"},
        "a settings file": {"PROVISIONER_CONFIG": str(write_settings(home))},
    }.items():
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            assert plain_database_url() is None, name


def test_status_of_an_empty_state_says_what_the_full_command_says(cli, home, monkeypatch):
    """The fast answer is the Typer command's, byte for byte; bad settings are refused as
    for any command (file, line, field; exit 2)."""
    from provisioner.cli.main import main as typer_main

    assert cli("status").code == 0  # creates the state
    argvs = [
        ("status",),
        ("status", "--all"),
        ("status", "-a", "--no-refresh", "-o", "json"),
        ("status", "--output=table"),
        ("-c", str(write_settings(home)), "status", "-o", "json"),
        ("status", "-o", "json", "-o", "table"),  # Click's reading: the last one
    ]
    for argv in argvs:
        fast = cli(*argv)
        with monkeypatch.context() as m:
            m.setattr("tests.cli_runner.main", typer_main)
            full = cli(*argv)
        assert (fast.code, fast.out, fast.err) == (full.code, full.out, full.err), argv
        assert fast.code == 0 and ("no machines" in fast.out or fast.out == "[]\n"), argv
    monkeypatch.setenv("PROVISIONER_HOME", str(write_yaml(home.parent / "f.yaml", {})))
    r = cli("status")
    assert r.code == 2 and "is not a directory" in r.err and "Traceback" not in r.err
    monkeypatch.setenv("PROVISIONER_HOME", str(home))
    bad = write_yaml(home.parent / "bad.yaml", {"scheduler": {"lease_seconds": "soon"}})
    r = cli("-c", str(bad), "status", "-o", "json")
    assert r.code == 2 and f"{bad}:2: scheduler.lease_seconds: " in r.err, r.err
    assert json.loads(r.out)["exit_code"] == 2


def answered_both_ways(cli, monkeypatch, *argv: str):
    """``argv`` answered by the console entry point without Typer, then by the Typer command:
    the same exit code, stdout and stderr. The first answer."""
    from provisioner.cli.main import main as typer_main

    with monkeypatch.context() as m:
        m.setattr("provisioner.cli.main.main", lambda: pytest.fail("answered by Typer"))
        fast = cli(*argv)
    with monkeypatch.context() as m:
        m.setattr("tests.cli_runner.main", typer_main)
        full = cli(*argv)
    assert (fast.code, fast.out, fast.err) == (full.code, full.out, full.err), argv
    return fast


def test_status_of_a_fleet_says_what_the_full_command_says(cli, home, monkeypatch):
    """`status` answered without Typer (SQLite, no settings, the sandbox finding every machine
    as recorded) is the Typer command's answer byte for byte, however it is asked: running,
    stopped, terminated and failed machines, costs at one instant, the failure's reason."""
    import providers
    from provisioner.clock import ShiftedClock

    for n in ("m-a", "m-b", "m-c", "m-d"):
        assert cli("up", str(write_yaml(home.parent / f"{n}.yml", sandbox_experiment(n)))).code == 0
    assert cli("stop", "m-b").code == 0
    assert cli("down", "m-c").code == 0
    sandbox = providers.create("sandbox", {"db_path": str(home / "sandbox.db")})
    sandbox.inject(auth_fail=True)  # type: ignore[attr-defined]
    assert cli("up", str(write_yaml(home.parent / "e.yml", sandbox_experiment("m-e")))).code != 0
    sandbox.inject(auth_fail=False)  # type: ignore[attr-defined]
    sandbox.close()  # type: ignore[attr-defined]
    later = TEST_START + timedelta(hours=5, seconds=7, microseconds=1)
    monkeypatch.setattr(ShiftedClock, "now", lambda self: later)
    for argv in [
        ("status",),
        ("status", "--all"),
        ("status", "-o", "json"),
        ("status", "-a", "--no-refresh", "-o", "json"),
        ("status", "--no-refresh"),
    ]:
        answered_both_ways(cli, monkeypatch, *argv)
    # a settings file's grace for heartbeats: an agent heard 20 min ago, seeing no GPU, is news
    # with an hour's grace, not with the default 5 min
    from provisioner.app import App
    from provisioner.clock import ManualClock
    from provisioner.models import Heartbeat
    from provisioner.settings import load_settings

    cfg = write_settings(home, scheduler={"heartbeat_grace_seconds": 3600})
    a = App(load_settings(cfg), ManualClock(later))
    with a.db.session() as s:
        heard = json.loads(cli("status", "-o", "json").out)[0]
        at = later - timedelta(minutes=20)
        s.add(Heartbeat(machine_id=heard["id"], at=at, gpus=[], max_util=None))
    a.close()
    assert "warning" not in cli("status").err
    for argv in [("-c", str(cfg), "status"), ("-c", str(cfg), "status", "-a", "-o", "json")]:
        fast = answered_both_ways(cli, monkeypatch, *argv)
        assert f"warning: {heard['name']}: the agent sees 0 of 1 GPUs" in fast.err
    rows = {r["name"]: r for r in json.loads(cli("status", "-a", "-o", "json").out)}
    assert {n: r["status"] for n, r in rows.items()} == {
        "m-a": "running",
        "m-b": "stopped",
        "m-c": "terminated",
        "m-d": "running",
        "m-e": "failed",
    }
    assert rows["m-a"]["spent"] and rows["m-e"]["why"].startswith("no candidate launched")
    assert "m-e failed: no candidate launched" in cli("status", "--all").out


def test_plan_a100x8_spot_offline_spans_all_five_clouds(home):
    r = run_cli("plan", str(EXAMPLES / "experiment.yaml"), "--top", "500", "-o", "json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    ranked = {c["cloud"] for c in plan["candidates"]}
    assert ranked == {"aws", "gcp", "azure", "yandex"}
    assert {u["cloud"] for u in plan["unpriced"]} == {"sbercloud"}  # listed, honestly unpriced
    prices = [c["price_per_hour_base"]["amount"] for c in plan["candidates"]]
    assert [float(p) for p in prices] == sorted(float(p) for p in prices)
    assert all(c["market"] == "spot" and c["gpu_count"] == 8 for c in plan["candidates"])
    yandex = next(c for c in plan["candidates"] if c["cloud"] == "yandex")
    assert yandex["price_per_hour"]["currency"] == "RUB"
    assert (
        Decimal(yandex["price_per_hour_base"]["amount"])
        == Decimal(yandex["price_per_hour"]["amount"]) / 80
    )
    assert plan["rejected"]["other GPU type"] > 0
    # AWS launches spot as one-time requests, which it cannot stop: the plan says so in words
    assert [w for w in plan["warnings"] if w.startswith("aws ")] == [
        "aws cannot stop a spot machine: an out-of-hours idle stop terminates it and its boot "
        "disk, not its volumes (its owner is warned first); `provisioner down` is how it ends"
    ]
    assert not any(w.startswith(("gcp ", "azure ", "yandex ")) for w in plan["warnings"])


def test_plan_table_names_reasons_and_rates(home):
    r = run_cli("plan", str(EXAMPLES / "experiment.yaml"))
    assert r.returncode == 0, r.stderr
    assert "cheapest per cloud" in r.stdout and "1 USD = 80 RUB" in r.stdout
    assert "turned down" in r.stdout and "sbercloud" in r.stdout
    assert "aws cannot stop a spot machine" in " ".join(r.stdout.split())


def test_sbercloud_prices_from_settings_make_it_rank(home):
    import csv

    rows = list(csv.DictReader((ROOT / "provisioner/data/catalog/sbercloud.csv").open()))
    flavor = next(r["instance_type"] for r in rows if r["gpu"] == "T4" and r["gpu_count"] == "1")
    cfg = write_settings(
        home,
        clouds={"sbercloud": {}},
        prices={"sbercloud": {flavor: {"price": "90", "spot_price": "30"}}},
    )
    spec = home.parent / "t4.yaml"
    spec.write_text(
        "name: t4\nproject: p\nowner: o\nresources:\n  gpu: T4:1\n  market: spot\n"
        "  clouds: [sbercloud]\n"
    )
    r = run_cli("--config", str(cfg), "plan", str(spec), "-o", "json")
    plan = json.loads(r.stdout)
    assert plan["candidates"][0]["price_per_hour"] == {"amount": "30", "currency": "RUB"}
    assert "price from settings" in plan["candidates"][0]["source"]


def test_catalog_lists_cheapest_per_cloud(home):
    r = run_cli("catalog", "--gpu", "A100", "-o", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    eights = {row["cloud"]: row for row in rows if row["gpu_count"] == 8 and row["gpu"] == "A100"}
    assert {"aws", "gcp", "azure"} <= set(eights)
    assert all("spot" in row or "reserved" in row for row in eights.values())
    table = run_cli("catalog")
    assert table.returncode == 0 and "H100" in table.stdout and "T4" in table.stdout


def test_quickstart_end_to_end_through_the_cli(home):
    cfg = write_settings(home)
    up = run_cli("--config", str(cfg), "up", str(EXAMPLES / "quickstart.yaml"))
    assert up.returncode == 0, up.stderr
    assert "launched quickstart on sandbox" in up.stdout and "USD/h" in up.stdout
    assert "trying sandbox/" in up.stderr  # progress while it tries candidates
    assert "step 3/3" in up.stdout and "run exited 0: quickstart stopped" in up.stdout
    st = run_cli("--config", str(cfg), "status", "-o", "json")
    assert [m["status"] for m in json.loads(st.stdout)] == ["stopped"]  # on_finish: stop
    for cmd, word in (
        ("stop", "already"),
        ("start", "started"),
        ("stop", "stopped"),
        ("start", "started"),
        ("down", "terminated"),
        ("down", "already gone"),
    ):
        r = run_cli("--config", str(cfg), cmd, "quickstart")
        assert r.returncode == 0 and word in r.stdout, (cmd, r.stdout, r.stderr)


def test_unknown_machine_is_exit_2(home):
    r = run_cli("stop", "nothing-here")
    assert r.returncode == 2 and "no machine named 'nothing-here'" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_settings_file_names_line(home, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("currency: USD\nclouds:\n  aws: {}\n  oracle: {}\n")
    r = run_cli("--config", str(cfg), "catalog")
    assert r.returncode == 2 and f"{cfg}:4: clouds.oracle: unknown field" in r.stderr


def test_a_misspelt_cloud_option_is_an_error_with_its_line(home, tmp_path):
    """Each cloud's options are typed: a typo is never a default quietly used."""
    cfg = tmp_path / "typo.yaml"
    cfg.write_text(
        "clouds:\n  aws:\n    regoins: [eu-west-1]\n    endpont_url: http://x\n"
        "  gcp:\n    zones: us-central1-a\n  sandbox: {}\n"
    )
    r = run_cli("--config", str(cfg), "catalog")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{cfg}:3: clouds.aws.regoins: unknown field" in r.stderr
    assert f"{cfg}:4: clouds.aws.endpont_url: unknown field" in r.stderr
    assert f"{cfg}:6: clouds.gcp.zones:" in r.stderr  # a string is not a list of zones


def test_check_without_credentials_is_one_line_per_cloud(home, tmp_path):
    cfg = write_settings(
        home, clouds={c: {} for c in ("aws", "gcp", "azure", "yandex", "sbercloud")}
    )
    scrubbed = {
        k: ""
        for k in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "AWS_PROFILE",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "AZURE_CLIENT_ID",
            "AZURE_CLIENT_SECRET",
            "AZURE_TENANT_ID",
            "AZURE_SUBSCRIPTION_ID",
            "YC_TOKEN",
            "YC_IAM_TOKEN",
            "YC_SERVICE_ACCOUNT_KEY_FILE",
            "SBERCLOUD_ACCESS_KEY",
            "SBERCLOUD_SECRET_KEY",
            "HUAWEICLOUD_SDK_AK",
            "HUAWEICLOUD_SDK_SK",
        )
    }
    empty_home = tmp_path / "nobody"  # no ~/.aws, no gcloud, no az login
    empty_home.mkdir()
    r = run_cli(
        "--config",
        str(cfg),
        "check",
        env={
            **scrubbed,
            "HOME": str(empty_home),
            "AWS_CONFIG_FILE": str(empty_home / "x"),
            "AWS_SHARED_CREDENTIALS_FILE": str(empty_home / "y"),
        },
    )
    assert r.returncode == 0, r.stderr
    lines = {ln.split()[1]: ln for ln in r.stdout.splitlines() if ln.strip()}
    assert sorted(lines) == ["aws", "azure", "gcp", "sandbox", "sbercloud", "yandex"]
    assert lines["sandbox"].startswith("ok")
    assert all(lines[c].startswith("no") for c in lines if c != "sandbox"), lines
    assert "Traceback" not in r.stderr


MISSING_SDK = """
import sys

import pytest
sys.modules["boto3"] = None  # as if `pip install gpu-provisioner` without the [aws] extra
sys.argv = ["provisioner", *sys.argv[1:]]
from provisioner.cli.main import main
main()
"""


@pytest.mark.slow  # a fresh interpreter without the SDK
def test_a_cloud_whose_sdk_is_missing_names_the_extra(home, tmp_path):
    cfg = write_settings(home, clouds={"aws": {}})
    spec = tmp_path / "exp.yaml"
    spec.write_text(
        "name: tiny\nproject: p\nresources: {gpu: 'T4:1', market: spot, clouds: [aws]}\n"
    )

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", MISSING_SDK, "--config", str(cfg), *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )

    check = run("check")
    assert "its SDK (boto3) is not installed: pip install 'gpu-provisioner[aws]'" in check.stdout
    up = run("up", str(spec))
    assert up.returncode == 2 and "Traceback" not in up.stderr, up.stderr
    assert "pip install 'gpu-provisioner[aws]'" in up.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["no-such-command"],
        ["stauts"],
        ["up"],
        ["status", "--bogus"],
        ["status", "-o", "yaml"],
        ["down", "--project"],
        ["ssh"],
        ["plan", "--top", "many", "x.yaml"],
    ],
)
def test_a_usage_error_is_one_message_and_exit_2(home, args):
    r = run_cli(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "Error:" in r.stderr
