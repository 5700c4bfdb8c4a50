"""status (the fleet, or one machine in detail) and events: what each machine is, has cost,
and why it is as it is."""

from __future__ import annotations

from typing import Any

import typer

from provisioner.cli import (
    OUTPUT,
    Output,
    app,
    err,
    get_app,
    out,
    plural,
    print_json,
    text_table,
    write,
)
from provisioner.fleet import machine_json, show, unpriced_pieces
from provisioner.fleet import money_text as _money
from provisioner.schema import DELIVERY_DUE, UNDELIVERED


@app.command()
def status(
    ctx: typer.Context,
    name: str = typer.Argument(None, help="one machine, in detail", show_default=False),
    all_: bool = typer.Option(False, "--all", "-a", help="include terminated and failed machines"),
    refresh: bool = typer.Option(True, help="ask the clouds first (reconcile)"),
    summary: bool = typer.Option(
        False, "--summary", help="money burning now, counts, budgets, machines idle now"
    ),
    output: Output = OUTPUT,
) -> None:
    """Machines and their state, reconciled with what the clouds report, with what each has
    cost so far (compute and disk, at its launch-time rate, across relaunches). With a NAME:
    that machine in detail, with its next scheduled action and its events. With --summary:
    what the dashboard's fleet page opens with."""
    from provisioner import realclock
    from provisioner.views import status as views  # SQLAlchemy: not for --help

    application = get_app(ctx)
    note, may_refresh = realclock.status_clock(application)
    refresh = refresh and may_refresh
    if note:
        err.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
    if summary:
        _fleet_summary(application, refresh, output)
        return
    if name:
        _detail(application, name, refresh, output)
        return
    listed = views.status_list(application, all_=all_, refresh=refresh)
    show(listed.fleet, as_json=output is Output.json, all_=all_)
    for problem in listed.problems:
        err.print(f"[yellow]warning:[/] {problem}", soft_wrap=True)
    from provisioner import team

    if output is Output.table and (said := team.hint(application.db)):
        err.print(f"[yellow]hint:[/] {said}", soft_wrap=True, highlight=False)


def _fleet_summary(application: Any, refresh: bool, output: Output) -> None:
    from provisioner.clock import zoned
    from provisioner.views import status as views
    from provisioner.views.summary import summary

    if refresh:
        views.reconcile(application)
        views.jobs_ended(application)
    now = application.clock.now()
    sm = summary(application, now)
    if output is Output.json:
        print_json(sm.to_json())
        return
    per_hour = " + ".join(f"{_money(m.amount, m.currency)}/h" for m in sm.burning) or "nothing"
    if len(sm.burning) > 1:
        per_hour += f" (≈ {_money(sm.burning_total.amount, sm.burning_total.currency)}/h)"
    c = sm.counts
    zone = application.zone  # the team's, as the dashboard shows its times
    lines = [
        f"burning now: {per_hour}",
        f"machines: {c['running']} running ({c['idle']} idle now), {c['stopped']} stopped, "
        f"{c['preempted']} preempted, {c['held']} held, {c['waiting']} waiting",
    ]
    for b in sm.budgets:
        lines.append(
            f"budget {b.policy.name} {b.period.label}: spent {b.spent} of {b.amount} "
            f"({b.pct:.0f} %), committed {b.committed}"
            + (f", relaunches {b.relaunches}" if b.relaunches.amount else "")
            + f", forecast {b.forecast} "
            f"({b.forecast_pct:.0f} %)"
        )
    for i in sm.idle:
        lines.append(
            f"idle now: {i.machine.name} since {zoned(i.since, now, zone)}, "
            f"wasting {_money(i.rate.amount, i.rate.currency)}/h, "
            f"{_money(i.wasted.amount, i.wasted.currency)} so far"
        )
    for line in lines:
        out.print(line, highlight=False, markup=False, soft_wrap=True)


# --- one machine ------------------------------------------------------------------------------


