"""Policy edits reach the running scheduler: at its next pass (and on SIGHUP) it reads edited
policy and settings files, swaps a valid set in and says what changed, and keeps the old set
when the new one is broken — reported once per broken version."""

from __future__ import annotations

import logging
import signal
import sqlite3
import time
from datetime import timedelta

import pytest
from sqlalchemy import select

from provisioner import machines
from provisioner.app import App
from provisioner.jobs import daemon, reload
from provisioner.models import Machine, Notice
from provisioner.spec import Experiment
from tests.conftest import make_settings, sandbox_experiment, write_settings, write_yaml
from tests.daemon import start_scheduler
from tests.test_mail import smtp_server  # noqa: F401  (fixture)


def budget_policy(amount: str) -> dict:
    return {
        "name": "nlp-research",
        "applies_to": {"projects": ["demo"]},
        "budget": {
            "amount": amount,
            "alerts": {"actual": [50, 100], "forecast": []},
            "on_exhausted": "stop",
            "recipients": ["lead@example.com"],
        },
    }


@pytest.fixture
def setup(home, clock, tmp_path, db_url, smtp_server):  # noqa: F811
    d = tmp_path / "policies"
    d.mkdir()
    write_yaml(d / "budget.yaml", budget_policy("1000 USD"))
    app = App(
        make_settings(
            home, state_url=db_url, policies=[str(d)], smtp=smtp_server.smtp.model_dump()
        ),
        clock,
    )
    yield app, d / "budget.yaml"
    app.close()


def pass_of(app: App, watcher: reload.Watcher, name: str):
    """The daemon's job ``name`` as ``scheduler run`` schedules it."""
    return next(call for n, call, _ in daemon.schedule(app, watcher) if n == name)


def test_a_lowered_budget_is_enforced_at_the_next_pass(setup, clock, smtp_server, caplog):  # noqa: F811
    app, path = setup
    data = sandbox_experiment("big", gpu="A100:8", market="spot")
    data["lifecycle"] = {"max_lifetime": "3h"}  # fits 1,000 USD
    m = machines.up(app, Experiment.model_validate(data)).machine  # about 11 USD/h
    watcher = reload.Watcher(app)
    enforce_pass = pass_of(app, watcher, "budget.enforce")
    clock.advance(timedelta(hours=2, minutes=11))  # about 24 USD of 1,000
    assert enforce_pass() == []

    write_yaml(path, budget_policy("20 USD"))  # the lead lowers it; the daemon keeps running
    with caplog.at_level(logging.WARNING, logger="provisioner.scheduler"):
        acts = [str(a) for a in enforce_pass()]
    assert "reload (pass): policy nlp-research: budget.amount 1000 USD → 20 USD" in caplog.text
    assert acts[0].startswith("budget nlp-research: alert: actual 1")
    assert any(a.startswith("budget nlp-research: exhausted: 24.") for a in acts), acts
    assert any(a.startswith("budget nlp-research: stop big") for a in acts), acts
    with app.db.session() as s:
        assert s.get(Machine, m.id).status == "stopped"
    assert [msg["Subject"] for _, msg in smtp_server.inbox.messages][-1].startswith(
        "nlp-research: 1"
    )


def test_a_broken_edit_keeps_the_old_policies_and_is_reported_once(
    setup,
    smtp_server,  # noqa: F811
    caplog,
):
    app, path = setup
    watcher = reload.Watcher(app)
    sweep_pass = pass_of(app, watcher, "sweep")
    broken = budget_policy("1000 USD")
    broken["budget"]["amount"] = "-5 USD"
    write_yaml(path, broken)
    with caplog.at_level(logging.WARNING, logger="provisioner.scheduler"):
        sweep_pass()
        sweep_pass()  # the same broken files: not reported again
        assert watcher.check() is None
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert "the edited files are broken, the old ones stay" in errors[0]
    assert "budget.yaml:" in errors[0] and "budget.amount" in errors[0]
    assert [p.budget.amount.amount for p in app.policies] == [1000]  # still in force
    ((to, msg),) = smtp_server.inbox.messages
    assert to == ["lead@example.com"] and "broken" in msg["Subject"]
    assert "budget.yaml" in msg.get_body().get_content()
    with app.db.session() as s:
        (notice,) = s.scalars(select(Notice).where(Notice.kind == reload.NOTICE_KIND))
        assert "budget.yaml" in notice.detail["error"]

    path.write_text("name: [unclosed\n")  # another broken version: reported too
    change = watcher.check()
    assert change is not None and change.error and change.alerted
    assert len(smtp_server.inbox.messages) == 2

    write_yaml(path, budget_policy("500 USD"))  # fixed: taken up
    change = watcher.check()
    assert change is not None and change.error is None
    assert change.changes == ["policy nlp-research: budget.amount 1000 USD → 500 USD"]
    assert [p.budget.amount.amount for p in app.policies] == [500]


