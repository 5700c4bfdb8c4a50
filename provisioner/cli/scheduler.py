"""keep, autostop, sweep, scheduler run, agent."""

from __future__ import annotations

import logging
from typing import Any

import typer

from policies.duration import format_duration
from provisioner.cli import OUTPUT, Output, app, err, get_app, out, plural, print_json
from provisioner.schema import MachineStatus as S

scheduler_app = typer.Typer(help="The scheduler daemon: sweeps, recovery, heartbeats, metrics.")
app.add_typer(scheduler_app, name="scheduler")


@app.command()
def keep(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="machine name"),
    until: str = typer.Option(
        None, "--until", help="HH:MM in the machine's policy time zone, or an ISO date-time"
    ),
    cancel: bool = typer.Option(False, "--cancel", help="stop keeping it: the sweep judges it"),
    output: Output = OUTPUT,
) -> None:
    """Keep a running machine running: the sweep leaves it alone until then. Times are read
    and shown in the time zone of the machine's policy (this computer's without one)."""
    from provisioner.errors import UserError
    from provisioner.jobs import sweep  # SQLAlchemy and the policies: not for --help

    if (until is None) == (not cancel):
        raise UserError("give --until HH:MM (or an ISO date-time), or --cancel")
    application = get_app(ctx)
    if cancel:
        m, was = sweep.unkeep(application, name)
        if output is Output.json:
            print_json({"machine": m.name, "kept_until": None, "was_kept": was})
        else:
            out.print(
                f"{m.name} is no longer kept; the next sweep judges it by its rules"
                if was
                else f"{m.name} was not kept; nothing changed",
                highlight=False,
                soft_wrap=True,
            )
        return
    m = sweep.keep(application, name, until)
    tz = sweep.keep_timezone(application, m)
    assert m.kept_until is not None  # keep() sets it
    local = m.kept_until.astimezone(tz)
    if output is Output.json:
        print_json(
            {"machine": m.name, "kept_until": m.kept_until, "local": local, "timezone": str(tz)}
        )
    else:
        left = format_duration(m.kept_until - application.clock.now())
        out.print(
            f"{m.name} is kept until {local:%Y-%m-%d %H:%M} {tz} ({m.kept_until:%H:%M} UTC, in "
            f"{left}); undo with `provisioner keep {m.name} --cancel`",
            highlight=False,
            soft_wrap=True,
        )


@app.command()
def autostop(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="machine name"),
    duration: str = typer.Argument(None, help="e.g. 30m, 2h (1 min to 7 days)"),
    cancel: bool = typer.Option(False, "--cancel", help="clear the machine's own autostop"),
    output: Output = OUTPUT,
) -> None:
    """Stop a machine once its GPUs were idle, no job ran and no SSH session was open for
    DURATION, at any hour (a policy's max_autostop caps it). Without DURATION: show it."""
    from provisioner import machines
    from provisioner.errors import UserError
    from provisioner.jobs import autostop as auto  # SQLAlchemy and the policies: not for --help

    if duration is not None and cancel:
        raise UserError("give a duration (e.g. 30m) or --cancel, not both")
    application = get_app(ctx)
    if cancel:
        m, st, had = auto.cancel_autostop(application, name)
        said = f"{m.name}: its autostop is cancelled" if had else f"{m.name} had no autostop"
    elif duration is not None:
        m, st = auto.set_autostop(application, name, duration)
        said = f"{m.name}: autostop set"
    else:
        m = machines.find(application, name)
        st, said = auto.setting(application.policies, m), m.name
    if cancel or duration is not None:  # the machine enforces it itself: tell it
        untold = auto.tell_machine(application, m, st)
        said += f" ({untold})" if untold else ""
    view = auto.show(application, m, st)
    if output is Output.json:
        print_json({"machine": m.name, **view})
        return
    out.print(f"{said}; autostop: {view['text']}", highlight=False, soft_wrap=True)


@app.command()
def sweep(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="say what would be done, do nothing"),
    output: Output = OUTPUT,
) -> None:
    """The whole scheduler, once, for cron, systemd timers and Kubernetes CronJobs — what
    `scheduler run` does on its intervals: reconcile with the clouds (jobs that ended and their
    on_finish), stop idle machines out of hours, on autostop and past their lifetime, relaunch
    preempted ones, try intents waiting for capacity, enforce budgets, send notices."""
    from provisioner import identity  # as above
    from provisioner.jobs import cycle  # SQLAlchemy and the policies: not for --help

    application = get_app(ctx)
    application.actor = identity.SCHEDULER  # what the passes do is the scheduler's doing
    results = cycle.once(application, dry_run=dry_run)
    reconciled, passes, skipped, extra = _split(results, dry_run)
    # a dry run also says why the sweep leaves each other machine alone, and until when
    waiting = _not_due(application, passes) if dry_run else {}
    acted = ([reconciled] if reconciled else []) + passes
    if output is Output.json:
        print_json(_sweep_json(application, reconciled, passes, waiting, (extra, skipped), dry_run))
        return
    _print_sweep(acted, waiting, extra, skipped, dry_run)
    if any(a.error for p in acted for a in p.actions):
        raise typer.Exit(1)