def _detail(application: Any, name: str, refresh: bool, output: Output) -> None:
    from provisioner.errors import UserError
    from provisioner.views import status as views

    if refresh:
        views.reconcile(application)
        views.jobs_ended(application, [name])
    d = views.machine_detail(application, name)
    if d is None:
        raise UserError(f"no machine named {name!r} (see `provisioner status --all`)")
    if output is Output.json:
        print_json(_detail_json(d))
        return
    for k, v in _detail_lines(d):
        out.print(f"{k}  {v}", highlight=False, markup=False, soft_wrap=True)
    out.print("events:", highlight=False, soft_wrap=True)
    write(_events_table([(e, d.machine.name) for e in d.events], with_machine=False))


def _detail_json(d: Any) -> dict[str, Any]:
    m, idle = d.machine, d.idle
    return {
        **machine_json(m),
        "spec": m.spec,
        "spec_path": m.spec_path,
        "spent": [x.as_json() for x in d.spent],
        "launches": d.launches,
        "idle": {"signal": idle.signal, **({"at": idle.at} if idle.at else {}), "text": idle.text},
        "next": d.next,
        "kept_until": m.kept_until,
        "autostop": d.autostop,
        "why": d.why,
        "held": d.held,
        "volumes": [{**v.as_json(), "path": path} for path, v in d.volumes],
        "waiting": d.waiting,
        "jobs": [j.to_json() for j in d.jobs],
        "events": [_event_json(e, m.name) for e in d.events],
    }


def _detail_lines(d: Any) -> list[tuple[str, str]]:
    """``key  value`` lines, the keys padded to one width."""
    m = d.machine
    lines = [(m.name, f"{m.status}  (project {m.project}, owner {m.owner})"), _spec_line(d)]
    if m.cloud:
        lines += [("offer", _offer(m)), ("rate", _rate(m) + " (fixed at launch)")]
    lines.append(("spent", _spent(d)))
    if m.instance_id:
        lines.append(("address", f"{m.public_ip or 'none'}, instance {m.instance_id}"))
    lines.append(("idle", d.idle.text))
    lines += [("volume", _volume_text(path, v)) for path, v in d.volumes]
    lines += [(f"job {j.id}", j.text) for j in d.jobs]
    if d.autostop:
        lines.append(("autostop", d.autostop["text"]))
    extra = (("next", d.next), ("held", d.held), ("waiting", d.waiting), ("failed", d.why))
    lines += [(k, v) for k, v in extra if v]
    return _padded(lines)


def _padded(lines: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The keys padded to one width."""
    w = max(len(k) for k, _ in lines)
    return [(k.ljust(w), v) for k, v in lines]


def _offer(m: Any) -> str:
    offer = f"{m.cloud} {m.zone or m.region}  {m.instance_type}  {m.gpu_count}×{m.gpu}"
    return f"{offer} {m.market}"


def _spent(d: Any) -> str:
    """What the machine has cost, over every launch of it."""
    total = " + ".join(str(x) for x in d.spent) or "nothing yet"
    if d.launches > 1:
        total += f" across {plural(d.launches, 'launch', 'launches')} (relaunched after preemption)"
    return total


def _spec_line(d: Any) -> tuple[str, str]:
    """What the experiment asked for: GPU, market, disk, clouds, and its file."""
    m, res = d.machine, d.spec.get("resources", {})
    return (
        "spec",
        f"{_gpu(res.get('gpu'))} {res.get('market', '')}, disk {res.get('disk_gb', '?')} GB"
        + (f", clouds {', '.join(res['clouds'])}" if res.get("clouds") else "")
        + (f"  ({m.spec_path})" if m.spec_path else ""),
    )


def _rate(m: Any) -> str:
    """The machine's rates per hour, as fixed at launch: compute, disk, public address."""
    rate = f"{_money(m.rate, m.currency)}/h compute"
    if m.disk_rate is not None:
        rate += f" + {_money(m.disk_rate, m.currency)}/h disk"
    if m.address_rate is not None:
        rate += f" + {m.address_rate.normalize():f} {m.currency}/h public IPv4"
    for piece in unpriced_pieces(m):  # billed by the cloud at a rate not known here
        rate += f" + {piece} not priced"
    return rate


def _volume_text(path: str, v: Any) -> str:
    vol = v.volume
    return (
        f"{vol.name} at {path}: {vol.size_gb} GB in {vol.cloud} {vol.zone or vol.region}, "
        f"{v.status}" + (f" ({v.attached_to})" if v.attached_to else "")
    )


def _gpu(g: Any) -> str:
    if isinstance(g, dict):
        return f"{g.get('type')}:{g.get('count', 1)}" + (
            f" ({g['memory_gb']} GB)" if g.get("memory_gb") else ""
        )
    return str(g or "?")


def _summary(detail: dict[str, Any]) -> str:
    keys = ("why", "error", "where", "observed", "cloud_reason", "until", "instance_id")
    parts = [f"{detail[k]}" for k in keys if detail.get(k)]
    if not parts and detail.get("job"):  # job-started, job-finished
        if "exit_code" in detail:
            parts.append(f"job {detail['job']}: exit code {detail['exit_code']}")
        else:
            parts.append(
                f"job {detail['job']}: {' '.join(str(detail.get('command')).split())[:60]}"
            )
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
        "actor": getattr(e, "actor", None),
        "detail": e.detail or {},
    }


