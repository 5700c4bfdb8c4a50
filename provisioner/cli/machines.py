"""plan, up, status, stop, start, down."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import typer
from rich.table import Table

from provisioner.cli import OUTPUT, Output, app, err, get_app, out, print_json
from provisioner.money import Money


def _money(amount: Any, currency: str | None) -> str:
    return str(Money(amount, currency)) if amount is not None and currency else "—"


def candidate_json(c: Any) -> dict[str, Any]:
    o = c.offer
    return {
        "cloud": o.cloud,
        "region": o.region,
        "zone": o.zone,
        "instance_type": o.instance_type,
        "gpu": o.gpu,
        "gpu_count": o.gpu_count,
        "gpu_memory_gb": o.gpu_memory_gb,
        "vcpus": o.vcpus,
        "memory_gb": str(o.memory_gb),
        "market": c.market,
        "price_per_hour": {"amount": str(c.price.amount), "currency": c.price.currency},
        "price_per_hour_base": {
            "amount": str(c.price_base.amount),
            "currency": c.price_base.currency,
        },
        "source": o.source,
    }


def machine_json(m: Any) -> dict[str, Any]:
    return {
        "name": m.name,
        "id": m.id,
        "status": m.status,
        "project": m.project,
        "owner": m.owner,
        "cloud": m.cloud,
        "region": m.region,
        "zone": m.zone,
        "instance_type": m.instance_type,
        "gpu": m.gpu,
        "gpu_count": m.gpu_count,
        "market": m.market,
        "instance_id": m.instance_id,
        "public_ip": m.public_ip,
        "rate_per_hour": {"amount": str(m.rate), "currency": m.currency}
        if m.rate is not None
        else None,
        "disk_rate_per_hour": {"amount": str(m.disk_rate), "currency": m.currency}
        if m.disk_rate is not None
        else None,
        "created_at": m.created_at,
        "launched_at": m.launched_at,
        "terminated_at": m.terminated_at,
    }


@app.command()
def plan(
    ctx: typer.Context,
    spec: str = typer.Argument(..., help="experiment file"),
    top: int = typer.Option(10, help="how many candidates to show"),
    output: Output = OUTPUT,
) -> None:
    """Rank the offers an experiment may use, with why the others were turned down. Needs no
    credentials and launches nothing."""
    from provisioner import planning  # policies and the catalog: not for --help
    from provisioner.spec import load_experiment  # pydantic: not for --help

    experiment = load_experiment(spec)
    p = planning.plan(get_app(ctx), experiment)
    if output is Output.json:
        print_json(
            {
                "experiment": experiment.name,
                "gpu": str(experiment.resources.gpu),
                "market": experiment.resources.market,
                "currency": p.currency,
                "rates": p.rates,
                "candidates": [candidate_json(c) for c in p.candidates[:top]],
                "candidate_count": len(p.candidates),
                "unpriced": [
                    {
                        "cloud": o.cloud,
                        "zone": o.zone or o.region,
                        "instance_type": o.instance_type,
                        "source": o.source,
                    }
                    for o in p.unpriced
                ],
                "rejected": dict(p.rejected),
                "rejected_examples": p.examples,
                "checks": [getattr(c, "as_json", lambda c=c: c)() for c in p.checks],
            }
        )
        return
    t = Table(
        title=f"{experiment.name}: {experiment.resources.gpu} {experiment.resources.market}"
        f" — {len(p.candidates)} candidates, cheapest first"
    )
    for col in (
        "#",
        "cloud",
        "region / zone",
        "type",
        "GPUs",
        "vCPU",
        "RAM GB",
        "market",
        "price/h",
        f"in {p.currency}",
    ):
        t.add_column(
            col,
            justify="right"
            if col in ("#", "GPUs", "vCPU", "RAM GB", "price/h", f"in {p.currency}")
            else "left",
        )
    for i, c in enumerate(p.candidates[:top], 1):
        o = c.offer
        t.add_row(
            str(i),
            o.cloud,
            o.zone or o.region,
            o.instance_type,
            f"{o.gpu_count}×{o.gpu}",
            str(o.vcpus),
            str(o.memory_gb),
            c.market,
            str(c.price),
            f"{c.price_base.amount:,.2f}",
        )
    out.print(t)
    if p.candidates:
        clouds = sorted({c.offer.cloud for c in p.candidates})
        best = {cl: next(c for c in p.candidates if c.offer.cloud == cl) for cl in clouds}
        out.print(
            "cheapest per cloud: "
            + ", ".join(
                f"{cl} {b.price_base.amount:,.2f} {p.currency}"
                for cl, b in sorted(best.items(), key=lambda kv: kv[1].price_base.amount)
            )
        )
    if p.rates:
        out.print(f"[dim]ranked in {p.currency}; {p.rates}[/]")
    for cloud in sorted({o.cloud for o in p.unpriced}):
        types = sorted({o.instance_type for o in p.unpriced if o.cloud == cloud})
        out.print(
            f"[yellow]{cloud}[/]: {', '.join(types)} fit but have no public price, so they are not "
            f"ranked; set prices.{cloud}.<type> in settings to include them"
        )
    for check in p.checks:
        out.print(str(check))
    if p.rejected:
        out.print(
            "[bold]turned down[/]: "
            + "; ".join(
                f"{reason}: {n} (e.g. {p.examples[reason]})" for reason, n in p.summary_reasons()
            )
        )


@app.command()
def up(
    ctx: typer.Context,
    spec: str = typer.Argument(..., help="experiment file"),
    wait: bool = typer.Option(True, help="wait until the machine runs and answers SSH"),
    wait_timeout: float = typer.Option(600, min=1, help="seconds to wait at most"),
    output: Output = OUTPUT,
) -> None:
    """Launch the cheapest allowed offer, failing over across zones, regions and clouds, and
    wait until it is ready to use."""
    from provisioner import lifecycle  # SQLAlchemy: not for --help
    from provisioner.spec import load_experiment  # pydantic: not for --help

    experiment = load_experiment(spec)
    application = get_app(ctx)
    quiet = output is Output.json
    with err.status(f"launching {experiment.name}…") if not quiet else nullcontext():
        result = lifecycle.up(
            application,
            experiment,
            spec_path=spec,
            progress=(lambda msg: None) if quiet else (lambda msg: err.print(msg, highlight=False)),
        )
    m = result.machine
    if wait and m.status in ("pending", "running"):
        with err.status(f"waiting for {m.name}…") if not quiet else nullcontext():
            m = lifecycle.wait_ready(
                application,
                m.name,
                timeout=wait_timeout,
                progress=(lambda msg: None)
                if quiet
                else (lambda msg: err.print(msg, highlight=False)),
            )
    if quiet:
        print_json(
            {
                "already": result.already,
                "machine": machine_json(m),
                "attempts": [a.__dict__ for a in result.attempts],
            }
        )
        return
    if result.already:
        out.print(f"{m.name} already exists ({m.status} on {m.cloud or '—'}); nothing launched.")
        return
    out.print(
        f"[green]launched[/] {m.name} on {m.cloud} {m.zone or m.region}: {m.instance_type} "
        f"({m.gpu_count}×{m.gpu}, {m.market}) at {_money(m.rate, m.currency)}/h"
    )
    if m.disk_rate is not None:
        out.print(f"  disk {m.disk_gb} GB: {_money(m.disk_rate, m.currency)}/h while it exists")
    out.print(f"  instance {m.instance_id}" + (f", address {m.public_ip}" if m.public_ip else ""))
    out.print(f"  connect with `provisioner ssh {m.name}`")
    out.print(
        f"  stop it with `provisioner stop {m.name}`, remove it with `provisioner down {m.name}`"
    )


@app.command()
def ssh(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="machine name"),
    command: list[str] = typer.Argument(None, help="a command to run there (after --)"),
) -> None:
    """Log in on a machine (or run a command there) as its cloud's user, at its address.

    Runs OpenSSH's `ssh` — $PROVISIONER_SSH_COMMAND instead when set (e.g. "ssh -i KEY -p
    2222", like GIT_SSH_COMMAND) — so keys come from your agent or ~/.ssh/config."""
    import os
    import shlex

    from provisioner import lifecycle  # SQLAlchemy: not for --help
    from provisioner.errors import UserError

    application = get_app(ctx)
    m = lifecycle.find(application, name)
    if m.status != "running" or not m.public_ip:
        hint = f"`provisioner start {m.name}`" if m.status == "stopped" else "`provisioner status`"
        raise UserError(f"{m.name} is {m.status} with no address to connect to (see {hint})")
    user = application.provider(m.cloud).ssh_user
    argv = [
        *shlex.split(os.environ.get("PROVISIONER_SSH_COMMAND") or "ssh"),
        "-o",
        "StrictHostKeyChecking=accept-new",
        f"{user}@{m.public_ip}",
        *(command or []),
    ]
    sys.stdout.flush()
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        raise UserError(
            f"cannot run {argv[0]}: {e.strerror} (is the OpenSSH client installed?)"
        ) from None


