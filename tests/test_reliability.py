"""Reliability (issue 14): one machine per intent under lost answers and races, limits that hold
under concurrency, and budgets and policies that `start` and recovery obey too.

Alongside the crash harness (tests/test_crash.py): there the process dies at each step; here the
cloud's answers get lost after it acted, and several `up`/`down`/`start` run at once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from providers.base import Throttled
from provisioner import catalog, machines
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.errors import OperationFailed, ProvisionerError, UserError
from provisioner.jobs import recover, sweep
from provisioner.models import Event, Machine, UsageInterval
from provisioner.spec import Experiment
from tests.conftest import (
    TEST_START,
    make_settings,
    run_cli,
    sandbox_experiment,
    write_settings,
    write_yaml,
)
from tests.contract.aws import clean_emulator, make_provider
from tests.contract.harness import t4_request
from tests.emulators.aws import AwsEmulator

pytestmark = pytest.mark.slow  # many launches on the emulators, threads racing

TRIALS = 20
AWS_REGIONS = ("us-east-1", "us-west-2")


def experiment(name: str, **resources: object) -> Experiment:
    return Experiment.model_validate(sandbox_experiment(name, **resources))


def live_rows(app: App, name: str | None = None) -> list[Machine]:
    with app.db.session() as s:
        q = select(Machine).where(Machine.status.not_in(("terminated", "failed")))
        if name is not None:
            q = q.where(Machine.name == name)
        return list(s.scalars(q))


def events(app: App, machine_id: str, kind: str) -> list[Event]:
    with app.db.session() as s:
        return list(
            s.scalars(select(Event).where(Event.machine_id == machine_id, Event.kind == kind))
        )


# --- 1. a lost answer never makes a second machine ------------------------------------------


@pytest.fixture
def emu(monkeypatch: pytest.MonkeyPatch):
    with clean_emulator(monkeypatch) as emulator:
        yield emulator


def billed(emu: AwsEmulator) -> list[str]:
    return [i for region in AWS_REGIONS for i in emu.billed_instances(region)]


def test_lost_launch_answers_never_make_a_second_machine(
    emu: AwsEmulator, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Over seeded trials, 40 % of EC2 calls fail (half of them after EC2 acted: the answer
    dropped, a 500, or too late for the client), with retries soon exhausted. Whatever `up`
    says, the intent ends with exactly one billed machine, the one in the ledger, once `up` is
    rerun on a healed network; `down` then leaves nothing billed."""
    aws = {
        "endpoint": emu.endpoint_url,
        "retry_base_seconds": 0.001,
        "retry_max_seconds": 0.01,
        "retry_attempts": 2,
        "timeout_seconds": 1.0,  # generous: only a lost answer should time out
    }
    offers = make_provider(emu).fetch_offers()  # on a sound network, once
    outcomes: Counter[str] = Counter()
    fates: Counter[str] = Counter()
    duplicates = 0
    for seed in range(TRIALS):
        emu.reset()
        home = tmp_path / f"trial{seed}"
        app = App(make_settings(home, clouds={"aws": aws}), ManualClock(TEST_START))
        try:
            catalog.refresh(app.settings, "aws", offers)
            exp = experiment("train", gpu="T4:1", market="spot", clouds=["aws"])
            emu.faults.unreliable(0.4, seed=seed, late_seconds=1.5)
            try:
                launched = machines.up(app, exp).machine.instance_id
                outcomes["launched"] += 1
            except OperationFailed:
                launched = None
                outcomes["up failed"] += 1
            fates.update(f for action, f in emu.faults.fates if action == "RunInstances")
            emu.faults.clear()
            emu.wait_idle()
            duplicates += max(len(billed(emu)) - 1, 0)
            assert len(billed(emu)) <= 1, (seed, billed(emu), emu.faults.fates)
            if launched is not None:  # `up` said so: that machine, in the ledger, bills
                assert billed(emu) == [launched], seed
            # a healed network: a rerun finishes an intent left unsettled
            m = machines.up(app, exp).machine
            assert billed(emu) == [m.instance_id], seed
            assert [r.id for r in live_rows(app)] == [m.id]
            for e in events(app, m.id, "adopted"):  # the adoption names what is kept running
                assert e.detail["instance_id"] == m.instance_id
            machines.down(app, "train")
            assert billed(emu) == [], seed
        finally:
            app.close()
    with capsys.disabled():
        print(
            f"\nlost answers: {TRIALS} trials, {dict(outcomes)}, RunInstances fates "
            f"{dict(fates)}, duplicates {duplicates}"
        )
    assert duplicates == 0
    assert sum(fates[f] for f in ("dropped", "error-after", "late")) > 0  # the case happened


