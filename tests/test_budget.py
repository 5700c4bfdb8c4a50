"""Budgets from policy files: plan shows the projection, up is refused over budget (with the
numbers) and allowed when it fits, threshold alerts fire once each, an exhausted budget blocks
launches and stops (or terminates) the machines in scope."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from sqlalchemy import select

from provisioner import budget, machines, planning
from provisioner.app import App
from provisioner.errors import OperationFailed, UserError
from provisioner.jobs import enforce, lease
from provisioner.models import Event, Machine
from provisioner.money import Money
from provisioner.spec import Experiment
from tests.conftest import make_settings, run_cli, sandbox_experiment, write_settings, write_yaml
from tests.test_mail import smtp_server  # noqa: F401  (fixture)

PER_H = Decimal("0.15") + Decimal("0.10") * 50 / 730  # T4 spot in sandbox-us, with its disk


def policy(amount: str = "100 USD", **extra) -> dict:
    return {
        "name": "demo-budget",
        "applies_to": {"projects": ["demo"]},
        "budget": {
            "amount": amount,
            "alerts": {"actual": [50, 80, 100], "forecast": [100]},
            "recipients": ["lead@example.com"],
            **extra,
        },
    }


@pytest.fixture
def policy_dir(tmp_path):
    d = tmp_path / "policies"
    d.mkdir()
    return d


@pytest.fixture
def bapp(home, clock, policy_dir, db_url, smtp_server):  # noqa: F811
    a = App(
        make_settings(
            home, state_url=db_url, policies=[str(policy_dir)], smtp=smtp_server.smtp.model_dump()
        ),
        clock,
    )
    yield a
    a.close()


def set_policy(app: App, path, data: dict) -> None:
    """Write a policy file; an App reads the policies once, so make it read them again."""
    write_yaml(path, data)
    app.__dict__.pop("policies", None)


def experiment(name="exp", lifetime=None, **res) -> Experiment:
    data = sandbox_experiment(name, **res)
    if lifetime:
        data["lifecycle"] = {"max_lifetime": lifetime}
    return Experiment.model_validate(data)


def test_plan_shows_the_projection(bapp, policy_dir):
    set_policy(bapp, policy_dir / "p.yaml", policy("200 USD"))
    p = planning.plan(bapp, experiment())
    [proj] = [c for c in p.checks if isinstance(c, budget.Projection)]
    hours = Decimal(24 * 29 - 9)  # Mon Nov 2 09:00 → Dec 1 00:00
    assert proj.hours == hours
    assert proj.cheapest[1].rounded().amount == (PER_H * hours).quantize(Decimal("0.01"))
    assert str(proj).startswith("budget demo-budget (2026-11): 200.00 USD; spent 0.00 USD")
    assert "→ fits" in str(proj)
    cost = proj.as_json()["projected_cost"]  # exact in JSON, 107.76 USD to people
    assert proj.as_json()["fits"] is True and cost == {"amount": "107.755479452", "currency": "USD"}
    assert Money.parse(cost).text() == "107.76 USD"


def test_up_refused_over_budget_and_allowed_when_it_fits(bapp, policy_dir):
    set_policy(bapp, policy_dir / "p.yaml", policy("100 USD"))
    with pytest.raises(
        UserError,
        match=r"refused by budget demo-budget \(2026-11\): 100\.00 USD "
        r"budget, 0\.00 USD spent.*would cost 107\.76 USD over 687\.0 h",
    ):
        machines.up(bapp, experiment())
    # a max lifetime bounds the projection: 48 h fits
    m = machines.up(bapp, experiment("short", lifetime="48h")).machine
    assert m.status == "running"
    # what the live machine still commits counts: 100 − 48 h of it leaves too little for 687 h
    p = planning.plan(bapp, experiment("more", lifetime="600h"))
    [proj] = [c for c in p.checks if isinstance(c, budget.Projection)]
    assert proj.status.committed.rounded().amount == (48 * PER_H).quantize(Decimal("0.01"))
    assert proj.over
    with pytest.raises(UserError, match="committed by live machines"):
        machines.up(bapp, experiment("more", lifetime="600h"))


def test_failover_skips_offers_the_budget_cannot_afford(home, clock, policy_dir, db_url):
    app = App(
        make_settings(
            home,
            state_url=db_url,
            policies=[str(policy_dir)],
            sandbox={"capacity": {"sandbox-us-1a": 0, "sandbox-us-1b": 0, "sandbox-us-1c": 0}},
        ),
        clock,
    )
    # 100 h: 15.68 USD in sandbox-us, 16.68 USD in sandbox-eu; 16 USD left
    set_policy(app, policy_dir / "p.yaml", policy("16 USD"))
    plan = planning.plan(app, experiment(lifetime="100h"))
    assert budget.guard(plan).rejected["over the budget left"] > 0
    assert {c.offer.region for c in plan.candidates} == {"sandbox-us"}
    with pytest.raises(OperationFailed, match="on any of 3 candidates"):
        machines.up(app, experiment(lifetime="100h"))
    app.close()


def test_up_refusal_exits_2_from_the_cli(home, tmp_path, policy_dir):
    write_yaml(policy_dir / "p.yaml", policy("1 USD"))
    cfg = write_settings(home, policies=[str(policy_dir)])
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("exp"))
    r = run_cli("--config", str(cfg), "up", str(spec))
    assert r.returncode == 2, r.stderr
    assert "refused by budget demo-budget" in r.stderr and "1.00 USD budget" in r.stderr
    planned = run_cli("--config", str(cfg), "plan", str(spec))
    # refused, as `up` is: exit 2 (the plan and the verdict still shown)
    assert planned.returncode == 2 and "budget demo-budget" in planned.stdout
    assert "OVER by" in planned.stdout


@pytest.mark.parametrize("how", ["stop", "terminate"])
def test_alerts_once_each_then_exhaustion_blocks_and_stops(
    bapp,
    policy_dir,
    clock,
    smtp_server,  # noqa: F811
    how,
):
    m = machines.up(bapp, experiment("big", gpu="A100:8", market="spot")).machine  # 11 USD/h
    set_policy(bapp, policy_dir / "p.yaml", policy("2000 USD", on_exhausted=how))
    clock.advance(timedelta(hours=1))
    seen = []

    def enforced() -> list[str]:
        acts = enforce.run(bapp, clock.now())
        seen.extend(str(a) for a in acts)
        return [f"{a.kind}:{a.detail.split(' (')[0]}" for a in acts]

    assert enforced() == ["alert:forecast 378 %"]  # 11 USD/h for the 686 h left
    assert enforced() == []
    clock.advance(timedelta(hours=99))  # 100 h: 1,100.68 USD
    assert enforced() == ["alert:actual 55 %"]
    assert enforced() == []
    clock.advance(timedelta(hours=50))  # 150 h
    assert enforced() == ["alert:actual 83 %"]
    assert seen[-1].endswith("(threshold 80 %)")  # a threshold as people write it, not 8E+1
    clock.advance(timedelta(hours=32))  # 182 h: 2,003.25 USD
    acts = enforced()
    assert acts[:2] == [
        "alert:actual 100 %",
        "exhausted:2,003.25 USD of 2,000.00 USD; launches blocked",
    ]
    assert acts[2].startswith(f"{how}:budget exhausted")
    assert enforced() == []
    subjects = [msg["Subject"] for _, msg in smtp_server.inbox.messages]
    assert subjects == [
        "demo-budget: forecast 378 % of budget by the end of 2026-11",
        "demo-budget: 55 % of budget spent ($1,100.68 of $2,000.00)",
        "demo-budget: 83 % of budget spent ($1,651.03 of $2,000.00)",
        "demo-budget: 100 % of budget spent ($2,003.25 of $2,000.00)",
    ]
    assert all(rcpt == ["lead@example.com"] for rcpt, _ in smtp_server.inbox.messages)
    with bapp.db.session() as s:
        mm = s.get(Machine, m.id)
        last = s.scalars(
            select(Event).where(Event.machine_id == m.id).order_by(Event.id.desc())
        ).first()
    assert mm.status == ("stopped" if how == "stop" else "terminated")
    assert last.reason == "budget"
    with pytest.raises(UserError, match=r"refused by budget demo-budget.*-[\d,.]+ USD left"):
        machines.up(bapp, experiment("another", lifetime="1h"))


def test_block_only_keeps_machines_running(bapp, policy_dir, clock, smtp_server):  # noqa: F811
    m = machines.up(bapp, experiment()).machine
    set_policy(bapp, policy_dir / "p.yaml", policy("1 USD", recipients=[]))
    clock.advance(timedelta(hours=10))  # 1.57 USD
    kinds = [a.kind for a in enforce.run(bapp, clock.now())]
    assert kinds == ["alert", "alert", "exhausted"]  # actual (50, 80, 100 at once), forecast
    assert smtp_server.inbox.messages == []  # nobody to tell
    with bapp.db.session() as s:
        assert s.get(Machine, m.id).status == "running"
    with pytest.raises(UserError, match="refused by budget"):
        machines.up(bapp, experiment("second", lifetime="1h"))


def test_a_second_scheduler_leaves_budget_stops_to_the_lease_holder(bapp, policy_dir, clock):
    """Two schedulers enforce every minute: only the one holding the lease stops machines,
    the other still sends (its share of) the alerts, each once."""
    m = machines.up(bapp, experiment()).machine
    set_policy(bapp, policy_dir / "p.yaml", policy("1 USD", recipients=[], on_exhausted="stop"))
    clock.advance(timedelta(hours=10))  # 1.57 USD
    assert lease.acquire(bapp, "budget.enforce", clock.now(), holder="other-scheduler")
    kinds = [a.kind for a in enforce.run(bapp, clock.now())]
    assert kinds == ["alert", "alert", "exhausted"]  # no stop: the lease holder stops it
    with bapp.db.session() as s:
        assert s.get(Machine, m.id).status == "running"
    [stop] = enforce.run(bapp, clock.now(), holder="other-scheduler")
    assert (stop.kind, stop.machine, stop.error) == ("stop", m.name, None)
    with bapp.db.session() as s:
        assert s.get(Machine, m.id).status == "stopped"


def test_a_failed_mail_is_retried_next_run(bapp, policy_dir, clock, smtp_server):  # noqa: F811
    machines.up(bapp, experiment("big", gpu="A100:8"))
    set_policy(bapp, policy_dir / "p.yaml", policy("2000 USD"))
    clock.advance(timedelta(hours=1))
    bapp.settings.smtp.port = 1  # nothing listens there
    [a] = enforce.run(bapp, clock.now())
    assert a.error and "failed" in a.error
    bapp.settings.smtp.port = smtp_server.smtp.port
    assert [x.error for x in enforce.run(bapp, clock.now())] == [None]
    assert len(smtp_server.inbox.messages) == 1


def test_the_projection_follows_the_clock_the_cli_is_given(home, tmp_path, policy_dir):
    """The refusal above is the projection over what is left of the month: in its last hours a
    0.15 USD/h machine no longer exceeds 1 USD, and ``up`` goes ahead (the CLI's clock comes from
    the test, so neither outcome depends on the day the suite runs)."""
    from datetime import UTC, datetime

    write_yaml(policy_dir / "p.yaml", policy("1 USD"))
    cfg = write_settings(home, policies=[str(policy_dir)])
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("late"))
    late = run_cli(
        "--config", str(cfg), "up", str(spec), now=datetime(2026, 11, 30, 22, tzinfo=UTC)
    )
    assert late.returncode == 0, late.stderr
    bad = run_cli("--config", str(cfg), "status", env={"PROVISIONER_CLOCK": "yesterday"})
    assert bad.returncode == 2 and "PROVISIONER_CLOCK" in bad.stderr
    assert "Traceback" not in bad.stderr