@app.command()
def status(
    ctx: typer.Context,
    all_: bool = typer.Option(False, "--all", "-a", help="include terminated and failed machines"),
    refresh: bool = typer.Option(True, help="ask the clouds first (reconcile)"),
    output: Output = OUTPUT,
) -> None:
    """Machines and their state, reconciled with what the clouds report, with what each has
    cost so far (compute and disk, at its launch-time rate)."""
    from sqlalchemy import select

    from provisioner import idle, ledger, lifecycle  # SQLAlchemy: not for --help
    from provisioner.models import Machine  # as above

    application = get_app(ctx)
    problems = []
    if refresh:
        problems = [o for o in lifecycle.reconcile(application) if o.error]
    now = application.clock.now()
    with application.db.session() as s:
        q = select(Machine).order_by(Machine.created_at)
        if not all_:
            q = q.where(Machine.status.not_in(("terminated", "failed")))
        machines = list(s.scalars(q))
        spent = {m.id: ledger.machine_spend(s, m, m.created_at, now) for m in machines}
    grace = timedelta(seconds=application.settings.scheduler.heartbeat_grace_seconds)
    unseen = idle.gpus_not_seen(application, now - grace) if machines else {}
    unseen.update(lifecycle.notes(application, machines))  # e.g. a relaunch refused
    if output is Output.json:
        print_json(
            [
                {
                    **machine_json(m),
                    "spent": [
                        {"amount": str(v.amount), "currency": c} for c, v in spent[m.id].items()
                    ],
                    "problem": unseen.get(m.name),
                }
                for m in machines
            ]
        )
        return
    if not machines:
        out.print("no machines" + ("" if all_ else " (use --all to include terminated ones)"))
    else:
        t = Table(title="machines")
        for col in (
            "name",
            "status",
            "cloud",
            "zone",
            "type",
            "GPUs",
            "market",
            "price/h",
            "spent",
            "address",
        ):
            t.add_column(col)
        for m in machines:
            t.add_row(
                m.name,
                m.status,
                m.cloud or "—",
                m.zone or m.region or "—",
                m.instance_type or "—",
                f"{m.gpu_count}×{m.gpu}" if m.gpu else "—",
                m.market or "—",
                _money(m.rate, m.currency),
                " + ".join(str(v) for v in spent[m.id].values()) or "—",
                m.public_ip or "—",
            )
        out.print(t)
    for name, problem in unseen.items():
        err.print(f"[yellow]warning:[/] {name}: {problem}", highlight=False)
    for o in problems:
        err.print(
            f"[yellow]warning:[/] could not ask {o.machine.cloud} about {o.machine.name}: {o.error}"
        )


