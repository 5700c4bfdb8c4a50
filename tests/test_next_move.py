"""One next action: the dashboard's "Next scheduled action" and `sweep --dry-run` are one decision
(:func:`provisioner.jobs.outlook.moves`), checked over a generated fleet of kept, busy,
preempted, held, left, waiting, autostop and lifetime-bound machines on a ManualClock, on SQLite
and PostgreSQL. The dashboard is read as a browser gets it (WSGI), the dry run as a user runs it
(a CLI process on the same clock)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest

from provisioner import machines
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.dashboard import make_app
from provisioner.jobs import sweep
from provisioner.machines import waiting
from provisioner.models import Event
from provisioner.spec import Experiment
from tests.conftest import make_settings, run_cli, sandbox_experiment, write_settings
from tests.test_autostop import beats
from tests.test_dashboard import call
from tests.test_scheduler import up

NOW = datetime(2026, 11, 26, 10, 0, tzinfo=UTC)  # Thursday 11:00 in Berlin: in hours
OFF_AT = datetime(2026, 11, 26, 18, 20, tzinfo=UTC)  # 19:20 in Berlin: out of hours from then
POLICY = """
name: lab
applies_to: {projects: ["demo"]}
off_hours:
  timezone: Europe/Berlin
  windows: [{days: mon-fri, start: "19:20", end: "07:00"}]
