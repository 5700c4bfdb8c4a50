"""One vocabulary: every status a machine, a volume or a delivery can be in, the moves between
them (an illegal one fails loudly, whoever writes it), every kind of event (one outside it fails
where it is written), none of them compared or written as a bare string anywhere in
provisioner/ (SQL text included), the launch attempt as one typed record, and the fleet's
plain-SQL row kept in step with the model."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import typing
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import select

from providers import billing
from providers.base import MachineState
from provisioner import fleet, ledger, machines
from provisioner.machines import LaunchAttempt, jobs
from provisioner.models import Delivery, Event, Machine, Volume
from provisioner.schema import (
    ACTIVE_EXCLUDED,
    DELIVERY_TRANSITIONS,
    TRANSITIONS,
    VOLUME_TRANSITIONS,
    AttemptOutcome,
    DeliveryStatus,
    EventKind,
    IllegalTransition,
    MachineStatus,
    NoticeKind,
    UsageKind,
    VolumeStatus,
    check_move,
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


TABLES = {MachineStatus: TRANSITIONS, VolumeStatus: VOLUME_TRANSITIONS}
TABLES[DeliveryStatus] = DELIVERY_TRANSITIONS


def test_the_documented_state_machines_are_the_tables():
    """docs/ARCHITECTURE.md draws each transition table; no drawing may drift from its table."""
    from tests.conftest import ROOT

    doc = (ROOT / "docs/ARCHITECTURE.md").read_text(encoding="utf-8")
    drawn = {}
    for diagram in re.findall(r"```mermaid\n(.*?)```", doc, re.S):
        edges = set(re.findall(r"^\s*([\w-]+) --> ([\w-]+)\s*$", diagram, re.M))
        born = set(re.findall(r"^\s*\[\*\] --> ([\w-]+)\s*$", diagram, re.M))
        drawn[frozenset(born)] = {(a, b) for a, b in edges}
    assert len(drawn) == len(TABLES)
    for vocabulary, table in TABLES.items():
        assert set(table) == set(vocabulary)  # every status has its row
        moves = {(a.value, b.value) for a, to in table.items() for b in to}
        assert moves in drawn.values(), vocabulary.__name__


@pytest.mark.parametrize(
    ("vocabulary", "old", "new"),
    [
        (VolumeStatus, "deleted", "available"),
        (VolumeStatus, "in-use", "creating"),
        (DeliveryStatus, "sent", "retrying"),
        (DeliveryStatus, "failed", "pending"),
    ],
)
def test_a_volume_or_delivery_cannot_move_back(vocabulary, old, new):
    with pytest.raises(IllegalTransition, match=f"from {old} to {new}"):
        check_move(vocabulary, old, new)


def test_each_row_checks_its_own_moves_and_values(app):
    """A volume deleted, a delivery sent: no writer brings them back; a status or a kind
    outside its vocabulary is refused where it is written, not found later by a reader."""
    v = Volume(status=VolumeStatus.IN_USE)
    v.status = VolumeStatus.DELETED
    with pytest.raises(IllegalTransition, match="a volume cannot move from deleted to in-use"):
        v.status = VolumeStatus.IN_USE
    d = Delivery(status="pending")
    assert d.status is DeliveryStatus.PENDING
    d.status = DeliveryStatus.SENT
    with pytest.raises(IllegalTransition, match="a delivery cannot move from sent to retrying"):
        d.status = DeliveryStatus.RETRYING
    with pytest.raises(ValueError, match="'delivered' is not a valid DeliveryStatus"):
        Delivery(status="delivered")
    m = machines.up(app, experiment("kinds")).machine
    with pytest.raises(ValueError, match="'relaunch-try' is not a valid EventKind"):
        machines.record_event(app, m.id, "relaunch-try")  # type: ignore[arg-type]
    with app.db.session() as s:  # read back as members
        kinds = list(s.scalars(select(Event.kind).where(Event.machine_id == m.id)))
    assert kinds and all(type(k) is EventKind for k in kinds)
    assert "relaunch-try" not in kinds


PROVISIONER = Path(__file__).resolve().parents[1] / "provisioner"
#: ``kind``s of vocabularies typed elsewhere: a cloud bill's lines (a ``Literal`` of providers)
#: and notify channels (policies/channels.py). Any other string compared to a ``kind`` is
#: taken for a kind of provisioner's own (events, usage, budget notices): a bare one fails.
OTHER_KINDS = {*typing.get_args(billing.Kind), "email"}
#: What writes an event's kind: the call and the argument (position, or keyword).
WRITERS = {"record_event": 2, "Event": "kind", "_record": 4}
SQL = re.compile(r"\b(status|kind)\s*(=|!=|<>|\bIN\b|\bNOT IN\b)\s*\(?\s*'\w", re.I)


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [s for e in node.elts for s in _strings(e)]
    return []


def _vocab(node: ast.AST) -> str | None:
    """``status`` or ``kind`` if ``node`` reads one (``m.status``, ``Event.kind``, ``status``)."""
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
    return name if name in ("status", "kind") else None


def _bare(word: str, strings: list[str]) -> list[str]:
    return [s for s in strings if word == "status" or s not in OTHER_KINDS]


def bare_vocabulary(source: str) -> list[str]:
    """Each line of ``source`` that compares or writes a status or an event's kind as a bare
    string, or whose SQL text holds one."""
    found = []
    for n in ast.walk(ast.parse(source)):
        hits: list[str] = []
        if isinstance(n, ast.Compare):
            sides = [n.left, *n.comparators]
            for word in filter(None, map(_vocab, sides)):
                hits += _bare(word, [s for side in sides for s in _strings(side)])
        elif isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("in_", "not_in") and isinstance(f, ast.Attribute) and _vocab(f.value):
                hits += _bare(str(_vocab(f.value)), [s for a in n.args for s in _strings(a)])
            for k in n.keywords:
                if k.arg == "event" or (k.arg == "kind" and name in WRITERS):
                    hits += _bare("kind", _strings(k.value))
                elif k.arg == "status":
                    hits += _strings(k.value)
            at = WRITERS.get(name)
            if isinstance(at, int) and len(n.args) > at:
                hits += _strings(n.args[at])
        elif isinstance(n, ast.Assign) and isinstance(n.value, ast.Tuple | ast.Constant):
            for t in n.targets:  # row.status = "x"; row.status, row.error = "x", None
                values = n.value.elts if isinstance(n.value, ast.Tuple) else [n.value]
                pairs = (
                    zip(t.elts, values, strict=False)
                    if isinstance(t, ast.Tuple)
                    else [(t, n.value)]
                )
                for target, v in pairs:
                    if isinstance(target, ast.Attribute) and _vocab(target) == "status":
                        hits += _strings(v)
        elif isinstance(n, ast.Constant | ast.JoinedStr):  # SQL text ('{}': a value formatted in)
            parts = [n] if isinstance(n, ast.Constant) else n.values
            text = "".join(str(p.value) if isinstance(p, ast.Constant) else "{}" for p in parts)
            strings = not isinstance(n, ast.Constant) or isinstance(n.value, str)
            hits += [text] if strings and SQL.search(text) else []
        found += [f"{n.lineno}: {h!r}" for h in hits]
    return found


@pytest.mark.parametrize(
    "line",
    [
        'if e.kind == "relaunch-try": pass',
        'if n.kind == "exhausted": pass',
        'if m.status != "running": pass',
        'q = select(Volume).where(Volume.status.in_(("creating", "available")))',
        'record_event(app, m.id, "relaunch-try", reason="preempted")',
        's.add(Event(machine_id=m.id, at=now, kind="relaunch-try"))',
        'transition(app, m.id, S.FAILED, event="cancelled")',
        'row.status, row.error = "sent", None',
        "sql.all(\"SELECT id FROM machines WHERE status = 'running'\")",
        "sql.all(f\"SELECT id FROM events WHERE kind IN ('waiting', {x})\")",
    ],
)
def test_the_scan_finds_a_bare_status_or_kind(line):
    assert bare_vocabulary(line)


def test_no_status_or_kind_is_a_bare_string_in_provisioner():
    """Statuses and event kinds are compared and written by their members (SQL: a bound
    member, or its value formatted in), so a new one is declared, with its meaning, first."""
    fine = [
        "if e.kind == EventKind.WAITING and m.status in (S.RUNNING, S.STOPPED): pass",
        "sql.all(f\"SELECT id FROM machines WHERE status = '{S.RUNNING}'\")",
        'sql.all("SELECT id FROM events WHERE kind = ?", [EventKind.RECOVERED.value])',
        'if item.kind == "tax": pass',  # a line of a cloud's bill
    ]
    assert not bare_vocabulary("\n".join(fine))
    found = [
        f"{path.relative_to(PROVISIONER.parent)}:{hit}"
        for path in sorted(PROVISIONER.rglob("*.py"))
        if "migrations" not in path.parts
        for hit in bare_vocabulary(path.read_text(encoding="utf-8"))
    ]
    assert found == []


#: a status or kind compared with a quoted word in a template: ``m.status == 'stopped'``,
#: ``d.status in ('failed', 'unsent')``
_TEMPLATE_BARE = re.compile(r"\b(?:status|kind)\s*(?:[=!]=|(?:not\s+)?in)\s*\(?\s*['\"]")


def bare_in_templates(text: str) -> list[str]:
    return [
        f"{n}: {line.strip()[:80]}"
        for n, line in enumerate(text.splitlines(), 1)
        if _TEMPLATE_BARE.search(line)
    ]


def test_no_status_is_a_bare_string_in_the_dashboard_templates():
    """The pages compare statuses by their members too (``S``, ``D`` in the Jinja globals), so
    a renamed or new status cannot leave a button on the wrong machines."""
    assert bare_in_templates("{% if m.status == 'stopped' %}") != []
    assert bare_in_templates("{% if d.status in ('failed', 'unsent') %}") != []
    assert bare_in_templates("{% if m.status in (S.RUNNING, S.PENDING) %}") == []
    found = [
        f"{path.relative_to(PROVISIONER.parent)}:{hit}"
        for path in sorted((PROVISIONER / "templates").rglob("*.html"))
        for hit in bare_in_templates(path.read_text(encoding="utf-8"))
    ]
    assert found == []


def test_every_event_kind_is_written_somewhere_and_means_something():
    """A kind nobody writes is noise for every reader; a value without its line of meaning is
    a puzzle. Each machine status is also a kind (a move recorded without a kind of its own)."""
    source = (PROVISIONER / "schema.py").read_text(encoding="utf-8")
    for vocabulary in (EventKind, VolumeStatus, DeliveryStatus, UsageKind, NoticeKind):
        start = source.index(f"class {vocabulary.__name__}(")
        body = source[start : source.index("\n\n\n", start)]
        for member in vocabulary:
            (line,) = [x for x in body.splitlines() if x.strip().startswith(f"{member.name} = ")]
            assert "  # " in line, f"{vocabulary.__name__}.{member.name}: its meaning, beside it"
    assert {s.value for s in MachineStatus} <= {k.value for k in EventKind}
    used = " ".join(
        p.read_text(encoding="utf-8") for p in PROVISIONER.rglob("*.py") if p.name != "schema.py"
    )
    unwritten = [
        k.name
        for k in EventKind
        if k.value not in {s.value for s in MachineStatus}
        and not re.search(rf"\b(EventKind|K)\.{k.name}\b", used)
    ]
    assert unwritten == []
    # the quick `status` path mirrors the jobs' kinds without importing SQLAlchemy
    from provisioner import entry

    assert (entry._STARTED, entry._FINISHED, entry._FAILED, entry._DUE, entry._RUN) == (
        jobs.STARTED,
        jobs.FINISHED,
        jobs.FAILED,
        jobs.DUE,
        jobs.RUN,
    )
