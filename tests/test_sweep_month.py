"""A simulated stretch of the month driven by ``provisioner sweep`` alone gives the same stops
and the same money as one driven by the daemon (issue #32, point 4).

One scenario on the sandbox with the test clock, run twice from scratch: once by the daemon's
scheduled jobs (:func:`provisioner.jobs.daemon.schedule`, each run when its interval comes
round on a minute grid, a missed run run once, as APScheduler coalesces), once by the cron
pass (what ``provisioner sweep`` runs: :func:`provisioner.jobs.cycle.once`) every 5 minutes.
The daemon has its scan intervals set to the cron's period (sweep, recover, reconcile every 5
minutes) and its housekeeping (budgets, reports, notices) every minute, as always.

The stretch is the long May weekend in Moscow — Thursday 30 April 17:00 to Monday 4 May 10:00:
a working evening, a public holiday (Friday 1 May, RU), a weekend and a working morning — with
the rules' durations short (idle 10 min, autostop 10 min, lifetime 2 h) so each acts within
the hours the machines are up:

- ``office`` (policy ``nights``: out of hours 19:00–08:00, weekends, RU holidays; idle 10 min):
  busy until 18:30, stopped when the evening's off hours start; started by hand on the holiday
  and on Saturday for a while, stopped each time once idle; started on Monday, busy: kept;
- ``train`` (policy ``nights``): a detached ``run`` whose GPUs idle (it waits on I/O): the
  running job keeps it from the 19:00 stop; it exits at 19:43 and ``on_finish`` stops the
  machine; started again on Monday with an ``exec`` job whose end (09:47) is recorded;
- ``auto`` (autostop 10m, no calendar): busy, then idle → stopped, on Thursday and on Saturday;
- ``spot``: preempted at 17:32 and started again (in place); a max lifetime of 2 h;
- ``burn`` (an 8×A100 under a budget that stops its machines): stopped when the budget runs
  out, an hour in (the budget is the spend at that tick, to the 0.0001 USD, so both see it run
  out at the same pass).

While no machine is up (running, pending or preempted) both runs jump to the next thing the
people in the scenario do: the passes would find nothing to act on. About a hundred cron passes
and five hundred daemon minutes in all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import ROUND_DOWN, Decimal
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import select

from provisioner import identity, machines
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.jobs import cycle, daemon
from provisioner.machines import jobs
from provisioner.models import Event, Heartbeat, Machine, UsageInterval
from provisioner.schema import MachineStatus as S
from provisioner.spec import Experiment
from tests.conftest import PG_URL, make_settings, sandbox_experiment, write_yaml

MSK = ZoneInfo("Europe/Moscow")


def msk(month: int, day: int, hh: int, mm: int = 0) -> datetime:
    return datetime(2026, month, day, hh, mm, tzinfo=MSK).astimezone(UTC)


START = msk(4, 30, 17)
END = msk(5, 4, 10)
TICK = timedelta(minutes=5)  # the cron period, and the agents' heartbeat period here
MINUTE = timedelta(minutes=1)
BURN = timedelta(hours=1)  # the budget runs out an hour after the launch

NIGHTS = {
    "name": "nights",
    "applies_to": {"projects": ["demo"]},
    "off_hours": {
        "timezone": "Europe/Moscow",
        "windows": [{"days": "mon-fri", "start": "19:00", "end": "08:00"}],
        "holidays": "RU",
    },
    "idle": {"gpu_util_below": 5, "for_minutes": 10, "action": "stop"},
}
#: what the events of each run are compared on
KINDS = ("stopped", "terminated", "started", "relaunched", "preempted", "job-finished", "launched")


def util(name: str, at: datetime) -> float:
    """What each machine's agent reports at ``at``: its busiest GPU."""
    loc = at.astimezone(MSK)
    minutes = loc.hour * 60 + loc.minute
    if name == "office":
        busy_until = {30: 18 * 60 + 30, 1: 11 * 60 + 30, 2: 11 * 60 + 20, 4: 24 * 60}[loc.day]
        return 80.0 if minutes < busy_until else 1.0
    if name == "auto":
        busy_until = {30: 17 * 60 + 40, 2: 12 * 60 + 20}.get(loc.day, 0)
        return 90.0 if minutes < busy_until else 1.0
    if name in ("spot", "burn"):
        return 70.0
    return 1.0  # train: its jobs wait on I/O, the GPUs idle


# ---- what the people in the scenario do ------------------------------------------------------


def experiment(name: str, project: str, gpu: str, market: str, **extra: Any) -> Experiment:
    data = sandbox_experiment(name, gpu=gpu, market=market)
    data["project"] = project
    data.update(extra)
    return Experiment.model_validate(data)


def end_job(app: App, name: str, job: str, code: int) -> None:
    """The job exits with ``code`` now, as its process would (where the sandbox keeps it)."""
    m = machines.find(app, name)
    folder = app.provider("sandbox").machine_dir(m.instance_id or "") / "jobs" / job
    with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
        os.killpg(int((folder / "pid").read_text()), signal.SIGKILL)
    (folder / "exit_code").write_text(f"{code}\n")


