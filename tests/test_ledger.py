"""The ledger over a simulated month on the sandbox cloud: the bill to the cent in two currencies,
disks included; re-observing changes nothing; groupings, forecast, savings and idle waste."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

import pytest
from sqlalchemy import func, select

from provisioner import ledger, machines
from provisioner.ledger import Period, Scope
from provisioner.models import Event, Machine, UsageInterval
from provisioner.money import Amounts
from provisioner.spec import Experiment
from tests.conftest import sandbox_experiment

NOV = Period.month(datetime(2026, 11, 15, tzinfo=UTC))
T = lambda d, h=0, m=0: datetime(2026, 11, d, h, m, tzinfo=UTC)  # noqa: E731
USD_DISK = Decimal("0.10") * 50 / 730  # sandbox-us: 0.10 USD per GB-month, 50 GB, per hour
RUB_DISK = Decimal("8.00") * 50 / 730  # sandbox-ru: 8.00 RUB per GB-month


def cents(d: Decimal) -> Decimal:
    return d.quantize(Decimal("0.01"), ROUND_HALF_UP)


def q(amounts: dict) -> dict:
    """Decimal keeps 28 digits; rates like 0.10 × 50 / 730 repeat forever, so sums taken in a
    different order agree to ~1e-25. Compare far below a cent, far above that noise."""
    return {c: a.quantize(Decimal("1e-12")) for c, a in amounts.items()}


def up(app, name, **res) -> Machine:
    return machines.up(app, Experiment.model_validate(sandbox_experiment(name, **res))).machine


def month(app, clock) -> dict[str, Machine]:
    """November 2026, by hand:
    us-spot    T4 spot 0.15 USD/h, sandbox-us. Up Nov 2 09:00; stopped for the Nov 4 holiday
               (Nov 3 20:00 → Nov 5 08:00); preempted Nov 10 12:00, restarted 15:00; down
               Nov 20 18:00. Compute 35 + 124 + 243 = 402 h; disk 441 h.
    ru-res     T4 reserved 47.50 RUB/h, sandbox-ru. Up Nov 2 09:00; off for the weekend
               (Fri Nov 6 20:00 → Mon Nov 9 08:00); still running when the month ends.
               Compute 107 + 520 = 627 h; disk 687 h.
    us-a100    A100 reserved 3.60 USD/h, sandbox-us. Nov 16 10:00 → 22:30: 12.5 h both."""
    clock.set(T(2, 9))
    ms = {
        "us-spot": up(app, "us-spot"),
        "ru-res": up(app, "ru-res", market="reserved", regions=["sandbox-ru"]),
    }
    clock.set(T(3, 20))
    machines.stop(app, "us-spot", reason="off-hours")
    clock.set(T(5, 8))
    machines.start(app, "us-spot", reason="off-hours")
    clock.set(T(6, 20))
    machines.stop(app, "ru-res", reason="off-hours")
    machines.reconcile(app)  # the cloud agrees: nothing changes
    clock.set(T(9, 8))
    machines.start(app, "ru-res", reason="off-hours")
    clock.set(T(10, 12))
    app.provider("sandbox").preempt(machines.ref(ms["us-spot"]))
    obs = {o.machine.name: (o.observed, o.changed) for o in machines.reconcile(app)}
    assert obs["us-spot"] == ("preempted", True)
    assert machines.reconcile(app)[0].changed is False  # seen twice, recorded once
    clock.set(T(10, 15))
    machines.start(app, "us-spot")
    clock.set(T(16, 10))
    ms["us-a100"] = up(app, "us-a100", gpu="A100:1", market="reserved")
    clock.set(T(16, 22, 30))
    machines.down(app, "us-a100")
    clock.set(T(20, 18))
    machines.down(app, "us-spot")
    clock.set(datetime(2026, 12, 1, 3, tzinfo=UTC))  # the report runs after the month ended
    return ms


HAND_USD = 402 * Decimal("0.15") + 441 * USD_DISK + Decimal("12.5") * (Decimal("3.60") + USD_DISK)
HAND_RUB = 627 * Decimal("47.50") + 687 * RUB_DISK


def test_simulated_month_equals_the_hand_computed_bill(app, clock):
    ms = month(app, clock)
    assert ms["ru-res"].rate == Decimal("47.50") and ms["ru-res"].currency == "RUB"
    with app.db.session() as s:
        bill = ledger.total(s, NOV.start, NOV.clip(clock.now()))
        by_machine = ledger.spend_by(s, NOV.start, NOV.end, ["machine", "kind"])
        holiday = ledger.spend_by(s, T(4), T(5), ["machine", "kind"])
    assert {c: cents(a) for c, a in bill.items()} == {
        "USD": Decimal("108.41"),
        "RUB": Decimal("30158.94"),
    }
    assert q(bill) == q({"USD": HAND_USD, "RUB": HAND_RUB})
    # in one currency at the settings' rate (80 RUB per USD), the rate used is stated
    assert (
        cents(bill.total(app.settings.money_rates, "USD").amount)
        == cents(HAND_USD + HAND_RUB / 80)
        == Decimal("485.39")
    )
    assert cents(by_machine[("us-spot", "disk")]["USD"]) == cents(441 * USD_DISK) == Decimal("3.02")
    assert cents(by_machine[("ru-res", "compute")]["RUB"]) == Decimal("29782.50")
    # on the holiday the stopped machine paid for its disk only
    assert q(holiday[("us-spot", "disk")]) == q({"USD": 24 * USD_DISK})
    assert ("us-spot", "compute") not in holiday


def test_reobserving_and_rerunning_change_nothing(app, clock):
    month(app, clock)
    with app.db.session() as s:
        before = ledger.total(s, NOV.start, NOV.end)
        rows = s.scalar(select(func.count()).select_from(UsageInterval))
        events = s.scalar(select(func.count()).select_from(Event))
    for _ in range(2):
        machines.reconcile(app)
        with app.db.session() as s:
            for m in s.scalars(select(Machine)):
                assert ledger.record_transition(s, m, m.status, clock.now()) is False
    assert machines.stop(app, "ru-res")[1] is True
    with app.db.session() as s:  # a stop after the month changes nothing in it
        assert ledger.total(s, NOV.start, NOV.end) == before
        assert s.scalar(select(func.count()).select_from(UsageInterval)) == rows
        assert s.scalar(select(func.count()).select_from(Event)) == events + 1


def test_groupings_and_days_add_up_to_the_total(app, clock):
    month(app, clock)
    with app.db.session() as s:
        bill = ledger.total(s, NOV.start, NOV.end)
        for by in (["project"], ["cloud"], ["gpu"], ["owner", "kind"], ["day"]):
            groups = ledger.spend_by(s, NOV.start, NOV.end, by)
            summed = Amounts()
            for a in groups.values():
                summed.merge(a)
            assert q(summed) == q(bill), by
        days = ledger.spend_by(s, NOV.start, NOV.end, ["day"])
        gpus = ledger.spend_by(s, NOV.start, NOV.end, ["gpu"], Scope(cloud="sandbox"))
        a100 = ledger.total(s, NOV.start, NOV.end, Scope(gpu="A100"))
        globbed = ledger.total(s, NOV.start, NOV.end, Scope(project="de*", owner="*@example.com"))
    assert set(gpus) == {("T4",), ("A100",)}
    assert q(a100) == q({"USD": Decimal("12.5") * (Decimal("3.60") + USD_DISK)})
    assert q(globbed) == q(bill)
    assert min(d for (d,) in days) == date(2026, 11, 2) and (date(2026, 11, 30),) in days


def test_savings_count_only_the_schedulers_stops(app, clock):
    month(app, clock)
    far = lambda _p, _o, at: at + timedelta(days=30)  # noqa: E731  (nothing bounds them but restarts)
    with app.db.session() as s:
        saved = ledger.savings(s, NOV, clock.now(), bound=far)
        by_default = ledger.savings(s, NOV, clock.now())
    # holiday 36 h of us-spot, weekend 60 h of ru-res (each until it started again); the
    # preemption gap is no saving
    assert saved == {"off-hours": {"USD": 36 * Decimal("0.15"), "RUB": 60 * Decimal("47.50")}}
    # with no calendar to say when someone is back, each stop counts 12 h at most
    assert by_default == {"off-hours": {"USD": 12 * Decimal("0.15"), "RUB": 12 * Decimal("47.50")}}


def test_a_stop_never_saves_past_the_machines_max_lifetime(app, clock):
    """A machine that would have ended at its max lifetime saves nothing after it."""
    clock.set(T(2, 9))
    machines.up(
        app,
        Experiment.model_validate(
            {**sandbox_experiment("short"), "lifecycle": {"max_lifetime": "4h"}}
        ),
    )
    clock.set(T(2, 11))
    machines.stop(app, "short", reason="idle")
    clock.set(T(4, 0))
    far = lambda _p, _o, at: at + timedelta(days=30)  # noqa: E731
    with app.db.session() as s:
        saved = ledger.savings(s, NOV, clock.now(), bound=far)
    assert saved == {"idle": {"USD": 2 * Decimal("0.15")}}  # 11:00 → 13:00, its lifetime's end


def test_forecast_is_spent_plus_committed_plus_relaunches_and_nothing_extrapolated(app, clock):
    """The forecast is what was spent, what live machines commit to the period's end (or their
    max lifetime) and what preempted machines being relaunched will add: a machine that came
    and went adds nothing more, nor does a preempted one held by a refusal or left alone."""
    clock.set(T(1))
    steady = up(app, "steady")
    brief = up(app, "brief")
    lost = up(app, "lost")
    held = up(app, "held")
    left = machines.up(
        app,
        Experiment.model_validate(
            {**sandbox_experiment("left"), "lifecycle": {"on_preemption": "leave"}}
        ),
    ).machine
    clock.set(T(6))
    machines.down(app, "brief")
    for m in (lost, held, left):
        app.provider("sandbox").preempt(machines.ref(m))
    machines.reconcile(app)
    with app.db.session() as s:  # the scheduler's recovery was refused by a policy
        s.add(
            Event(
                machine_id=held.id,
                kind="relaunch-refused",
                reason="preempted",
                at=T(6),
                detail={"refused": "refused by policy p: no", "attempts": 1},
            )
        )
    clock.set(T(10))
    short = machines.up(
        app,
        Experiment.model_validate(
            {**sandbox_experiment("short"), "lifecycle": {"max_lifetime": "48h"}}
        ),
    ).machine
    clock.set(T(11))
    per_h = Decimal("0.15") + USD_DISK
    with app.db.session() as s:
        fc = ledger.forecast(s, NOV, clock.now())
    # steady 240 h, brief 120 h, the three preempted 120 h each (then their disks 120 h), short 24 h
    spent = (240 + 120 + 24) * per_h + 3 * 120 * per_h + 3 * 120 * USD_DISK
    assert q(fc.actual) == q({"USD": spent})
    # live machines to the month's end (480 h), the short one only to its 48 h lifetime; the
    # preempted ones' disks bill on (480 h each)
    assert q(fc.committed) == q({"USD": (480 + 24) * per_h + 3 * 480 * USD_DISK})
    # only `lost` is being relaunched: its compute for the 480 h left
    assert q(fc.relaunches) == q({"USD": 480 * Decimal("0.15")})
    assert q(fc.total) == q({"USD": spent + (480 + 24) * per_h + 3 * 480 * USD_DISK + 72})
    assert steady.rate == brief.rate == short.rate
    clock.set(datetime(2026, 12, 1, 3, tzinfo=UTC))  # the month is over: what was spent
    with app.db.session() as s:
        over = ledger.forecast(s, NOV, clock.now())
    assert not over.committed and not over.relaunches


@pytest.mark.parametrize("reason", ["idle", "off-hours-idle"])
def test_idle_waste_from_the_stop_event(app, clock, reason):
    m = up(app, "idler")
    clock.advance(timedelta(hours=5))
    machines.stop(app, "idler", reason=reason)
    with app.db.session() as s:
        ev = s.scalars(select(Event).where(Event.machine_id == m.id, Event.reason == reason)).one()
        assert q(ledger.idle_waste(s, NOV, clock.now())) == q({"USD": Decimal("0.075")})  # 30 min
        ev.detail = {"idle_since": (clock.now() - timedelta(hours=2)).isoformat()}
    with app.db.session() as s:
        assert q(ledger.idle_waste(s, NOV, clock.now())) == q({"USD": Decimal("0.30")})


@pytest.mark.parametrize(
    ("text", "start", "end"),
    [
        ("2026-11", datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC)),
        ("2026-12", datetime(2026, 12, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC)),
        ("2026-W48", datetime(2026, 11, 23, tzinfo=UTC), datetime(2026, 11, 30, tzinfo=UTC)),
        (
            "2026-11-01..2026-11-15",
            datetime(2026, 11, 1, tzinfo=UTC),
            datetime(2026, 11, 16, tzinfo=UTC),
        ),
    ],
)
def test_periods(text, start, end):
    p = Period.parse(text)
    assert (p.start, p.end) == (start, end)


def test_period_in_a_policy_timezone_and_bad_input():
    p = Period.month(datetime(2026, 11, 30, 22, tzinfo=UTC), "Europe/Moscow")
    assert p.label == "2026-12" and p.start == datetime(2026, 11, 30, 21, tzinfo=UTC)
    with pytest.raises(ValueError, match="write 2026-11"):
        Period.parse("November")
    with pytest.raises(ValueError, match="before it starts"):
        Period.parse("2026-11-15..2026-11-01")


def test_report_savings_end_when_working_hours_begin_not_at_the_periods_end(home, clock, tmp_path):
    """A machine the off-hours rule stopped on Friday evening and nobody started again: the
    report counts it until Monday 08:00, when someone is back — not to the month's end; a
    stop within hours counts until the evening's off-hours would have stopped it anyway. The
    method is said beside the figure."""
    import json

    from provisioner import reports
    from provisioner.app import App
    from tests.conftest import make_settings, run_cli, write_settings, write_yaml

    policy = write_yaml(
        tmp_path / "nights.yaml",
        {
            "name": "nights",
            "off_hours": {
                "timezone": "UTC",
                "windows": [{"days": "mon-fri", "start": "19:00", "end": "08:00"}],
            },
        },
    )
    app = App(make_settings(home, policies=[str(policy)]), clock)
    clock.set(T(2, 9))
    up(app, "weekend")
    up(app, "afternoon")
    clock.set(T(2, 14))
    machines.stop(app, "afternoon", reason="idle")  # Monday 14:00: off-hours from 19:00
    clock.set(T(6, 20))
    machines.stop(app, "weekend", reason="off-hours-idle")  # Friday 20:00
    clock.set(datetime(2026, 12, 1, 3, tzinfo=UTC))
    r = reports.build(app, NOV)
    app.close()
    saved = {k: v.amount for k, v in r.savings}
    assert saved == {"off-hours-idle": 60 * Decimal("0.15"), "idle": 5 * Decimal("0.15")}
    cfg = write_settings(home, policies=[str(policy)])
    js = run_cli(
        "--config", str(cfg), "report", "--period", "2026-11", "-o", "json", now=clock.now()
    )
    assert "never to the period's end" in json.loads(js.stdout)["savings_method"]
    text = run_cli("--config", str(cfg), "report", "--period", "2026-11", now=clock.now()).stdout
    assert "never to the period's end" in " ".join(text.split())
