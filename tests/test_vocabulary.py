"""One machine vocabulary: every status a machine can be in, the moves between them (an illegal
one fails loudly, whoever writes it), the launch attempt as one typed record, and the fleet's
plain-SQL row kept in step with the model."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from decimal import Decimal

import pytest
from sqlalchemy import select

from providers.base import MachineState
from provisioner import fleet, ledger, machines
from provisioner.machines import LaunchAttempt
from provisioner.models import Event, Machine
from provisioner.schema import (
    ACTIVE_EXCLUDED,
    TRANSITIONS,
    AttemptOutcome,
    IllegalTransition,
    MachineStatus,
    check_transition,
)
from provisioner.spec import Experiment
from tests.conftest import run_cli, sandbox_experiment, write_settings, write_yaml

S = MachineStatus


def experiment(name="exp") -> Experiment:
    return Experiment.model_validate(sandbox_experiment(name))


def test_the_table_covers_every_status_and_nothing_leaves_an_end():
    assert set(TRANSITIONS) == set(MachineStatus)
    assert TRANSITIONS[S.TERMINATED] == TRANSITIONS[S.FAILED] == frozenset()
    assert set(ACTIVE_EXCLUDED) == {S.TERMINATED, S.FAILED}
    # what a cloud can report of a machine is a status of ours
    assert {s.value for s in MachineState} <= {s.value for s in MachineStatus}
    # only an intent fails, and nothing launched goes back to being an intent: a waiting
    # intent's try is the one way back to requested
    assert {s for s, to in TRANSITIONS.items() if S.FAILED in to} == {S.REQUESTED, S.WAITING}
    assert [s for s, to in TRANSITIONS.items() if S.REQUESTED in to] == [S.WAITING]
    assert [s for s, to in TRANSITIONS.items() if S.WAITING in to] == [S.REQUESTED]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("terminated", "running"),
        ("failed", "running"),
        ("running", "requested"),
        ("stopped", "failed"),
    ],
)
def test_an_illegal_move_is_refused(old, new):
    with pytest.raises(IllegalTransition, match=f"from {old} to {new}"):
        check_transition(old, new)


def test_a_terminated_machine_cannot_be_brought_back_by_any_writer(app):
    m = machines.up(app, experiment()).machine
    machines.down(app, m.name)
    with app.db.session() as s:  # through the ledger, as every writer goes
        row = s.get(Machine, m.id)
        with pytest.raises(IllegalTransition):
            ledger.record_transition(s, row, S.RUNNING, app.clock.now())
        s.rollback()
    with app.db.session() as s:  # or by hand on the row: the model checks the move itself
        row = s.get(Machine, m.id)
        with pytest.raises(IllegalTransition):
            row.status = S.RUNNING
        s.rollback()
    with app.db.session() as s:
        row = s.get(Machine, m.id)
        assert row.status is S.TERMINATED  # read back as the enum, nothing written
        kinds = [e.kind for e in s.scalars(select(Event).where(Event.machine_id == m.id))]
    assert kinds.count("terminated") == 1 and "running" not in kinds[kinds.index("terminated") :]


def test_the_fleet_row_reads_the_model_columns_with_their_types():
    """`status` without the ORM (provisioner/fleet.py) reads these columns by name: each is a
    column of ``machines`` whose Python type is the model's."""
    table = Machine.__table__.columns
    assert set(fleet.COLUMNS) <= set(table.keys())
    model = typing.get_type_hints(Machine)
    row = typing.get_type_hints(fleet.Row)
    for col in fleet.COLUMNS:
        assert row[col] == model[col].__args__[0], col


def test_a_launch_attempt_is_one_record_from_event_to_json(home, app):
    result = machines.up(app, experiment("rec"))
    (attempt,) = result.attempts
    assert attempt.outcome is AttemptOutcome.LAUNCHED
    assert attempt.rate.amount == result.machine.rate and attempt.rate.currency == "USD"
    with app.db.session() as s:
        details = {
            e.kind: e.detail
            for e in s.scalars(select(Event).where(Event.machine_id == result.machine.id))
        }
    recorded = LaunchAttempt.from_json(details["launch-attempt"])
    assert recorded == dataclasses.replace(attempt, outcome=None)
    assert Decimal(details["launched"]["rate"]) == result.machine.rate
    # an event written before the type (no "where", no outcome) still reads
    old = {k: v for k, v in details["launch-attempt"].items() if k != "where"}
    assert LaunchAttempt.from_json(old) == recorded

    # and `up -o json` shows the same record: exact decimal rate with its currency
    path = write_yaml(home.parent / "j.yaml", sandbox_experiment("json-up"))
    cfg = write_settings(home)
    out = run_cli("--config", str(cfg), "up", str(path), "--no-wait", "-o", "json")
    assert out.returncode == 0, out.stderr
    [shown] = json.loads(out.stdout)["attempts"]
    assert shown["outcome"] == "launched" and shown["currency"] == "USD"
    assert Decimal(shown["rate"]) > 0 and shown["where"].startswith("sandbox/")


def test_the_documented_state_machine_is_the_table():
    """docs/ARCHITECTURE.md draws the transition table; the drawing may not drift from it."""
    from tests.conftest import ROOT

    doc = (ROOT / "docs/ARCHITECTURE.md").read_text(encoding="utf-8")
    (diagram,) = re.findall(r"```mermaid\n(.*?)```", doc, re.S)
    edges = set(re.findall(r"^\s*(\w+) --> (\w+)\s*$", diagram, re.M))
    drawn = {(a, b) for a, b in edges if "[" not in a + b}
    table = {(a.value, b.value) for a, to in TRANSITIONS.items() for b in to}
    assert drawn == table