def start(app: App, name: str) -> None:
    if machines.find(app, name).status == S.STOPPED:
        machines.start(app, name)


def launch_all(app: App, policies: Path) -> None:
    machines.up(app, experiment("office", "demo", "T4:1", "reserved"))
    machines.up(app, experiment("train", "demo", "A100:1", "reserved", run="sleep 3600"))
    machines.up(app, experiment("auto", "lab", "T4:1", "reserved", lifecycle={"autostop": "10m"}))
    machines.up(app, experiment("spot", "lab", "T4:1", "spot", lifecycle={"max_lifetime": "2h"}))
    burn = machines.up(app, experiment("burn", "money", "A100:8", "reserved")).machine
    assert burn.rate is not None and burn.disk_rate is not None
    per_h = burn.rate + burn.disk_rate
    spent = per_h * Decimal(BURN // timedelta(minutes=1)) / 60  # its cost at launch + 1 h
    amount = spent.quantize(Decimal("0.0001"), rounding=ROUND_DOWN)
    assert spent - per_h / 60 < amount <= spent  # run out within the last minute of that hour
    write_yaml(
        policies / "money.yaml",
        {
            "name": "money",
            "applies_to": {"projects": ["money"]},
            "budget": {"amount": f"{amount} USD", "on_exhausted": "stop", "alerts": {"actual": []}},
        },
    )
    app.__dict__.pop("policies", None)  # the budget set once the machine runs


def plan() -> list[tuple[datetime, Callable[[App], None]]]:
    """(when, what): the people's actions, the cloud's preemption, the jobs' ends."""

    def preempt(app: App) -> None:
        app.provider("sandbox").preempt(machines.ref(machines.find(app, "spot")))

    def monday(app: App) -> None:
        start(app, "office")
        start(app, "train")
        jobs.exec_job(app, "train", "sleep 3600")

    out: list[tuple[datetime, Callable[[App], None]]] = [
        (msk(4, 30, 17, 32), preempt),
        (msk(4, 30, 19, 43), lambda app: end_job(app, "train", jobs.RUN, 0)),
        (msk(5, 1, 11), lambda app: start(app, "office")),  # the holiday: some work
        (msk(5, 2, 11), lambda app: start(app, "office")),  # Saturday: some work
        (msk(5, 2, 12), lambda app: start(app, "auto")),
        (msk(5, 4, 9), monday),
        (msk(5, 4, 9, 47), lambda app: end_job(app, "train", "exec-1", 0)),
    ]
    return sorted(out, key=lambda x: x[0])


# ---- the two drivers ---------------------------------------------------------------------------


Driver = Callable[[App], tuple[Callable[[datetime], None], timedelta]]


def by_cron(app: App) -> tuple[Callable[[datetime], None], timedelta]:
    """`provisioner sweep` every 5 minutes: the whole cycle once."""
    return lambda _: cycle.once(app), TICK


def by_daemon(app: App) -> tuple[Callable[[datetime], None], timedelta]:
    """The daemon's jobs, each when its interval comes round (a missed run runs once)."""
    scheduled = daemon.schedule(app)
    due = dict.fromkeys((name for name, _, _ in scheduled), START)

    def tick(now: datetime) -> None:
        for name, call, every in scheduled:
            if now >= due[name]:
                call()
                step = timedelta(seconds=every)
                due[name] = START + ((now - START) // step + 1) * step

    return tick, MINUTE


def live(app: App) -> bool:
    with app.db.session() as s:
        return (
            s.scalars(
                select(Machine.id).where(
                    Machine.status.in_((S.RUNNING, S.PENDING, S.STOPPING, S.PREEMPTED, S.WAITING))
                )
            ).first()
            is not None
        )


def beat(app: App, now: datetime) -> None:
    """Each running machine's agent reports its GPUs (every 5 minutes)."""
    with app.db.session() as s:
        running = list(s.scalars(select(Machine).where(Machine.status == S.RUNNING)))
        for m in running:
            u = util(m.name, now)
            s.add(
                Heartbeat(
                    machine_id=m.id,
                    at=now,
                    gpus=[{"index": 0, "util": u}],
                    max_util=u,
                    ssh_sessions=0,
                )
            )


@dataclass
class Outcome:
    events: list[tuple[str, str, str | None, str]]  # (at, machine, kind, reason)
    money: dict[str, Decimal]  # machine name → what the ledger holds to END
    passes: int


def simulate(app: App, policies: Path, driver: Driver) -> Outcome:
    app.actor = identity.SCHEDULER
    launch_all(app, policies)
    todo = plan()
    tick, every = driver(app)
    now, passes = START, 0
    while now < END:
        while todo and todo[0][0] <= now:  # at its own instant, between ticks
            at, act = todo.pop(0)
            app.clock.set(at)
            act(app)
        app.clock.set(now)
        if (now - START) % TICK == timedelta(0):
            beat(app, now)
        tick(now)
        passes += 1
        nxt = now + every
        if not live(app):  # nothing up: nothing to act on until someone does something
            nxt = max(nxt, min(todo[0][0] if todo else END, END))
            nxt = START + -((START - nxt) // TICK) * TICK  # the next tick at or after it
        now = nxt
    return outcome(app, passes)


def outcome(app: App, passes: int) -> Outcome:
    with app.db.session() as s:
        names = {m.id: m.name for m in s.scalars(select(Machine))}
        events = [
            (e.at.isoformat(), names[e.machine_id], e.kind, e.reason)
            for e in s.scalars(select(Event).where(Event.kind.in_(KINDS)).order_by(Event.id))
        ]
        money: dict[str, Decimal] = {}
        for u in s.scalars(select(UsageInterval)):
            began = max(u.started_at, START)
            ended = min(u.ended_at or END, END)
            if ended > began:
                us = (ended - began) // timedelta(microseconds=1)
                cost = u.rate * Decimal(us) / 3_600_000_000
                money[names[u.machine_id]] = money.get(names[u.machine_id], Decimal(0)) + cost
    return Outcome(sorted(events), money, passes)


@pytest.fixture
def two_states(db_url, tmp_path) -> Iterator[tuple[str | None, str | None]]:
    """Two empty states on the same kind of database: the daemon's run and the cron's."""
    if db_url is None:
        yield None, None
        return
    import psycopg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield db_url, f"{PG_URL}?options=-csearch_path%3D{schema}&application_name={schema}"
    finally:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = %s",
                (schema,),
            )
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


def run(tmp_path: Path, name: str, url: str | None, driver: Driver) -> Outcome:
    home, policies = tmp_path / name, tmp_path / name / "policies"
    policies.mkdir(parents=True)
    write_yaml(policies / "nights.yaml", NIGHTS)
    settings = make_settings(
        home,
        state_url=url,
        policies=[str(policies)],
        scheduler={
            "sweep_interval_seconds": 300,
            "recover_interval_seconds": 300,
            "reconcile_interval_seconds": 300,
            "heartbeat_grace_seconds": 360,  # agents report every 5 minutes here
        },
    )
    app = App(settings, ManualClock(START))
    try:
        return simulate(app, policies, driver)
    finally:
        app.close()


@pytest.mark.slow  # some 400 passes on the sandbox (about 25 s a database unloaded): CI runs it
def test_the_long_weekend_by_cron_sweeps_equals_the_daemon_to_the_decimal(
    tmp_path, two_states, capsys
):
    by_d = run(tmp_path, "daemon", two_states[0], by_daemon)
    by_c = run(tmp_path, "cron", two_states[1], by_cron)
    assert by_c.events == by_d.events
    assert by_c.money == by_d.money
    stops = [(at, name, reason) for at, name, kind, reason in by_c.events if kind == "stopped"]
    # every rule acted, once each where it should: the evening's, the holiday's and Saturday's
    # idle stops, on_finish (not the 19:00 stop: the job ran), autostop twice, the lifetime,
    # the budget; the preemption relaunched; the jobs' ends recorded when next looked at
    assert stops == [
        (msk(4, 30, 17, 50).isoformat(), "auto", "autostop"),  # idle from 17:40
        (msk(4, 30, 18).isoformat(), "burn", "budget"),
        (msk(4, 30, 19).isoformat(), "office", "off-hours-idle"),  # idle since 18:30
        (msk(4, 30, 19).isoformat(), "spot", "max-lifetime"),  # launched 17:00
        (msk(4, 30, 19, 45).isoformat(), "train", "on-finish"),
        (msk(5, 1, 11, 40).isoformat(), "office", "off-hours-idle"),  # the holiday
        (msk(5, 2, 11, 30).isoformat(), "office", "off-hours-idle"),  # Saturday
        (msk(5, 2, 12, 30).isoformat(), "auto", "autostop"),
    ]
    kinds = [(at, name, kind) for at, name, kind, _ in by_c.events]
    # taken at 17:32, seen and started again in place by the 17:35 pass
    assert (msk(4, 30, 17, 32).isoformat(), "spot", "preempted") in kinds
    assert (msk(4, 30, 17, 35).isoformat(), "spot", "started") in kinds
    ends = [(at, name) for at, name, kind, _ in by_c.events if kind == "job-finished"]
    assert ends == [
        (msk(4, 30, 19, 45).isoformat(), "train"),  # run exited 19:43, seen by the next pass
        (msk(5, 4, 9, 50).isoformat(), "train"),  # exec-1 exited 09:47
    ]
    with capsys.disabled():
        total = sum(by_c.money.values(), Decimal(0))
        print(
            f"\n  {len(by_c.events)} events, {len(stops)} stops, ledger {total} USD in both; "
            f"passes: daemon {by_d.passes} minutes, cron {by_c.passes} ticks"
        )
