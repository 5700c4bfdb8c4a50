"""up / stop / start / down / reconcile on the sandbox cloud: failover, crash safety,
idempotence, and usage intervals that follow every transition."""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal

import pytest
from sqlalchemy import select

from provisioner import ledger, machines
from provisioner.app import App
from provisioner.errors import OperationFailed, UserError
from provisioner.models import Event, Machine, UsageInterval
from provisioner.spec import Experiment
from tests.conftest import make_settings, run_cli, sandbox_experiment, write_settings, write_yaml


def experiment(name="exp", **res) -> Experiment:
    return Experiment.model_validate(sandbox_experiment(name, **res))


@pytest.fixture
def sandbox_app(home, clock, db_url):
    def make(**sandbox) -> App:
        return App(make_settings(home, sandbox=sandbox, state_url=db_url), clock)

    return make


def events(app: App, m: Machine) -> list[tuple[str, str | None, str | None]]:
    with app.db.session() as s:
        return [
            (e.kind, e.reason, e.detail.get("zone"))
            for e in s.scalars(select(Event).where(Event.machine_id == m.id).order_by(Event.id))
        ]


def intervals(app: App, m: Machine) -> list[tuple[str, object, object]]:
    with app.db.session() as s:
        return [
            (iv.kind, iv.started_at, iv.ended_at)
            for iv in s.scalars(
                select(UsageInterval)
                .where(UsageInterval.machine_id == m.id)
                .order_by(UsageInterval.id)
            )
        ]


def test_up_launches_cheapest_and_records_rate(app):
    r = machines.up(app, experiment())
    m = r.machine
    assert (m.status, m.cloud, m.zone, m.instance_type, m.market) == (
        "running",
        "sandbox",
        "sandbox-us-1a",
        "sbx-t4-1",
        "spot",
    )
    assert (m.rate, m.currency) == (Decimal("0.15"), "USD")
    assert m.disk_rate == Decimal("0.10") * 50 / 730  # per GB-month → per hour, fixed at launch
    inst = app.provider("sandbox").get(machines.ref(m))
    assert inst.labels["provisioner-machine"] == m.id and inst.labels["managed-by"] == "provisioner"
    assert [k for k, _, _ in events(app, m)] == ["requested", "launch-attempt", "launched"]


def test_failover_across_exhausted_zones(sandbox_app):
    app = sandbox_app(capacity={"sandbox-us-1a": 0, "sandbox-us-1b": 0})
    r = machines.up(app, experiment())
    assert r.machine.zone == "sandbox-us-1c"
    assert [(a.where, a.outcome) for a in r.attempts] == [
        ("sandbox/sandbox-us-1a", "capacity"),
        ("sandbox/sandbox-us-1b", "capacity"),
        ("sandbox/sandbox-us-1c", "launched"),
    ]
    failed = [
        (reason, zone) for kind, reason, zone in events(app, r.machine) if kind == "launch-failed"
    ]
    assert failed == [("capacity", "sandbox-us-1a"), ("capacity", "sandbox-us-1b")]
    assert len(app.provider("sandbox").list_managed()) == 1


def test_quota_blocks_the_whole_region(sandbox_app):
    app = sandbox_app(quota_gpus={"sandbox-us": 0})
    r = machines.up(app, experiment())
    assert r.machine.region == "sandbox-eu"
    outcomes = [(a.where, a.outcome) for a in r.attempts]
    assert outcomes[:3] == [
        ("sandbox/sandbox-us-1a", "quota"),
        ("sandbox/sandbox-us-1b", "skipped"),
        ("sandbox/sandbox-us-1c", "skipped"),
    ]
    sandbox_calls = app.provider("sandbox").api_calls
    assert sandbox_calls == 2  # one refused launch, one good one: blocked zones are not tried


def test_auth_failure_blocks_the_cloud_and_fails_cleanly(sandbox_app):
    app = sandbox_app(auth_fail=True)
    with pytest.raises(OperationFailed, match="auth"):
        machines.up(app, experiment())
    with app.db.session() as s:
        (m,) = s.scalars(select(Machine)).all()
    assert m.status == "failed"
    assert app.provider("sandbox").api_calls == 1  # the other 4 candidates were not even tried
    app.provider("sandbox").inject(auth_fail=False)
    assert machines.up(app, experiment()).machine.status == "running"  # the name is free again


def test_up_of_a_running_name_says_so(app):
    first = machines.up(app, experiment()).machine
    again = machines.up(app, experiment())
    assert again.already and again.machine.id == first.id
    assert len(app.provider("sandbox").list_managed()) == 1


