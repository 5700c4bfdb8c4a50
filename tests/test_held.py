"""A machine held after a refused relaunch, on the sandbox cloud over a simulated day: one
event per change (not one per sweep), tries counted across passes with the backoff between
them, one give-up, and `status NAME` saying why it is held and when it is tried next."""

from __future__ import annotations

import html
from datetime import datetime, timedelta
from itertools import pairwise

import pytest

from provisioner import machines
from provisioner.app import App
from provisioner.dashboard import make_app
from provisioner.jobs import reconcile, recover, sweep
from provisioner.views.status import machine_detail
from tests.conftest import run_cli, write_settings
from tests.test_dashboard import call
from tests.test_scheduler import FRI_1700, events, preempt, sched, status, up  # noqa: F401

ANY = "name: any\n"
A100_ONLY = "name: a100-only\napplies_to: {projects: ['demo']}\nallow: {gpus: ['A100']}\n"
SWEEP = timedelta(minutes=5)


def held_spot(sched, policy: str = A100_ONLY) -> App:  # noqa: F811
    """A spot machine launched under a permissive policy, preempted, and then a policy that
    refuses its relaunch (same state, same sandbox, same time)."""
    first = sched(ANY)
    up(first, "spot", lifecycle={"on_preemption": "relaunch"})
    preempt(first, "spot")
    reconcile.run(first)
    return sched(policy, start=first.clock.now())


def day_of_passes(app: App, span: timedelta = timedelta(days=1)) -> list[datetime]:
    """The daemon's sweep and recover, every 5 minutes for ``span``: when each try was made."""
    tried = []
    end = app.clock.now() + span
    while app.clock.now() < end:
        sweep.run(app)  # its reconcile reads the cloud's answer about the held machine
        p = recover.run(app)
        tried += [app.clock.now() for a in p.actions if a.action in ("start", "relaunch")]
        app.clock.advance(SWEEP)
    return tried


@pytest.mark.slow  # a day of sweeps
def test_a_held_machine_writes_a_handful_of_events_a_day_not_one_per_sweep(sched):  # noqa: F811
    app = held_spot(sched)
    start = app.clock.now()
    tried = day_of_passes(app)
    ev = events(app, "spot")
    written = ev[ev.index(("preempted", "preempted")) :]
    # before: each 5-minute pass wrote `preempted` and `relaunch-refused` again (576 a day)
    assert written == [
        ("preempted", "preempted"),
        ("relaunch-refused", "preempted"),
        ("relaunch-gave-up", "preempted"),
    ]
    assert status(app, "spot") == "preempted"  # held as the cloud left it: stopped, disk kept
    # tries counted across passes, each after the backoff of those before it
    assert len(tried) == recover.MAX_ATTEMPTS
    for n, (a, b) in enumerate(pairwise(tried), start=1):
        assert b - a >= recover.backoff(n)
        assert b - a < recover.backoff(n) + SWEEP  # tried on the first pass it was due
    assert recover.backoff(1) == timedelta(minutes=1)
    assert recover.backoff(recover.MAX_ATTEMPTS) == timedelta(hours=1)
    assert tried[-1] - start < timedelta(hours=5)
    t = recover.tries(machine_detail(app, "spot").events)
    assert t.attempts == recover.MAX_ATTEMPTS and t.gave_up is not None
    assert t.refusal.detail["attempts"] == recover.MAX_ATTEMPTS
    assert t.refusal.detail["by"] == "policy for spot"
    assert t.gave_up.detail["attempts"] == recover.MAX_ATTEMPTS
    assert t.gave_up.at == tried[-1]  # given up on the last try's pass, once
    # no longer retried: nothing due, nothing written, on another day
    assert recover.run(app).actions == []
    day_of_passes(app, timedelta(hours=2))
    assert len(events(app, "spot")) == len(ev)


def test_status_says_why_it_is_held_and_when_it_is_tried_next(sched, home, db_url, tmp_path):  # noqa: F811
    app = held_spot(sched)
    at = app.clock.now()
    recover.run(app)
    d = machine_detail(app, "spot")
    assert d.machine.status == "preempted"
    assert d.held == (
        "relaunch refused by policy for spot: "
        + d.events[-1].detail["why"].partition(": ")[2]
        + f"; 1 of {recover.MAX_ATTEMPTS} tries, next try {at + timedelta(minutes=1):%H:%M} UTC"
    )
    assert "A100" in d.held  # the policy's own words
    # `status NAME` and the dashboard's machine page both show it
    cfg = write_settings(home, state_url=db_url, policies=[str(tmp_path / "policy.yaml")])
    r = run_cli("--config", str(cfg), "status", "spot", "--no-refresh", now=app.clock.now())
    assert r.returncode == 0, r.stderr
    assert f"held     {d.held}" in r.stdout.replace("\n", " ")
    code, _, page = call(make_app(app), "/machine/spot")
    assert code == 200 and f"held: {html.escape(d.held)}</p>" in page
    app.clock.advance(timedelta(seconds=30))
    assert recover.run(app).actions == []  # backing off: nothing tried, nothing written
    app.clock.advance(timedelta(seconds=30))
    assert recover.run(app).actions[0].error
    d = machine_detail(app, "spot")
    assert d.held.endswith(f"2 of 10 tries, next try {at + timedelta(minutes=3):%H:%M} UTC")
    day_of_passes(app, timedelta(hours=6))
    d = machine_detail(app, "spot")
    gave_up = recover.tries(d.events).gave_up.at
    assert d.held.endswith(f"; gave up after 10 tries at {gave_up:%H:%M} UTC")


def test_a_different_refusal_is_a_new_event_and_the_count_goes_on(sched, tmp_path):  # noqa: F811
    app = held_spot(sched)
    recover.run(app)
    app.clock.advance(timedelta(minutes=1))
    recover.run(app)
    # now a budget refuses it instead (the disk has billed ~1 cent; the budget is less)
    budget = "name: tiny\nbudget: {amount: 0.001 USD, period: month, on_exhausted: block}\n"
    other = sched(budget, start=app.clock.now() + timedelta(minutes=2))
    p = recover.run(other)
    assert "refused by budget tiny" in p.actions[0].error
    ev = events(other, "spot")
    assert ev.count(("relaunch-refused", "preempted")) == 2
    t = recover.tries(machine_detail(other, "spot").events)
    assert t.attempts == 3 and t.refusal.detail["attempts"] == 1
    assert machine_detail(other, "spot").held.startswith("relaunch refused by budget tiny")


def test_a_relaunch_allowed_again_relaunches_the_held_machine(sched):  # noqa: F811
    app = held_spot(sched)
    recover.run(app)
    free = sched(ANY, start=app.clock.now() + timedelta(minutes=1))
    held = machines.find(free, "spot")
    p = recover.run(free)
    assert p.actions[0].done and status(free, "spot") == "running"
    assert machines.find(free, "spot").id == held.id  # started again in place, its disk kept
    assert machine_detail(free, "spot").held is None
    assert recover.run(free).actions == []


def test_a_held_machine_is_retried_after_a_restart(sched):  # noqa: F811
    """The count lives in the events: a new scheduler (a new App) continues it."""
    app = held_spot(sched)
    recover.run(app)
    again = sched(A100_ONLY, start=app.clock.now() + timedelta(minutes=1))
    p = recover.run(again)
    assert p.actions[0].why.endswith(f"(try 2 of {recover.MAX_ATTEMPTS})")
    assert recover.tries(machine_detail(again, "spot").events).attempts == 2
    assert machines.find(again, "spot").status == "preempted"