def _split(
    results: list[tuple[str, Any]], dry_run: bool
) -> tuple[Any, list[Any], dict[str, str], list[tuple[str, Any]]]:
    """A cycle's results sorted out: the reconcile pass (or None), the other passes, the jobs
    a dry run skipped (name: why) and the other jobs' results."""
    from provisioner.jobs.passes import Pass  # as above

    reconciled, passes, skipped, extra = None, [], {}, []
    for n, r in results:
        if isinstance(r, Pass):
            if n == "reconcile":
                reconciled = r
            else:
                passes.append(r)
        elif dry_run and isinstance(r, str):
            skipped[n] = r  # why
        else:
            extra.append((n, r))
    return reconciled, passes, skipped, extra


def _sweep_json(
    application: Any,
    reconciled: Any,
    passes: list[Any],
    waiting: dict[str, str],
    others: tuple[list[tuple[str, Any]], dict[str, str]],
    dry_run: bool,
) -> dict[str, Any]:
    """What `sweep --output json` prints: each pass, what is not due, the other jobs'
    results and (a dry run) each machine's next move and the jobs not run."""
    from provisioner.jobs.passes import describe  # as above

    extra, skipped = others
    return {
        "reconcile": reconciled.as_json() if reconciled else None,
        "passes": [p.as_json() for p in passes],
        "not_due": waiting,
        **({"next": _next_moves(application)} if dry_run else {}),
        "other": {n: describe(r) for n, r in extra},
        **({"skipped": skipped} if dry_run else {}),
    }


def _print_sweep(
    acted: list[Any],
    waiting: dict[str, str],
    extra: list[tuple[str, Any]],
    skipped: dict[str, str],
    dry_run: bool,
) -> None:
    """What `sweep` did, as text: each pass (reconcile first) with its lines, then the other
    jobs' lines, then what a dry run did not run."""
    from provisioner.jobs.passes import describe  # as above

    for p in acted:
        _print_pass(p, waiting if p.job == "sweep" else {}, dry_run)
    for name, r in extra:
        for line in describe(r):
            out.print(f"{name}: {line}", highlight=False, markup=False, soft_wrap=True)
    if skipped:
        out.print(
            f"not in a dry run (they record or act): {', '.join(skipped)}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


def _print_pass(p: Any, waiting: dict[str, str], dry_run: bool) -> None:
    """A pass: a head (how many machines it checked), then its lines and ``waiting``'s."""
    from provisioner.jobs.passes import describe  # as above

    lines = describe(p) + [f"{n}: {why}" for n, why in waiting.items()]
    head = f"{p.job}: {plural(p.checked, 'machine')} checked" if p.leader else p.job
    out.print(
        f"[bold]{head}[/]" + (" (dry run)" if dry_run else ""),
        highlight=False,
        soft_wrap=True,
    )
    for line in lines or ["nothing to do"]:
        out.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)


def _not_due(application: Any, passes: list[Any]) -> dict[str, str]:
    """Each machine the sweep checked and left alone: why, and when that may change (none when
    this process did not lead the sweep)."""
    from sqlalchemy import select

    from provisioner.jobs import outlook
    from provisioner.models import Machine

    p = next((p for p in passes if p.job == "sweep"), None)
    if p is None or not p.leader:
        return {}
    acted = {a.machine for a in p.actions}
    with application.db.session() as s:
        machines = [
            m
            for m in s.scalars(
                select(Machine)
                .where(Machine.status.in_((S.RUNNING, S.STOPPED)), Machine.instance_id.is_not(None))
                .order_by(Machine.name)
            )
            if m.name not in acted
        ]
    return outlook.outlook(application, machines)


def _next_moves(application: Any) -> dict[str, Any]:
    """Each live machine's next move: the decision the dashboard shows."""
    from provisioner.jobs import outlook
    from provisioner.state import live_machines

    with application.db.session() as s:
        live = live_machines(s)
    moves = outlook.next_moves(application, live, application.clock.now())
    return {name: move.to_json() for name, move in sorted(moves.items())}


@scheduler_app.command("run")
def run(ctx: typer.Context) -> None:
    """Run sweep, recover and reconcile on their intervals and serve heartbeats, /metrics,
    /healthz and the team dashboard on `scheduler.listen`, until stopped."""
    from provisioner import identity  # as above
    from provisioner.dashboard import make_app  # as below
    from provisioner.jobs import daemon  # SQLAlchemy, the policies, APScheduler: not for --help
    from provisioner.jobs.lease import HOLDER  # as above

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # APScheduler says "Running job…" and "executed successfully" on every tick: only its
    # warnings (a missed or overlapping run) are news; the jobs log their own actions
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # a migration's plugin roll call
    application = get_app(ctx)
    application.actor = identity.SCHEDULER  # what the passes do is the scheduler's doing
    err.print(
        f"scheduler {HOLDER} listening on {application.settings.scheduler.listen}", soft_wrap=True
    )
    # the dashboard beside the endpoint: open on loopback, behind dashboard.token beyond it
    dashboard = make_app(application, listen=application.settings.scheduler.listen).warm()
    daemon.run(application, apps={"/": dashboard}, config=(ctx.find_root().obj or {}).get("config"))


@app.command()
def agent(
    endpoint: str = typer.Option(..., "--endpoint", help="the scheduler's URL"),
    machine: str = typer.Option(..., "--machine", help="this machine's id in the scheduler"),
    token_file: str = typer.Option(..., "--token-file", help="file holding this machine's token"),
    interval: float = typer.Option(30.0, "--interval", help="seconds between heartbeats"),
) -> None:
    """On a machine: post GPU utilisation heartbeats to the scheduler (never stops on errors)."""
    from provisioner import agent as agent_mod  # urllib: only for this command

    agent_mod.run(endpoint, machine, token_file, interval)