def test_no_candidate_is_a_user_error(app):
    with pytest.raises(UserError, match="no offer fits"):
        machines.up(app, experiment(gpu="H100:16"))


@pytest.mark.slow  # real `up` processes killed at each point
@pytest.mark.parametrize("point", ["after-intent", "before-launch", "after-launch"])
def test_crash_then_rerun_gives_one_machine(home, tmp_path, point, db_url):
    cfg = write_settings(home, state_url=db_url)
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("crashy"))
    crashed = run_cli("--config", str(cfg), "up", str(spec), env={"PROVISIONER_CRASH_AT": point})
    assert crashed.returncode == -9, crashed.stderr
    rerun = run_cli("--config", str(cfg), "up", str(spec), "-o", "json")
    assert rerun.returncode == 0, rerun.stderr
    machine = json.loads(rerun.stdout)["machine"]
    assert machine["status"] == "running"
    app = App(make_settings(home, state_url=db_url))
    assert [i.id for i in app.provider("sandbox").list_managed()] == [machine["instance_id"]]
    with app.db.session() as s:
        m = s.get(Machine, machine["id"])
    kinds = [k for k, _, _ in events(app, m)]
    app.close()
    assert kinds.count("requested") == 1
    assert ("adopted" in kinds) == (point == "after-launch")


def test_stop_start_down_are_idempotent_and_intervals_follow(app, clock):
    t0 = clock.now()
    m = machines.up(app, experiment()).machine
    clock.advance(timedelta(hours=1))
    assert machines.stop(app, "exp")[1] is True
    assert machines.stop(app, "exp")[1] is False
    clock.advance(timedelta(hours=2))
    assert machines.start(app, "exp")[1] is True
    assert machines.start(app, "exp")[1] is False
    clock.advance(timedelta(minutes=30))
    assert machines.down(app, "exp")[1] is True
    assert machines.down(app, "exp")[1] is False
    h = timedelta(hours=1)
    assert intervals(app, m) == [
        ("compute", t0, t0 + h),
        ("disk", t0, t0 + 3.5 * h),
        ("compute", t0 + 3 * h, t0 + 3.5 * h),
    ]
    with app.db.session() as s:
        total = ledger.machine_spend(s, s.get(Machine, m.id), t0, t0 + 10 * h)["USD"].amount
    assert total == Decimal("0.15") * Decimal("1.5") + Decimal("0.10") * 50 / 730 * Decimal("3.5")
    assert app.provider("sandbox").get(machines.ref(m)).state.value == "terminated"


def test_status_reconciles_a_preemption(app, clock):
    t0 = clock.now()
    m = machines.up(app, experiment()).machine
    clock.advance(timedelta(minutes=40))
    app.provider("sandbox").preempt(machines.ref(m))
    obs = machines.reconcile(app)
    assert [(o.machine.name, o.observed, o.changed) for o in obs] == [("exp", "preempted", True)]
    assert machines.reconcile(app)[0].changed is False  # observing it again changes nothing
    compute = [iv for iv in intervals(app, m) if iv[0] == "compute"]
    assert compute == [("compute", t0, t0 + timedelta(minutes=40))]
    assert ("preempted", "preempted", None) in events(app, m)


def test_machines_made_outside_provisioner_are_not_ours(app):
    sandbox = app.provider("sandbox")
    sandbox.create_unmanaged("hand-made")
    machines.up(app, experiment())
    assert [i.name for i in sandbox.list_managed()] == [
        machines.resource_name(experiment(), i.machine_id) for i in sandbox.list_managed()
    ]
    assert len(sandbox.list_managed()) == 1


def test_status_shows_what_each_machine_cost_so_far(home, db_url):
    from datetime import UTC, datetime

    from provisioner.clock import ManualClock
    from tests.conftest import TEST_START, write_settings

    launched = TEST_START
    app = App(make_settings(home, state_url=db_url), ManualClock(launched))
    machines.up(app, experiment())
    app.close()
    per_hour = Decimal("0.15") + Decimal("0.10") * 50 / 730  # compute + 50 GB disk

    def cost_at(t) -> Decimal:
        return per_hour * Decimal((t - launched).total_seconds()) / 3600

    cfg = write_settings(home, state_url=db_url)
    at = launched + timedelta(hours=2)
    wall = datetime.now(UTC)
    r = run_cli("--config", str(cfg), "status", "-o", "json", now=at)
    took = datetime.now(UTC) - wall  # the CLI's clock ticks from `at` while it runs
    ((spent,),) = [m["spent"] for m in json.loads(r.stdout)]
    assert spent["currency"] == "USD"
    assert cost_at(at) <= Decimal(spent["amount"]) <= cost_at(at + took)
    table = run_cli("--config", str(cfg), "status", now=at)
    assert "0.31 USD" in table.stdout or "0.32 USD" in table.stdout  # ~2 h at 0.157/h


