"""keep, sweep, scheduler run, agent."""

from __future__ import annotations

import logging

import typer

from provisioner.cli import OUTPUT, Output, app, err, get_app, out, print_json

scheduler_app = typer.Typer(help="The scheduler daemon: sweeps, recovery, heartbeats, metrics.")
app.add_typer(scheduler_app, name="scheduler")


@app.command()
def keep(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="machine name"),
    until: str = typer.Option(
        ..., "--until", help="HH:MM in the machine's policy timezone, or an ISO date-time"
    ),
    output: Output = OUTPUT,
) -> None:
    """Keep a machine running: the sweep leaves it alone until then."""
    from provisioner.jobs import sweep  # SQLAlchemy and the policies: not for --help

    m = sweep.keep(get_app(ctx), name, until)
    if output is Output.json:
        print_json({"machine": m.name, "kept_until": m.kept_until})
    else:
        out.print(f"{m.name} is kept until {m.kept_until:%Y-%m-%d %H:%M} UTC")


@app.command()
def sweep(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="say what would be done, do nothing"),
    output: Output = OUTPUT,
) -> None:
    """One scheduler pass, for cron, systemd timers and Kubernetes CronJobs: stop idle machines
    out of hours and those past their lifetime, relaunch preempted ones (and enforce budgets)."""
    from provisioner.jobs import daemon, recover  # SQLAlchemy and the policies: not for --help
    from provisioner.jobs import sweep as sweeping  # as above
    from provisioner.jobs.passes import describe  # as above

    application = get_app(ctx)
    passes = [
        sweeping.run(application, dry_run=dry_run),
        recover.run(application, dry_run=dry_run),
    ]
    extra = []
    if not dry_run:
        for name, call in daemon.housekeeping(application):  # budgets, scheduled reports
            extra.append((name, call()))
    if output is Output.json:
        print_json(
            {
                "passes": [p.as_json() for p in passes],
                "other": {n: describe(r) for n, r in extra},
            }
        )
        return
    for p in passes:
        lines = describe(p)
        head = f"{p.job}: {p.checked} machines checked" if p.leader else p.job
        out.print(f"[bold]{head}[/]" + (" (dry run)" if dry_run else ""), highlight=False)
        for line in lines or ["nothing to do"]:
            out.print(f"  {line}", highlight=False, markup=False)
    for name, r in extra:
        for line in describe(r):
            out.print(f"{name}: {line}", highlight=False, markup=False)
    if any(a.error for p in passes for a in p.actions):
        raise typer.Exit(1)


@scheduler_app.command("run")
def run(ctx: typer.Context) -> None:
    """Run sweep, recover and reconcile on their intervals and serve heartbeats, /metrics and
    /healthz on `scheduler.listen`, until stopped."""
    from provisioner.jobs import daemon  # SQLAlchemy, the policies, APScheduler: not for --help
    from provisioner.jobs.lease import HOLDER  # as above

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    application = get_app(ctx)
    err.print(f"scheduler {HOLDER} listening on {application.settings.scheduler.listen}")
    daemon.run(application)


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