def test_policies_added_and_removed_and_settings_are_reported(home, clock, tmp_path, caplog):
    d = tmp_path / "policies"
    d.mkdir()
    write_yaml(d / "a.yaml", budget_policy("100 USD"))
    cfg = write_settings(home, policies=[str(d)])
    from provisioner.settings import load_settings

    app = App(load_settings(cfg), clock)
    watcher = reload.Watcher(app, str(cfg))
    assert watcher.check() is None  # nothing edited
    (d / "a.yaml").touch()  # touched, not changed: nothing to say
    assert watcher.check() is None

    (d / "a.yaml").unlink()
    write_yaml(d / "b.yaml", {"name": "gpus", "max_gpus_per_machine": 4})
    text = cfg.read_text().replace("listen: 127.0.0.1:8787", "listen: 127.0.0.1:8788", 1)
    cfg.write_text(text.replace("sweep_interval_seconds: 300", "sweep_interval_seconds: 60"))
    change = watcher.check()
    assert change is not None and change.error is None
    assert "policy gpus added" in change.changes
    assert "policy nlp-research removed" in change.changes
    assert (
        "settings scheduler.listen: 127.0.0.1:8787 → 127.0.0.1:8788 (takes effect after a restart)"
        in change.changes
    )
    assert (
        "settings scheduler.sweep_interval_seconds: 300 → 60 (takes effect after a restart)"
        in change.changes
    )
    assert app.settings.scheduler.sweep_interval_seconds == 60
    assert [p.name for p in app.policies] == ["gpus"]


@pytest.mark.slow
def test_sighup_makes_the_running_scheduler_read_the_policies(home, tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    policy = tmp_path / "p.yaml"
    write_yaml(policy, {"name": "nights", "idle": {"gpu_util_below": 5}})
    cfg = write_settings(
        home,
        policies=[str(policy)],
        scheduler={"listen": f"127.0.0.1:{port}", "sweep_interval_seconds": 3600},
    )
    cfg.write_text(
        cfg.read_text()
        .replace("recover_interval_seconds: 120", "recover_interval_seconds: 3600")
        .replace("reconcile_interval_seconds: 600", "reconcile_interval_seconds: 3600")
    )
    log = tmp_path / "scheduler.log"
    proc = start_scheduler(cfg, port, log)  # until it listens (imports, migrations)
    try:
        # its first passes (each reads the files first) took their leases: they are done reading
        state = home / "state.db"
        for _ in range(600):
            if state.exists():
                with sqlite3.connect(state) as db:
                    try:
                        names = {r[0] for r in db.execute("SELECT name FROM scheduler_leases")}
                    except sqlite3.OperationalError:
                        names = set()
                if {"sweep", "recover", "reconcile"} <= names:
                    break
            time.sleep(0.1)
        else:
            raise AssertionError(f"no first passes: {log.read_text()}")

        write_yaml(policy, {"name": "nights", "idle": {"gpu_util_below": 7}})
        proc.send_signal(signal.SIGHUP)
        want = "reload (SIGHUP): policy nights: idle.gpu_util_below 5.0 → 7.0"
        for _ in range(600):
            if want in log.read_text():
                break
            time.sleep(0.1)
        else:
            raise AssertionError(log.read_text())

        policy.write_text("name: nights\nidle: {gpu_util_below: 500}\n")
        proc.send_signal(signal.SIGHUP)
        for _ in range(600):
            if "reload (SIGHUP): the edited files are broken" in log.read_text():
                break
            time.sleep(0.1)
        else:
            raise AssertionError(log.read_text())
        assert "p.yaml:2: idle.gpu_util_below" in log.read_text()
        assert proc.poll() is None  # still serving, on the old policies
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0, log.read_text()


def test_a_changed_secret_is_never_logged(home):
    old = make_settings(home, state_url="postgresql://ana:old-pass@db.example/prov")
    new = make_settings(
        home,
        state_url="postgresql://ana:new-p@ss@db.example/prov",
        dashboard={"token": "t0ken-value"},
    )
    lines = "\n".join(reload.diff_settings(old, new))
    assert "old-pass" not in lines and "new-p@ss" not in lines and "t0ken-value" not in lines
    assert "state_url: postgresql://ana:***@db.example/prov → postgresql://ana:***@" in lines
    assert "settings dashboard.token: (unset) → **********" in lines