def test_a_spot_cap_in_another_currency_reaches_the_cloud_converted():
    """max_price_per_hour: 1 USD on a RUB offer is sent as 80 RUB (settings rate), rounded
    down — never dropped, never above what the experiment allows."""
    from providers.base import Offer
    from provisioner.models import Machine
    from provisioner.money import Money, Rates
    from provisioner.planner import Candidate

    offer = Offer(
        "sandbox", "sandbox-ru", "sandbox-ru-1a", "sbx-t4-1", "T4", 1, 16, 8, Decimal(32),
        Decimal("47.50"), Decimal("14.25"), "RUB",
    )  # fmt: skip
    rates = Rates("USD", {"RUB": Decimal("80.123456")})
    c = Candidate(offer, "spot", Money(Decimal("14.25"), "RUB"), Money(Decimal("0.18"), "USD"))
    exp = experiment(max_price_per_hour="1 USD")
    m = Machine(id="m1", name="exp")
    request = machines.launch._launch_request(m, exp, c, None, rates)
    assert request.max_price == Decimal("80.1234")
    reserved = Candidate(offer, "reserved", Money(Decimal("47.5"), "RUB"), c.price_base)
    assert machines.launch._launch_request(m, exp, reserved, None, rates).max_price is None


def test_stop_many_and_down_many_act_in_one_call_per_cloud(app):
    """`stop`/`down` of many names: one batch call to the cloud, each name's own outcome (a
    name that matches no machine says so; the others are acted on all the same)."""
    a, b, c = (machines.up(app, experiment(n)).machine for n in ("m-a", "m-b", "m-c"))
    sandbox = app.provider("sandbox")
    app.clock.advance(timedelta(hours=1))
    calls = sandbox.api_calls
    stopped = machines.stop_many(app, ["m-a", "m-b", "nope"])
    assert sandbox.api_calls - calls == 1
    assert isinstance(stopped["nope"], UserError) and "nope" in str(stopped["nope"])
    assert [(o.machine.status, o.changed, o.error) for o in (stopped["m-a"], stopped["m-b"])] == [
        ("stopped", True, None),
        ("stopped", True, None),
    ]
    assert intervals(app, a)[0][2] == app.clock.now()  # compute billed until the stop
    again = machines.stop_many(app, ["m-a"])["m-a"]
    assert (again.changed, again.error) == (False, None)  # already stopped: nothing sent
    assert sandbox.api_calls - calls == 1

    downed = machines.down_many(app, ["m-a", "m-b", "m-c"])
    assert sandbox.api_calls - calls == 2
    assert {n: (o.machine.status, o.error) for n, o in downed.items()} == {
        n: ("terminated", None) for n in ("m-a", "m-b", "m-c")
    }
    assert events(app, c)[-1][:2] == ("terminated", "user")
    assert sandbox.list_managed() == []
    assert len({a.id, b.id, c.id}) == 3


def test_notes_on_stopped_machines_cost_one_query(app):
    """Why each stopped machine is stopped, when it is news (a relaunch was refused and it was
    kept): one query for all of them, however many there are."""
    from provisioner import fleet

    names = [f"m-{n}" for n in range(6)]
    for n in names:
        machines.up(app, experiment(n))
    machines.stop_many(app, names[:5])  # m-5 stays running
    refused = {"m-0": "refused by budget", "m-2": "region not allowed", "m-3": "refused"}
    for n, why in refused.items():
        machines.record_event(
            app, machines.find(app, n).id, "relaunch-refused", detail={"refused": why}
        )
    m3 = machines.find(app, "m-3")  # refused once, later started and stopped by its owner
    machines.record_event(app, m3.id, "stopped", reason="user")
    rows = [machines.find(app, n) for n in names]

    selects: list[str] = []
    with app.db.session() as s:
        sql = fleet.Sql.on(s)
        read = sql.all
        sql.all = lambda q, p=(): selects.append(q) or read(q, p)  # type: ignore[method-assign]
        notes = fleet.stopped_notes(sql)
    by_id = {m.id: m.name for m in rows}
    assert {by_id[mid]: note for mid, note in notes.items()} == {
        "m-0": "preempted and not relaunched, kept stopped with its disk: refused by budget",
        "m-2": "preempted and not relaunched, kept stopped with its disk: region not allowed",
    }
    assert len(selects) == 1