@pytest.mark.parametrize(
    ("action", "answer"),
    [("CreateSecurityGroup", "dropped"), ("AuthorizeSecurityGroupIngress", "RequestLimitExceeded")],
)
def test_a_failed_call_while_making_our_ssh_group_still_opens_ssh(
    emu: AwsEmulator, action: str, answer: str
) -> None:
    """EC2 made the group but its answer was lost, or the rule's call was throttled: the retry
    meets the group already made and still adds the rule, so the machine admits SSH."""
    if answer == "dropped":
        emu.faults.drop_response(action)
    else:
        emu.faults.throttle(1, action=action)
    inst = make_provider(emu).launch(
        t4_request("ssh", ("us-east-1", "use1-az6"), "g4dn.xlarge", spot=False)
    )
    assert next(c.answer for c in emu.calls(action)) == answer
    ec2 = emu.client("ec2")
    [raw] = [i for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]]
    assert raw["InstanceId"] == inst.id
    [group] = ec2.describe_security_groups(GroupIds=[raw["SecurityGroups"][0]["GroupId"]])[
        "SecurityGroups"
    ]
    assert [(p["FromPort"], p["ToPort"]) for p in group["IpPermissions"]] == [(22, 22)]


# --- 2. `down` during an unfinished `up` wins --------------------------------------------------


@pytest.fixture
def world(home: Path, db_url: str | None):
    settings = make_settings(home, state_url=db_url)
    apps: list[App] = []

    def new_app(at: datetime = TEST_START) -> App:
        apps.append(App(settings, ManualClock(at)))
        return apps[-1]

    yield new_app
    for a in apps:
        a.close()


def wait_for(predicate, what: str) -> None:
    """Poll the state (bounded) for something another thread does."""
    for _ in range(2000):
        if predicate():
            return
        time.sleep(0.005)  # (a timed wait on a lock never wakes under libfaketime: CI's date run)
    raise AssertionError(f"never happened: {what}")


def test_down_while_up_launches_wins_and_the_name_waits(world) -> None:
    """`up` is inside the cloud's launch call when `down` of the same name arrives and a second
    `up` of it too: the second `up` is refused with a clear message (no IntegrityError), the
    first `up` terminates what it launched, `down` returns once that is done, nothing is billed
    and the name is free again."""
    launcher, stopper, other = world(), world(), world()
    provider = launcher.provider("sandbox")
    real_launch = provider.launch
    entered = threading.Event()
    refused = threading.Event()
    probe = world()

    def cancel_asked() -> bool:
        with probe.db.session() as s:
            return (
                s.scalars(select(Event.id).where(Event.kind == "cancel-requested")).first()
                is not None
            )

    def slow_launch(request):  # hold the launch until `down` and a second `up` have come
        entered.set()
        wait_for(cancel_asked, "down records its request")
        refused.wait(30)
        return real_launch(request)

    provider.launch = slow_launch  # type: ignore[method-assign]
    results: dict[str, object] = {}

    def run(key, fn):
        try:
            results[key] = fn()
        except ProvisionerError as e:
            results[key] = e

    up = threading.Thread(
        target=run, args=("up", lambda: machines.up(launcher, experiment("race")))
    )
    up.start()
    assert entered.wait(30)
    down = threading.Thread(target=run, args=("down", lambda: machines.down(stopper, "race")))
    down.start()
    wait_for(cancel_asked, "down records its request")
    with pytest.raises(UserError, match="being taken down"):
        machines.up(other, experiment("race"))
    refused.set()
    up.join(60)
    down.join(60)

    assert isinstance(results["up"], OperationFailed), results
    assert "taken down" in str(results["up"])
    m, changed = results["down"]  # type: ignore[misc]
    assert m.status == "terminated" and changed
    assert [
        i for i in probe.provider("sandbox").list_managed() if i.state.value != "terminated"
    ] == []
    assert live_rows(probe, "race") == []
    with probe.db.session() as s:
        open_ = s.scalars(select(UsageInterval).where(UsageInterval.ended_at.is_(None))).all()
    assert open_ == []
    again = machines.up(other, experiment("race")).machine  # settled: the name is free
    assert again.status in ("pending", "running")