def _events_table(events: list[tuple[Any, str]], *, with_machine: bool = True) -> str:
    columns = [("time (UTC)", "<", 0), ("machine", "<", 0), ("event", "<", 0), ("reason", "<", 0)]
    columns += [("by", "<", 0), ("detail", "<", 0)]
    rows = [
        [
            f"{e.at:%Y-%m-%d %H:%M:%S}",
            name,
            e.kind,
            e.reason or "",
            getattr(e, "actor", None) or "",
            _summary(e.detail or {}),
        ]
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
    notices: bool = typer.Option(
        False,
        "--notices",
        help="the notices to Telegram, Slack, webhooks and mail, and how each went",
    ),
    output: Output = OUTPUT,
) -> None:
    """What happened to machines, and why: each launch attempt, stop, start, preemption,
    relaunch and scheduler action, with its reason. ``--notices``: each notice delivered,
    retrying or failed, with the reason."""
    from sqlalchemy import select

    from provisioner.errors import UserError
    from provisioner.models import Event, Machine

    application = get_app(ctx)
    if notices:
        return _notices(application, last, output)
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
    if output is not Output.json and not name:
        _undelivered(application)


def _delivery_json(d: Any) -> dict[str, Any]:
    return {
        "at": d.at,
        "topic": d.topic,
        "channel": d.kind,
        "target": d.target,
        "subject": d.subject,
        "policy": d.policy,
        "machine": d.machine,
        "status": d.status,
        "attempts": d.attempts,
        "next_try": d.next_at if d.status in DELIVERY_DUE else None,
        "error": d.error,
    }


def _notices(application: Any, last: int, output: Output) -> None:
    from provisioner import notify

    rows = list(reversed(notify.recent(application, last)))
    if output is Output.json:
        print_json([_delivery_json(d) for d in rows])
        return
    if not rows:
        out.print("no notices", soft_wrap=True)
        return
    columns = [
        (h, "<", 0)
        for h in ("time (UTC)", "notice", "channel", "to", "status", "tries", "subject / error")
    ]
    table = [
        [
            f"{d.at:%Y-%m-%d %H:%M:%S}",
            d.topic,
            d.kind,
            d.target,
            d.status,
            str(d.attempts),
            d.subject + (f" — {d.error}" if d.error else ""),
        ]
        for d in rows
    ]
    write(text_table(columns, table, max_width=10_000))


def _undelivered(application: Any) -> None:
    """One line under the events when notices are failing: nothing fails unseen."""
    from sqlalchemy import func, select

    from provisioner.models import Delivery

    with application.db.session() as s:
        counts = dict(
            s.execute(
                select(Delivery.status, func.count())
                .where(Delivery.status.in_(UNDELIVERED))
                .group_by(Delivery.status)
            ).all()
        )
    if counts:
        said = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        out.print(f"notices: {said} (see `provisioner events --notices`)", soft_wrap=True)