def _simple(verb: str, fn_name: str, done: str, same: str) -> None:
    def command(
        ctx: typer.Context,
        name: str = typer.Argument(..., help="machine name"),
        output: Output = OUTPUT,
    ) -> None:
        from provisioner import lifecycle  # SQLAlchemy: not for --help

        m, changed = getattr(lifecycle, fn_name)(get_app(ctx), name)
        if output is Output.json:
            print_json({"changed": changed, "machine": machine_json(m)})
        else:
            out.print(f"{m.name} {done if changed else same}")

    command.__doc__ = verb
    app.command(fn_name)(command)


_simple(
    "Stop a machine: compute billing ends, the disk is kept.",
    "stop",
    "stopped",
    "was already stopped",
)
_simple("Start a stopped machine.", "start", "started", "is already running")
_simple(
    "Terminate a machine and everything it bills for.", "down", "terminated", "was already gone"
)


@app.command()
def gc(
    ctx: typer.Context,
    cloud: list[str] = typer.Option(
        None, "--cloud", help="only these clouds (default: all enabled)"
    ),
    terminate: bool = typer.Option(False, "--terminate", help="terminate what is found"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask before terminating"),
    output: Output = OUTPUT,
) -> None:
    """Machines carrying our tag that the state does not know (they bill, unseen), and network
    pieces of ours no machine uses. Lists them; --terminate removes them, after confirmation
    for machines."""
    from provisioner import lifecycle  # SQLAlchemy: not for --help

    application = get_app(ctx)
    found, errors = lifecycle.orphans(application, cloud or None)
    done: list[Any] = []
    if terminate and found:
        doomed = [o for o in found if not o.adoptable_by]
        if doomed and not yes and not typer.confirm(f"terminate {len(doomed)} machine(s)?"):
            raise typer.Abort()
        done = lifecycle.collect(application, found)
    network = lifecycle.unused_network(application, cloud or None, errors, remove=terminate)
    if output is Output.json:
        print_json(
            {
                "orphans": [
                    {
                        "cloud": o.cloud,
                        "id": o.instance.id,
                        "name": o.instance.name,
                        "region": o.instance.region,
                        "zone": o.instance.zone,
                        "state": o.instance.state.value,
                        "adoptable_by": o.adoptable_by,
                    }
                    for o in found
                ],
                "terminated": [o.instance.id for o in done],
                "unused_network": network,
                "network_removed": terminate,
                "not_asked": errors,
            }
        )
        return
    for o in found:
        out.print(("[red]terminated[/] " if o in done else "") + str(o), highlight=False)
    if not found:
        out.print("no orphans")
    for cl, pieces in network.items():
        for piece in pieces:
            out.print(f"{'[red]removed[/] ' if terminate else 'unused: '}{cl} {piece}")
    for c, why in errors.items():
        err.print(f"[yellow]{c}[/]: not asked: {why.removeprefix(f'{c}: ')}", highlight=False)