def test_down_after_up_died_mid_launch_terminates_what_it_launched(home, tmp_path) -> None:
    """A real `up` killed right after the cloud launched (the crashpoint): `down` finds the
    machine by its tag, terminates it, and the name can be used again."""
    cfg = write_settings(home)
    spec = write_yaml(tmp_path / "race.yaml", sandbox_experiment("race"))
    died = run_cli(
        "--config",
        str(cfg),
        "up",
        str(spec),
        "--no-wait",
        env={"PROVISIONER_CRASH_AT": "after-launch"},
    )
    assert died.returncode == -9, died.stderr
    down = run_cli("--config", str(cfg), "down", "race")
    assert down.returncode == 0, down.stderr
    app = App(make_settings(home), ManualClock(TEST_START))
    try:
        assert [
            i for i in app.provider("sandbox").list_managed() if i.state.value != "terminated"
        ] == []
        assert machines.up(app, experiment("race")).machine.status in ("pending", "running")
    finally:
        app.close()


# --- 3. limits hold under concurrency ----------------------------------------------------------


LIMITS = {
    # at most three machines
    "max_machines": ({"max_machines": 3}, "max_machines"),
    # a T4 spot with its disk costs ~111.8 USD from TEST_START to the month's end: three fit
    "budget": ({"budget": {"amount": "350 USD"}}, "refused by budget"),
}


@pytest.mark.parametrize("limit", sorted(LIMITS))
def test_six_concurrent_ups_under_a_limit_of_3_leave_3(home, tmp_path, db_url, limit) -> None:
    rule, refusal = LIMITS[limit]
    policy = write_yaml(
        tmp_path / "cap.yaml", {"name": "cap", "applies_to": {"projects": ["demo"]}, **rule}
    )
    settings = make_settings(home, state_url=db_url, policies=[str(policy)])
    apps = [App(settings, ManualClock(TEST_START)) for _ in range(6)]
    start = threading.Barrier(6)
    results: list[object] = [None] * 6

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = machines.up(apps[i], experiment(f"job{i}")).machine
        except ProvisionerError as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    try:
        refused = [r for r in results if isinstance(r, UserError)]
        assert len(refused) == 3, results
        assert all(refusal in str(r) for r in refused), refused
        assert len(live_rows(apps[0])) == 3
        running = [
            i for i in apps[0].provider("sandbox").list_managed() if i.state.value != "terminated"
        ]
        assert len(running) == 3
    finally:
        for a in apps:
            a.close()