idle: {gpu_util_below: 5, for_minutes: 30, action: stop}
"""
ZONES = ("sandbox-us-1a", "sandbox-us-1b", "sandbox-us-1c", "sandbox-eu-1a", "sandbox-ru-1a")


@pytest.fixture
def fleet(home, db_url, tmp_path):
    """The generated fleet, launched an hour before NOW; the clock at NOW."""
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    app = App(
        make_settings(home, state_url=db_url, policies=[str(path)]),
        ManualClock(NOW - timedelta(hours=1)),
    )
    m = {name: up(app, name) for name in ("busy", "kept", "taken", "held")}
    m["left"] = up(app, "left", lifecycle={"on_preemption": "leave"})
    m["bounded"] = up(app, "bounded", lifecycle={"max_lifetime": "3h"})
    m["auto"] = up(app, "auto", lifecycle={"autostop": "30m"})
    sandbox = app.provider("sandbox")
    sandbox.inject(capacity={z: 0 for z in ZONES})  # every zone full: `waits` queues
    with pytest.raises(KeyboardInterrupt):
        waiting.up_until_up(
            app,
            Experiment.model_validate(sandbox_experiment("waits")),
            wait=timedelta(hours=6),
            sleep=lambda _: (_ for _ in ()).throw(KeyboardInterrupt),
        )
    sandbox.inject(capacity={})
    app.clock.set(NOW)
    beats(app, m["busy"], [(40, 0, 80.0, 0)])
    beats(app, m["kept"], [(40, 0, 0.0, 0)])  # idle, but kept: nothing before the keep ends
    beats(app, m["bounded"], [(40, 0, 70.0, 0)])
    beats(app, m["auto"], [(40, 11, 90.0, 0), (10, 0, 0.0, 0)])  # idle for the last 10 min
    sweep.keep(app, "kept", "23:00")  # 23:00 in Berlin
    for name in ("taken", "held", "left"):
        sandbox.preempt(machines.ref(m[name]))
    machines.reconcile(app)
    refused = "refused by budget lab (2026-11): 1,210.00 USD of 1,200.00 USD"
    with app.db.session() as s:  # a relaunch refused a minute ago: held, the next try later
        s.add(
            Event(
                machine_id=m["held"].id,
                at=NOW - timedelta(minutes=1),
                kind="relaunch-refused",
                reason="preempted",
                detail={"refused": refused, "attempts": 1, "last_try": NOW.isoformat()},
            )
        )
    yield app, path
    app.close()


def dashboard_moves(app: App) -> dict[str, tuple[str, str, str]]:
    """Per machine on the fleet page: (action, due at, the cell's text)."""
    status, _, html = call(make_app(app), "/")
    assert status == 200
    out = {}
    for row in re.findall(r'<tr data-machine="([^"]+)">(.*?)</tr>', html, re.S):
        name, cells = row
        cell = re.search(
            r'<td class="next"[^>]*data-next-action="([^"]*)" data-next-at="([^"]*)">(.*?)</td>',
            cells,
            re.S,
        )
        assert cell is not None, name
        text = re.sub(r"<[^>]+>", "", cell.group(3))
        out[name] = (cell.group(1), cell.group(2), " ".join(text.split()))
    return out


def _due(move: tuple[str, str]) -> tuple[str, str]:
    action, at = move
    if at and datetime.fromisoformat(at) < NOW + timedelta(minutes=1):
        return action, "due now"
    return action, at


def test_the_dashboard_and_the_dry_run_call_the_same_next_move(fleet):
    app, policy = fleet
    cfg = write_settings(
        app.settings.home, policies=[str(policy)], state_url=app.settings.state_url
    )
    r = run_cli("--config", str(cfg), "sweep", "--dry-run", "-o", "json", now=NOW)
    assert r.returncode == 0, r.stderr
    dry = json.loads(r.stdout)["next"]
    page = dashboard_moves(app)
    names = {"busy", "kept", "taken", "held", "left", "bounded", "auto", "waits"}
    assert set(page) == set(dry) == names
    for name in names:  # the CLI's clock runs on from NOW: "due now" is "due now" on both
        assert _due(page[name][:2]) == _due((dry[name]["action"], dry[name]["at"] or "")), name

    def at(name: str) -> datetime | None:
        v = dry[name]["at"]
        return datetime.fromisoformat(v) if v else None

    # kept until 23:00 Berlin: left alone until then, not "stop at 19:20" (the old contradiction)
    assert dry["kept"]["action"] == "keep" and at("kept") == datetime(2026, 11, 26, 22, tzinfo=UTC)
    assert "stop" not in page["kept"][2]
    # busy in hours: stopped out of hours if it idles, from 19:20 Berlin
    assert (dry["busy"]["action"], at("busy"), dry["busy"]["conditional"]) == ("stop", OFF_AT, True)
    # preempted, relaunch due: started in place at the next pass (the sandbox keeps its disk)
    assert _due(("start", dry["taken"]["at"])) == ("start", "due now")
    assert dry["taken"]["action"] == "start"
    assert "next sweep" in page["taken"][2]
    # held after a refused relaunch: the next try after its backoff, not "—"
    assert dry["held"]["action"] == "start" and at("held") == NOW + timedelta(minutes=1)
    assert "refused by budget lab" in dry["held"]["why"]
    assert dry["left"]["action"] == "none" and "leave" in page["left"][2]
    # the lifetime ends before the evening; the autostop 20 minutes from now
    assert (dry["bounded"]["action"], at("bounded")) == ("stop", NOW + timedelta(hours=2))
    assert dry["bounded"]["reason"] == "max-lifetime"
    assert (dry["auto"]["reason"], at("auto")) == ("autostop", NOW + timedelta(minutes=20))
    # queued an hour ago, its first backoff (a minute) long past: tried at the next pass
    assert _due(("try", dry["waits"]["at"])) == ("try", "due now")
    assert "capacity" in page["waits"][2]


def test_the_dry_runs_text_says_the_keep_and_the_next_move(fleet):
    app, policy = fleet
    cfg = write_settings(
        app.settings.home, policies=[str(policy)], state_url=app.settings.state_url
    )
    r = run_cli("--config", str(cfg), "sweep", "--dry-run", now=NOW)
    assert r.returncode == 0, r.stderr
    lines = {ln.split(":", 1)[0].strip(): ln for ln in r.stdout.splitlines() if ":" in ln}
    assert "kept until" in lines["kept"] and "stop" not in lines["kept"].split("[kept]")[0]
    assert "next: stop [off-hours-idle] at 2026-11-26 18:20 UTC if idle then" in lines["busy"]
    assert "in hours until 19:20 Europe/Berlin" in lines["busy"]
