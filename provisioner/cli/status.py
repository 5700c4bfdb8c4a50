"""status (the fleet, or one machine in detail) and events: what each machine is, has cost,
and why it is as it is."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import typer

from provisioner.cli import (
    OUTPUT,
    Output,
    amount,
    app,
    err,
    get_app,
    out,
    plural,
    print_json,
    text_table,
    write,
)
from provisioner.cli.machines import _money, machine_json
from provisioner.schema import ACTIVE_EXCLUDED


@app.command()
def status(
    ctx: typer.Context,
    name: str = typer.Argument(None, help="one machine, in detail", show_default=False),
    all_: bool = typer.Option(False, "--all", "-a", help="include terminated and failed machines"),
    refresh: bool = typer.Option(True, help="ask the clouds first (reconcile)"),
    output: Output = OUTPUT,
) -> None:
    """Machines and their state, reconciled with what the clouds report, with what each has
    cost so far (compute and disk, at its launch-time rate, across relaunches). With a NAME:
    that machine in detail, with its next scheduled action and its events."""
    from provisioner.schema import known_empty

    application = get_app(ctx)
    if not name and known_empty(application.settings.database_url, all_):
        if output is Output.json:
            print_json([])
        else:
            out.print(
                "no machines" + ("" if all_ else " (use --all to include terminated ones)"),
                soft_wrap=True,
            )
        return
    if name:
        if refresh:
            _reconcile(application)
        _detail(application, name, output)
        return
    rows = _fleet_rows(application, all_)
    problems = []
    asked = {m.id for m, *_ in rows if m.status not in ("requested", *ACTIVE_EXCLUDED)}
    if refresh and asked:
        observed = _reconcile(application)
        problems = [o for o in observed if o.error]
        if _moved(rows, asked, observed):
            rows = _fleet_rows(application, all_)
    unseen = _unseen(application) if rows else {}
    unseen.update({m.name: why for m, _, _, why in rows if why and m.status == "stopped"})
    if output is Output.json:
        print_json(
            [
                {
                    **machine_json(m),
                    "spent": [{"amount": amount(v), "currency": c} for c, v in sorted(sp.items())],
                    "launches": launches,
                    "problem": unseen.get(m.name),
                    "why": why,
                }
                for m, sp, launches, why in rows
            ]
        )
    elif not rows:
        out.print(
            "no machines" + ("" if all_ else " (use --all to include terminated ones)"),
            soft_wrap=True,
        )
    else:
        columns = [
            ("name", "<", 0),
            ("status", "<", 0),
            ("cloud", "<", 2),
            ("zone", "<", 4),
            ("type", "<", 5),
            ("GPUs", ">", 3),
            ("market", "<", 6),
            ("price/h", ">", 0),
            ("spent", ">", 0),
            ("address", "<", 1),
        ]
        table = [
            [
                m.name,
                m.status,
                m.cloud or "—",
                m.zone or m.region or "—",
                m.instance_type or "—",
                f"{m.gpu_count}×{m.gpu}" if m.gpu else "—",
                m.market or "—",
                _money(m.rate, m.currency),
                " + ".join(_money(v, c) for c, v in sorted(sp.items())) or "—",
                m.public_ip or "—",
            ]
            for m, sp, _, _ in rows
        ]
        write(text_table(columns, table))
        for m, _, _, why in rows:
            if why and m.status == "failed":
                out.print(f"{m.name} failed: {why}", highlight=False, markup=False, soft_wrap=True)
    for n, problem in unseen.items():
        err.print(f"[yellow]warning:[/] {n}: {problem}", highlight=False, soft_wrap=True)
    for o in problems:
        err.print(
            f"[yellow]warning:[/] could not ask {o.machine.cloud} about {o.machine.name}: "
            f"{o.error}",
            soft_wrap=True,
        )


def _moved(rows: list[Any], asked: set[str], observed: list[Any]) -> bool:
    """Whether asking the clouds moved a row shown (its status or address), or saw other
    machines than those read: only then are the rows read again."""
    read = {m.id: (m.status, m.public_ip) for m, *_ in rows}
    return {o.machine.id for o in observed} != asked or any(
        o.changed or read.get(o.machine.id) != (o.machine.status, o.machine.public_ip)
        for o in observed
    )


def _reconcile(application: Any) -> list[Any]:
    from provisioner import lifecycle  # the providers and planning: only when asking the clouds

    return lifecycle.reconcile(application)


def _unseen(application: Any) -> dict[str, str]:
    from provisioner import idle  # SQLAlchemy: not for --help

    grace = timedelta(seconds=application.settings.scheduler.heartbeat_grace_seconds)
    return idle.gpus_not_seen(application, application.clock.now() - grace)


def _fleet_rows(application: Any, all_: bool) -> list[tuple[Any, dict[str, Any], int, str | None]]:
    """(machine, spent per currency across its relaunches, launches, why it failed) for every
    machine shown: three queries whatever the number of machines (machines, the recoveries,
    their costs), a fourth for the events of failed ones, a fifth for notes on stopped ones."""
    from sqlalchemy import or_, select

    from provisioner import state
    from provisioner.models import Event, Machine, UsageInterval

    now = application.clock.now()
    with application.db.session() as s:
        shown = Machine.status.not_in(ACTIVE_EXCLUDED) if not all_ else Machine.id.is_not(None)
        # rows of the columns shown, not ORM objects: 10,000 machines load in a fraction
        columns = [c for c in Machine.__table__.c if c.name not in ("spec", "agent_token_hash")]
        machines = list(
            s.execute(select(*columns).where(shown).order_by(Machine.created_at, Machine.name))
        )
        if not machines:
            return []
        replaces = {
            mid: (d or {}).get("replaces")
            for mid, d in s.execute(
                select(Event.machine_id, Event.detail).where(Event.kind == "recovered")
            )
        }
        chains = {m.id: _chain(m.id, replaces) for m in machines}
        earlier = {mid for c in chains.values() for mid in c[1:]} - {m.id for m in machines}
        of = UsageInterval.machine_id.in_(select(Machine.id).where(shown))
        cost = _costs(s, or_(of, UsageInterval.machine_id.in_(earlier)) if earlier else of, now)
        stopped = [m.id for m in machines if m.status == "stopped"]
        notes = state.stopped_notes(s, stopped) if stopped else {}
        failed = [m.id for m in machines if m.status == "failed"]
        events: dict[str, list[Any]] = {}
        if failed:
            for e in s.scalars(
                select(Event)
                .join(Machine, Machine.id == Event.machine_id)
                .where(Machine.status == "failed", shown)
                .order_by(Event.id)
            ):
                events.setdefault(e.machine_id, []).append(e)
    rows = []
    for m in machines:
        spent: dict[str, Any] = {}
        for mid in chains[m.id]:
            for c, v in cost.get(mid, {}).items():
                spent[c] = spent.get(c, 0) + v
        why = failure(events.get(m.id, [])) if m.status == "failed" else None
        rows.append((m, spent, len(chains[m.id]), why or notes.get(m.id)))
    return rows


def _chain(mid: str, replaces: dict[str, str | None]) -> list[str]:
    """``mid`` and the machines it replaced after preemptions, newest first."""
    chain = [mid]
    while (prev := replaces.get(chain[-1])) and prev not in chain:
        chain.append(prev)
    return chain


def _costs(s: Any, usage: Any, now: datetime) -> dict[str, dict[str, Decimal]]:
    """What each machine of the usage condition has cost up to ``now``, per currency, in one
    query (:func:`provisioner.ledger.machine_costs`); a currency it cost nothing in is left
    out."""
    from provisioner.ledger import machine_costs

    return {
        mid: {c: v for c, v in amounts.items() if v}
        for mid, amounts in machine_costs(s, usage, now).items()
    }


def failure(events: list[Any]) -> str | None:
    """Why a machine failed, from its events: every launch tried and how each ended."""
    if not events:
        return None
    last = events[-1]
    if last.kind == "cancelled":
        return "cancelled by `down` before it was launched"
    tried = [e for e in events if e.kind == "launch-failed"]
    if tried:
        outcomes: dict[str, int] = {}
        for e in tried:
            outcomes[e.reason or "error"] = outcomes.get(e.reason or "error", 0) + 1
        kinds = ", ".join(f"{k} {n}" for k, n in outcomes.items())
        error = (tried[-1].detail or {}).get("error", "")
        return f"no candidate launched ({plural(len(tried), 'attempt')}: {kinds}); last: {error}"
    return f"{last.kind}" + (f" ({last.reason})" if last.reason else "")


# --- one machine ------------------------------------------------------------------------------


def _detail(application: Any, name: str, output: Output) -> None:
    from sqlalchemy import select

    from provisioner.errors import UserError
    from provisioner.models import Event, Heartbeat, UsageInterval
    from provisioner.state import named_machine

    now = application.clock.now()
    with application.db.session() as s:
        m = named_machine(s, name)
        if m is None:
            raise UserError(f"no machine named {name!r} (see `provisioner status --all`)")
        replaces = {
            mid: (d or {}).get("replaces")
            for mid, d in s.execute(
                select(Event.machine_id, Event.detail).where(Event.kind == "recovered")
            )
        }
        chain = _chain(m.id, replaces)
        cost = _costs(s, UsageInterval.machine_id.in_(chain), now)
        events = list(
            s.scalars(select(Event).where(Event.machine_id.in_(chain)).order_by(Event.at, Event.id))
        )
        beat = s.scalars(
            select(Heartbeat).where(Heartbeat.machine_id == m.id).order_by(Heartbeat.id.desc())
        ).first()
    spent: dict[str, Any] = {}
    for per in cost.values():
        for c, a in per.items():
            spent[c] = spent.get(c, 0) + a
    idle = _idle_state(application, m, beat, now)
    nxt = _next_action(application, m, now)
    why = failure([e for e in events if e.machine_id == m.id]) if m.status == "failed" else None
    if output is Output.json:
        print_json(
            {
                **machine_json(m),
                "spec": m.spec,
                "spec_path": m.spec_path,
                "spent": [{"amount": amount(v), "currency": c} for c, v in sorted(spent.items())],
                "launches": len(chain),
                "idle": idle,
                "next": nxt,
                "kept_until": m.kept_until,
                "why": why,
                "events": [_event_json(e, m.name) for e in events],
            }
        )
        return
    res = (m.spec or {}).get("resources", {})
    lines = [
        (m.name, f"{m.status}  (project {m.project}, owner {m.owner})"),
        (
            "spec",
            f"{_gpu(res.get('gpu'))} {res.get('market', '')}, disk {res.get('disk_gb', '?')} GB"
            + (f", clouds {', '.join(res['clouds'])}" if res.get("clouds") else "")
            + (f"  ({m.spec_path})" if m.spec_path else ""),
        ),
    ]
    if m.cloud:
        lines.append(
            (
                "offer",
                f"{m.cloud} {m.zone or m.region}  {m.instance_type}  {m.gpu_count}×{m.gpu} "
                f"{m.market}",
            )
        )
        rate = f"{_money(m.rate, m.currency)}/h compute"
        if m.disk_rate is not None:
            rate += f" + {_money(m.disk_rate, m.currency)}/h disk"
        lines.append(("rate", rate + " (fixed at launch)"))
    total = " + ".join(_money(v, c) for c, v in sorted(spent.items())) or "nothing yet"
    if len(chain) > 1:
        total += f" across {plural(len(chain), 'launch', 'launches')} (relaunched after preemption)"
    lines.append(("spent", total))
    if m.instance_id:
        lines.append(("address", f"{m.public_ip or 'none'}, instance {m.instance_id}"))
    lines.append(("idle", idle["text"]))
    if nxt:
        lines.append(("next", nxt))
    if why:
        lines.append(("failed", why))
    w = max(len(k) for k, _ in lines)
    for k, v in lines:
        out.print(f"{k.ljust(w)}  {v}", highlight=False, markup=False, soft_wrap=True)
    out.print("events:", highlight=False, soft_wrap=True)
    write(_events_table([(e, m.name) for e in events], with_machine=False))


def _gpu(g: Any) -> str:
    if isinstance(g, dict):
        return f"{g.get('type')}:{g.get('count', 1)}" + (
            f" ({g['memory_gb']} GB)" if g.get("memory_gb") else ""
        )
    return str(g or "?")


def _idle_state(application: Any, m: Any, beat: Any, now: datetime) -> dict[str, Any]:
    from policies.duration import format_duration

    if m.status != "running":
        return {"signal": None, "text": f"{m.status}: no GPU activity expected"}
    if beat is None:
        if not application.settings.scheduler.endpoint_url:
            text = "no heartbeat: no agent (scheduler.endpoint_url is not set)"
        else:
            text = "no heartbeat yet from its agent"
        return {"signal": "unknown", "text": text}
    util = beat.max_util
    ago = format_duration(now - beat.at)
    text = (
        f"busiest GPU at {util:g}% {ago} ago"
        if util is not None
        else f"the agent saw no GPU {ago} ago"
    )
    return {"signal": util, "at": beat.at, "text": text}


def _next_action(application: Any, m: Any, now: datetime) -> str | None:
    if m.status not in ("running", "stopped") or not m.instance_id:
        return None
    from provisioner.jobs import outlook  # the policies and the sweep's rules: only here

    return outlook.outlook(application, [m], now).get(m.name)


def _summary(detail: dict[str, Any]) -> str:
    keys = ("why", "error", "where", "observed", "cloud_reason", "until", "instance_id")
    parts = [f"{detail[k]}" for k in keys if detail.get(k)]
    if not parts and detail.get("cloud"):
        parts.append(
            f"{detail['cloud']}/{detail.get('zone') or detail.get('region')} "
            f"{detail.get('instance_type', '')} {detail.get('market', '')}".strip()
        )
    return "; ".join(parts)


def _event_json(e: Any, name: str) -> dict[str, Any]:
    return {
        "machine": name,
        "machine_id": e.machine_id,
        "at": e.at,
        "event": e.kind,
        "reason": e.reason,
        "detail": e.detail or {},
    }


def _events_table(events: list[tuple[Any, str]], *, with_machine: bool = True) -> str:
    columns = [("time (UTC)", "<", 0), ("machine", "<", 0), ("event", "<", 0), ("reason", "<", 0)]
    columns.append(("detail", "<", 0))
    rows = [
        [f"{e.at:%Y-%m-%d %H:%M:%S}", name, e.kind, e.reason or "", _summary(e.detail or {})]
        for e, name in events
    ]
    if not with_machine:
        columns.pop(1)
        rows = [r[:1] + r[2:] for r in rows]
    return text_table(columns, rows, max_width=10_000)  # the detail runs on: never cut


@app.command()
def events(
    ctx: typer.Context,
    name: str = typer.Argument(None, help="only this machine (every launch of its name)"),
    last: int = typer.Option(50, "--last", "-n", min=1, help="how many of the latest events"),
    output: Output = OUTPUT,
) -> None:
    """What happened to machines, and why: each launch attempt, stop, start, preemption,
    relaunch and scheduler action, with its reason."""
    from sqlalchemy import select

    from provisioner.errors import UserError
    from provisioner.models import Event, Machine

    application = get_app(ctx)
    q = select(Event, Machine.name).join(Machine, Machine.id == Event.machine_id)
    if name:
        q = q.where(Machine.name == name)
    with application.db.session() as s:
        rows = list(s.execute(q.order_by(Event.at.desc(), Event.id.desc()).limit(last)))
        if (
            name
            and not rows
            and s.scalars(select(Machine.id).where(Machine.name == name)).first() is None
        ):
            raise UserError(f"no machine named {name!r} (see `provisioner status --all`)")
    rows.reverse()
    if output is Output.json:
        print_json([_event_json(e, n) for e, n in rows])
    elif not rows:
        out.print("no events", soft_wrap=True)
    else:
        write(_events_table([(e, n) for e, n in rows]))