def test_concurrent_starts_of_one_machine_start_it_once(world) -> None:
    first = world()
    m = machines.up(first, experiment("twin", market="reserved")).machine
    machines.stop(first, "twin")
    apps = [world(TEST_START + timedelta(hours=1)) for _ in range(3)]
    gate = threading.Barrier(3)
    changed: list[bool] = []

    def run(a: App) -> None:
        gate.wait()
        changed.append(machines.start(a, "twin")[1])

    threads = [threading.Thread(target=run, args=(a,)) for a in apps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(changed) == [False, False, True]
    assert len(events(first, m.id, "started")) == 1
    with first.db.session() as s:
        open_ = s.scalars(
            select(UsageInterval).where(
                UsageInterval.machine_id == m.id, UsageInterval.ended_at.is_(None)
            )
        ).all()
    assert sorted(iv.kind for iv in open_) == ["compute", "disk"]


# --- 4. `start` obeys the budget ---------------------------------------------------------------


def budget_policy(amount: str) -> dict:
    return {
        "name": "demo-budget",
        "applies_to": {"projects": ["demo"]},
        "budget": {"amount": amount, "on_exhausted": "block"},
    }


def test_start_is_refused_by_an_exhausted_block_budget(home, tmp_path) -> None:
    policy = tmp_path / "budget.yaml"
    write_yaml(policy, budget_policy("200 USD"))
    cfg = write_settings(home, policies=[str(policy)])
    clock = ManualClock(TEST_START)
    app = App(make_settings(home, policies=[str(policy)]), clock)
    try:
        machines.up(app, experiment("night"))
        clock.advance(timedelta(hours=10))
        machines.stop(app, "night")
    finally:
        app.close()
    write_yaml(policy, budget_policy("1 USD"))  # 10 h at ~0.16 USD/h: exhausted
    app = App(make_settings(home, policies=[str(policy)]), ManualClock(clock.now()))
    try:
        with pytest.raises(UserError) as refused:
            machines.start(app, "night")
        assert str(refused.value).startswith("refused by budget demo-budget (2026-11)")
        with pytest.raises(UserError) as up_refused:  # the message `up` gives
            machines.up(app, experiment("other"))
        assert str(up_refused.value).split(":")[0] == str(refused.value).split(":")[0]
        assert machines.find(app, "night").status == "stopped"
    finally:
        app.close()
    cli = run_cli("--config", str(cfg), "start", "night", now=clock.now())
    assert cli.returncode == 2, cli.stderr
    assert "refused by budget demo-budget" in cli.stderr
    assert "Traceback" not in cli.stderr


# --- 5. a refused relaunch keeps the preempted machine -----------------------------------------


def test_a_refused_relaunch_keeps_the_preempted_machine_and_its_disk(home, tmp_path) -> None:
    policy = tmp_path / "budget.yaml"
    write_yaml(policy, budget_policy("200 USD"))
    clock = ManualClock(TEST_START)
    app = App(make_settings(home, policies=[str(policy)]), clock)
    try:
        m = machines.up(app, experiment("spotty")).machine
        clock.advance(timedelta(hours=10))
        app.provider("sandbox").preempt(machines.ref(m))
        machines.reconcile(app)
    finally:
        app.close()
    write_yaml(policy, budget_policy("1 USD"))
    app = App(make_settings(home, policies=[str(policy)]), clock)
    cfg = write_settings(home, policies=[str(policy)])
    try:
        done = recover.run(app)
        [action] = done.actions
        assert not action.done and "refused by budget" in (action.error or "")
        kept = machines.find(app, "spotty")
        # held as its cloud left it: stopped by the cloud with its disk (no `stopped` written
        # that the next reconcile would undo)
        assert (kept.id, kept.status) == (m.id, "preempted")
        inst = app.provider("sandbox").get(machines.ref(kept))
        assert inst.state.value in ("stopped", "preempted")  # still there, with its disk
        [refusal] = events(app, m.id, "relaunch-refused")
        assert "refused by budget" in refusal.detail["refused"]
        machines.reconcile(app)  # the cloud agrees: nothing written
        again = recover.run(app, clock.now() + timedelta(hours=2))
        [retry] = again.actions  # tried again after the backoff, refused again: still kept
        assert not retry.done and "(try 2 of 10)" in retry.why
        [refusal] = events(app, m.id, "relaunch-refused")  # the same refusal, counted
        assert refusal.detail["attempts"] == 2
        assert machines.find(app, "spotty").id == m.id
    finally:
        app.close()
    shown = run_cli("--config", str(cfg), "status", "--no-refresh", now=clock.now())
    assert shown.returncode == 0, shown.stderr
    assert "spotty: preempted and not relaunched" in shown.stderr.replace("\n", " ")


# --- 6. keep --until HH:MM in a real time zone --------------------------------------------------


def test_keep_until_is_read_in_the_settings_timezone_across_dst(home) -> None:
    """Berlin leaves summer time at 01:00 UTC on 25 Oct 2026. At 23:30 UTC on the 24th (01:30
    CEST), `keep --until 09:00` means 09:00 CET, 08:00 UTC — not 07:00 (the offset in force
    when asked) nor 09:00 (the test machine's own UTC)."""
    before_dst_end = datetime(2026, 10, 24, 23, 30, tzinfo=UTC)
    app = App(make_settings(home, timezone="Europe/Berlin"), ManualClock(before_dst_end))
    try:
        machines.up(app, experiment("late"))
        kept = sweep.keep(app, "late", "09:00")
        assert kept.kept_until == datetime(2026, 10, 25, 8, 0, tzinfo=UTC)
    finally:
        app.close()
    utc = App(make_settings(home), ManualClock(before_dst_end))  # no setting: UTC
    try:
        assert sweep.keep(utc, "late", "09:00").kept_until == datetime(
            2026, 10, 25, 9, 0, tzinfo=UTC
        )
    finally:
        utc.close()


# --- reconcile and a row that vanished ---------------------------------------------------------


def test_reconcile_skips_a_row_deleted_meanwhile(world) -> None:
    app = world()
    gone = machines.up(app, experiment("gone")).machine
    kept = machines.up(app, experiment("kept")).machine
    provider = app.provider("sandbox")
    for m in (gone, kept):
        provider.stop(machines.ref(m))  # both changed outside provisioner
    real_list = provider.list_managed

    def list_then_delete(*args, **kwargs):
        found = real_list(*args, **kwargs)
        with app.db.session() as s:  # someone deletes a row by hand meanwhile
            for model in (Event, UsageInterval):
                for row in s.scalars(select(model).where(model.machine_id == gone.id)):
                    s.delete(row)
            s.delete(s.get(Machine, gone.id))
        return found

    provider.list_managed = list_then_delete  # type: ignore[method-assign]
    seen = machines.reconcile(app)
    assert [(o.machine.name, o.observed) for o in seen if o.changed] == [("kept", "stopped")]


# --- 11 (verified): the first reconcile after `up` records a boot, not an outside change -------


def test_the_first_reconcile_after_up_records_a_boot(emu: AwsEmulator, tmp_path: Path) -> None:
    aws = {"endpoint": emu.endpoint_url, "retry_base_seconds": 0.001}
    clock = ManualClock(TEST_START)
    app = App(make_settings(tmp_path / "home", clouds={"aws": aws}), clock)
    try:
        catalog.refresh(app.settings, "aws", make_provider(emu).fetch_offers())
        m = machines.up(app, experiment("boot", gpu="T4:1", clouds=["aws"])).machine
        assert m.status == "pending"  # EC2 answers RunInstances with a pending instance
        clock.advance(timedelta(hours=2))
        machines.reconcile(app)
        [boot] = events(app, m.id, "booted")
        assert boot.reason == "launched"
        with app.db.session() as s:
            reasons = set(s.scalars(select(Event.reason).where(Event.machine_id == m.id)))
        assert "outside-provisioner" not in reasons
    finally:
        app.close()


def test_an_adoption_that_finds_two_machines_keeps_one_and_says_which(world) -> None:
    """The launch answer is lost and the cloud holds two machines with this intent's tag (an
    earlier run's duplicate): one is adopted, the other terminated, and the event names both."""
    app = world()
    provider = app.provider("sandbox")
    real_launch = provider.launch

    def launch_twice_then_lose_the_answer(request):
        real_launch(request)
        real_launch(replace(request, token=request.token + "-old"))
        raise Throttled("sandbox: connection dropped", code="ConnectionClosed")

    provider.launch = launch_twice_then_lose_the_answer  # type: ignore[method-assign]
    m = machines.up(app, experiment("twice")).machine
    live = [i.id for i in provider.list_managed() if i.state.value != "terminated"]
    assert live == [m.instance_id]
    [dup] = events(app, m.id, "duplicate")
    assert dup.detail["kept"] == m.instance_id and dup.detail["still_running"] is False
    assert dup.detail["instance_id"] != m.instance_id


def test_a_launch_between_a_budget_s_two_reads_counts_once(home, tmp_path, db_url, monkeypatch):
    """A budget's commitments are read in two queries: machines running, then intents still
    launching. Another process's launch moves its intent from the second set to the first;
    landing between the two reads, it must count once — not zero times, which let a fourth
    concurrent `up` through a budget for three (seen once on PostgreSQL under load)."""
    from provisioner import budget
    from provisioner.ledger import projections

    policy = write_yaml(tmp_path / "budget.yaml", budget_policy("1000 USD"))
    settings = make_settings(home, state_url=db_url, policies=[str(policy)])
    checker, launcher = (App(settings, ManualClock(TEST_START)) for _ in range(2))
    try:
        late = experiment("late")
        plan = machines.check(launcher, late)
        # `up` before launching
        machines.launch._write_intent(launcher, late, None, plan.candidates[0])
        [rule] = checker.policies
        before = budget.status(checker, rule, TEST_START)
        assert before is not None and before.committed.amount > 0  # the intent counts

        reads = projections._open_intervals
        calls: list[int] = []

        def launch_meanwhile(*args, **kw):
            rows = reads(*args, **kw)
            calls.append(1)
            # the commitments read running machines, then the intents still launching: the
            # launch lands right after the first read, before the second
            if len(calls) == 1:
                machines.up(launcher, late)  # resumes the intent: launched, intervals opened
            return rows

        monkeypatch.setattr(projections, "_open_intervals", launch_meanwhile)
        during = budget.status(checker, rule, TEST_START)
        monkeypatch.undo()
        after = budget.status(checker, rule, TEST_START)
        assert live_rows(launcher, "late")[0].status in ("pending", "running")
        assert during is not None and after is not None
        # the snapshot saw it launching; a fresh look sees it running: once each time
        assert during.committed.amount == before.committed.amount
        assert after.committed.amount > 0
    finally:
        checker.close()
        launcher.close()
