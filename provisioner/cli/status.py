"""status (the fleet, or one machine in detail) and events: what each machine is, has cost,
and why it is as it is."""

from __future__ import annotations

from datetime import datetime, timedelta
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
from provisioner.fleet import (
    Fleet,
    Sql,
    costs_of,
    failure,
    launches,
    machine_json,
    read,
    show,
)
from provisioner.fleet import money_text as _money
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
        show(Fleet([], {}), as_json=output is Output.json, all_=all_)
        return
    if name:
        if refresh:
            _reconcile(application)
        _detail(application, name, output)
        return
    fleet = _fleet(application, all_)
    problems = []
    asked = {m.id for m in fleet.rows if m.status not in ("requested", *ACTIVE_EXCLUDED)}
    if refresh and asked:
        observed = _reconcile(application)
        problems = [o for o in observed if o.error]
        if _moved(fleet.rows, asked, observed):
            fleet = _fleet(application, all_)
    show(fleet, as_json=output is Output.json, all_=all_)
    for o in problems:
        err.print(
            f"[yellow]warning:[/] could not ask {o.machine.cloud} about {o.machine.name}: "
            f"{o.error}",
            soft_wrap=True,
        )


def _moved(rows: list[Any], asked: set[str], observed: list[Any]) -> bool:
    """Whether asking the clouds moved a row shown (its status or address), or saw other
    machines than those read: only then are the rows read again."""
    read = {m.id: (m.status, m.public_ip) for m in rows}
    return {o.machine.id for o in observed} != asked or any(
        o.changed or read.get(o.machine.id) != (o.machine.status, o.machine.public_ip)
        for o in observed
    )


def _reconcile(application: Any) -> list[Any]:
    from provisioner import machines  # the providers and planning: only when asking the clouds

    return machines.reconcile(application)


def _fleet(application: Any, all_: bool) -> Fleet:
    """The fleet as listed (:func:`provisioner.fleet.read`), on the session's connection."""
    now = application.clock.now()
    grace = timedelta(seconds=application.settings.scheduler.heartbeat_grace_seconds)
    with application.db.session() as s:
        return read(Sql.on(s), all_=all_, now=now, seen_since=now - grace)


# --- one machine ------------------------------------------------------------------------------


def _detail(application: Any, name: str, output: Output) -> None:
    from sqlalchemy import select

    from provisioner.errors import UserError
    from provisioner.models import Event, Heartbeat
    from provisioner.state import named_machine

    now = application.clock.now()
    with application.db.session() as s:
        m = named_machine(s, name)
        if m is None:
            raise UserError(f"no machine named {name!r} (see `provisioner status --all`)")
        sql = Sql.on(s)
        chain = launches(sql, [m.id])[m.id]
        cost = costs_of(sql, chain, now)
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
