"""plan, up, status, stop, start, down."""

from __future__ import annotations

import sys
from enum import StrEnum
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
from provisioner.fleet import machine_json
from provisioner.schema import MachineStatus as S


class FileFormat(StrEnum):
    auto = "auto"
    experiment = "experiment"
    skypilot = "skypilot"


FORMAT = typer.Option(
    FileFormat.auto,
    "--format",
    help="the file's kind: auto tells a SkyPilot task file by its keys (docs/SKYPILOT.md)",
)
ENV = typer.Option(
    None,
    "--env",
    help="KEY=VALUE for the job's environment, over the file's (KEY alone: your own value); "
    "repeat for more",
    show_default=False,
)
GPUS = typer.Option(
    None, "--gpus", help="a SkyPilot task's accelerators instead of the file's (A100:8)"
)
CLOUD = typer.Option(None, "--cloud", help="a SkyPilot task's cloud instead of the file's")


def _load(
    ctx: typer.Context, spec: str, fmt: FileFormat, env: list[str] | None, gpus: Any, cloud: Any
) -> tuple[Any, Any]:
    """The experiment in ``spec`` (an experiment file or a SkyPilot task file), what the
    translation of a task file noted printed on stderr."""
    from provisioner import skypilot  # pydantic: not for --help

    application = get_app(ctx)
    loaded = skypilot.load(
        spec,
        application.settings.money_rates.per_base,
        lambda: application.actor,
        application.settings.workdir.limits,
        fmt=fmt.value,
        overrides=skypilot.Overrides(tuple(env or ()), gpus, cloud),
    )
    for note in loaded.notes:
        err.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
    return application, loaded.experiment


@app.command()
def plan(
    ctx: typer.Context,
    spec: str = typer.Argument(..., help="experiment file, or SkyPilot task file"),
    top: int = typer.Option(10, min=1, help="how many candidates to show"),
    fmt: FileFormat = FORMAT,
    env: list[str] = ENV,
    gpus: str = GPUS,
    cloud: str = CLOUD,
    output: Output = OUTPUT,
) -> None:
    """Rank the offers an experiment (or a SkyPilot task) may use, with why the others were
    turned down. Needs no credentials and launches nothing."""
    from provisioner.views import plan as views  # policies and the catalog: not for --help

    application, experiment = _load(ctx, spec, fmt, env, gpus, cloud)
    application.policies  # noqa: B018  (a bad policy file is reported before the state is opened)
    v = views.plan(application, experiment, spec)
    if output is Output.json:
        print_json(_plan_json(v, top))
    else:
        _plan_text(v, top)
    if v.refused:  # what `up` would refuse: exit 2, as for any refusal (the plan is shown above)
        raise typer.Exit(2)


def _plan_json(v: Any, top: int) -> dict[str, Any]:
    p, e = v.plan, v.experiment
    return {
        "experiment": e.name,
        "gpu": str(e.resources.gpu),
        "market": e.resources.market,
        "currency": p.currency,
        "rates": p.rates,
        "candidates": [c.to_json() for c in p.candidates[:top]],
        "candidate_count": len(p.candidates),
        "launchable_count": len(v.launchable),  # 0 when `up` would refuse: see "refused"
        "refused": v.refusal,
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
        "warnings": v.warnings,
        "addresses": v.addresses,
        "guard": v.guard,
    }


_PLAN_COLUMNS = [
    ("#", ">", 0),
    ("cloud", "<", 0),
    ("zone", "<", 1),
    ("type", "<", 0),
    ("GPUs", ">", 3),
    ("vCPU", ">", 4),
    ("RAM GB", ">", 4),
    ("market", "<", 5),
    ("price/h", ">", 0),
]


def _plan_text(v: Any, top: int) -> None:
    res, shown, every = v.experiment.resources, v.candidates[:top], v.candidates
    head = f"[bold]{v.experiment.name}[/]: {res.gpu} {res.market} — "
    if v.refused:
        head += f"{plural(len(every), 'offer')} fit, none may launch: {v.refusal}"
    else:
        head += f"{plural(len(every), 'candidate')}, cheapest first"
    top_n = f" (top {len(shown)})" if len(shown) < len(every) else ""
    out.print(head + top_n, highlight=False, soft_wrap=True)
    if shown:
        _plan_table(v, shown)
    _plan_notes(v)


def _plan_table(v: Any, shown: list[Any]) -> None:
    rows = [
        [
            str(i),
            c.offer.cloud,
            c.offer.zone or c.offer.region,
            c.offer.instance_type,
            f"{c.offer.gpu_count}×{c.offer.gpu}",
            str(c.offer.vcpus),
            f"{c.offer.memory_gb:g}",
            c.market,
            str(c.price),
            c.price_base.text(currency=False),
        ]
        for i, c in enumerate(shown, 1)
    ]
    write(text_table([*_PLAN_COLUMNS, (f"in {v.currency}", ">", 2)], rows))


def _plan_notes(v: Any) -> None:
    """Below the table: the cheapest per cloud, the rates, what is unpriced, the checks; then
    the notes, the addresses' rates, who enforces the rules, what was turned down."""
    if v.cheapest:
        out.print(
            f"cheapest per cloud ({v.currency}/h): "
            + ", ".join(f"{cl} {price.text(currency=False)}" for cl, price in v.cheapest),
        )
    if v.plan.rates:
        out.print(f"[dim]ranked in {v.currency}; {v.plan.rates}[/]")
    for cloud, types in v.unpriced.items():
        out.print(
            f"[yellow]{cloud}[/]: {', '.join(types)} fit but have no public price, so they are not "
            f"ranked; set prices.{cloud}.<type> in settings to include them",
        )
    for check in v.checks:
        out.print(str(check))
    _plan_said(v)


def _plan_said(v: Any) -> None:
    for warning in v.warnings:
        out.print(f"[yellow]note[/]: {warning}", soft_wrap=True)
    for line in v.addresses:
        out.print(f"[dim]public IPv4[/]: {line}", soft_wrap=True)
    for line in v.guard:
        out.print(f"[dim]enforced by[/]: {line}", highlight=False, soft_wrap=True)
    if v.rejects:
        out.print(
            "[bold]turned down[/]: "
            + "; ".join(f"{r.reason}: {r.count} (e.g. {r.example})" for r in v.rejects),
        )


@app.command()
def up(
    ctx: typer.Context,
    spec: str = typer.Argument(..., help="experiment file, or SkyPilot task file"),
    fmt: FileFormat = FORMAT,
    env: list[str] = ENV,
    gpus: str = GPUS,
    cloud: str = CLOUD,
    wait: bool = typer.Option(True, help="wait until the machine runs and answers SSH"),
    wait_timeout: float = typer.Option(600, min=1, help="seconds to wait at most"),
    detach: bool = typer.Option(
        False,
        "--detach",
        "-d",
        help="return once launched: neither wait for SSH nor follow the job's output",
    ),
    retry_until_up: bool = typer.Option(
        False,
        "--retry-until-up",
        help="when every candidate lacks capacity, stay queued (`waiting`) and retry until "
        "launched or --timeout",
    ),
    timeout: str = typer.Option(
        None,
        "--timeout",
        help="how long --retry-until-up waits, e.g. 6h (default: the experiment's "
        "lifecycle.on_no_capacity.wait, else 6h)",
        show_default=False,
    ),
    output: Output = OUTPUT,
) -> None:
    """Launch the cheapest allowed offer, failing over across zones, regions and clouds, and
    wait until it is ready to use. With a `run:`, its output follows until it exits and
    lifecycle.on_finish acts (exit 1 when the run failed); --detach returns at once."""
    from provisioner.cli import launched
    from provisioner.workflows import up as flow  # SQLAlchemy: not for --help

    application, experiment = _load(ctx, spec, fmt, env, gpus, cloud)
    quiet = output is Output.json
    request = flow.UpRequest(
        experiment,
        spec,
        wait=wait and not detach,
        wait_timeout=wait_timeout,
        follow=not quiet and not detach,
        retry_until_up=retry_until_up,
        timeout=_timeout(retry_until_up, timeout),
    )
    shown = launched.Shown(quiet)
    try:
        result = flow.up(application, request, shown)
    except flow.Interrupted as e:
        err.print(e.message, highlight=False, markup=False, soft_wrap=True)
        if quiet:
            print_json({"error": e.message, "exit_code": 130})
        raise typer.Exit(130) from None
    finally:
        shown.stop()
    launched.outcome(result, spec, output)


def _timeout(retry: bool, timeout: str | None) -> Any:
    """``--timeout`` as a timedelta (None: not given); only with --retry-until-up."""
    from policies.duration import parse_duration
    from provisioner.errors import UserError

    if timeout is not None and not retry:
        raise UserError("--timeout is how long --retry-until-up waits: give both, or neither")
    if timeout is None:
        return None
    try:
        wait = parse_duration(timeout)
    except ValueError as e:
        raise UserError(f"--timeout {timeout!r}: {e}") from None
    if wait.total_seconds() <= 0:
        raise UserError(f"--timeout {timeout!r}: must be longer than zero")
    return wait


@app.command()
def ssh(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="machine name"),
    command: list[str] = typer.Argument(None, help="a command to run there (after --)"),
) -> None:
    """Log in on a machine (or run a command there) as its cloud's user, at its address.

    Runs OpenSSH's `ssh` — $PROVISIONER_SSH_COMMAND instead when set (e.g. "ssh -p 2222",
    like GIT_SSH_COMMAND) — with the key `up` launched it with (your agent or ~/.ssh/config
    decides for an experiment's own ssh_public_key). An address that does not answer within
    15 s is reported with what to check."""
    import os
    import shlex

    from provisioner import keys, machines  # SQLAlchemy: not for --help
    from provisioner.errors import UserError

    application = get_app(ctx)
    m = machines.find_to_act(application, name)  # logging in is acting: owner or act_as
    if m.status != S.RUNNING or not m.public_ip:
        hint = f"`provisioner start {m.name}`" if m.status == S.STOPPED else "`provisioner status`"
        raise UserError(f"{m.name} is {m.status} with no address to connect to (see {hint})")
    provider = application.provider(m.cloud)
    with err.status(f"checking that {m.name} answers at {m.public_ip}…"):
        keys.check_reachable(application, m)
    key = keys.private_key(application, m)
    # after the user's own options: for -o, OpenSSH keeps the first value it is given
    argv = [
        *shlex.split(os.environ.get("PROVISIONER_SSH_COMMAND") or "ssh"),
        *(["-i", str(key), "-o", "IdentitiesOnly=yes"] if key else []),
        *("-o", f"Port={provider.ssh_port}"),
        *("-o", f"ConnectTimeout={keys.probe_seconds():g}"),
        *("-o", "StrictHostKeyChecking=accept-new"),
        *("-o", f"UserKnownHostsFile={keys.known_hosts(application)}"),
        *("-o", f"HostKeyAlias={keys.host_alias(m)}"),
        f"{provider.ssh_user}@{m.public_ip}",
        *(command or []),
    ]
    sys.stdout.flush()
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        raise UserError(
            f"cannot run {argv[0]}: {e.strerror} (is the OpenSSH client installed?)"
        ) from None


@app.command("ssh-config")
def ssh_config(
    ctx: typer.Context,
    install: bool = typer.Option(
        False,
        "--install",
        help="write it to the provisioner home and Include it from ~/.ssh/config; up, start, "
        "stop and down keep it current",
    ),
) -> None:
    """An OpenSSH config with a Host per running machine, so plain `ssh NAME`, `scp` and VS Code
    Remote reach machines by name (with the key `up` launched them with)."""
    from provisioner import keys  # SQLAlchemy: not for --help

    application = get_app(ctx)
    if not install:
        write(keys.ssh_config(application).rstrip("\n"))
        return
    for line in keys.install(application):
        out.print(line, highlight=False, markup=False, soft_wrap=True)


def _fleet(verb: str, op: str, done: str, same: str) -> None:
    def command(
        ctx: typer.Context,
        names: list[str] = typer.Argument(None, help="machine names", show_default=False),
        all_: bool = typer.Option(False, "--all", "-a", help="every machine it applies to"),
        project: str = typer.Option(None, "--project", help="the machines of this project"),
        yes: bool = typer.Option(False, "--yes", "-y", help="do not ask before acting on several"),
        output: Output = OUTPUT,
    ) -> None:
        from provisioner.errors import UserError
        from provisioner.workflows import many  # SQLAlchemy: not for --help

        if bool(names) == bool(all_ or project):
            raise UserError(f"name the machines to {op}, or use --all or --project P")
        quiet = output is Output.json

        def ask(chosen: list[str]) -> None:
            if not yes:
                _confirm(f"{op} {plural(len(chosen), 'machine')}: {', '.join(chosen)}?")

        def shown(r: Any) -> None:
            if not quiet:
                _acted_line(r, done, same)

        request = many.ManyRequest(op, list(names or []), project)  # type: ignore[arg-type]
        result = many.act(get_app(ctx), request, confirm=ask, progress=shown)
        if result.left_out_line is not None:
            err.print(result.left_out_line, highlight=False, markup=False, soft_wrap=True)
        if not result.chosen:
            scope = f"in project {project!r}" if project else "at all"
            out.print(f"no machine to {op} {scope}", highlight=False, soft_wrap=True)
            return
        _warn(result.warning)
        if quiet:
            listed = [_acted_json(r) for r in result.results]
            print_json(listed[0] if len(listed) == 1 and names else listed)
        if result.exit_code:
            raise typer.Exit(result.exit_code)

    command.__doc__ = (
        f"{verb} Name one or more machines, or choose them with --all or --project (several "
        "need confirmation, or --yes)."
    )
    app.command(op)(command)


def _acted_line(r: Any, done: str, same: str) -> None:
    from rich.markup import escape

    from provisioner.workflows.many import Failed

    if isinstance(r, Failed):  # the error names the machine, or is prefixed with its name
        said = r.error if r.error.startswith(f"{r.name}: ") else f"{r.name}: {r.error}"
        err.print(f"[red]error:[/] {escape(said)}", highlight=False, soft_wrap=True)
    elif r.cancelled == S.WAITING:
        out.print(
            f"{r.machine.name} was waiting for capacity and was never launched: the wait is "
            "cancelled and marked failed; nothing of it bills",
            highlight=False,
            soft_wrap=True,
        )
    elif r.cancelled == S.REQUESTED:
        out.print(
            f"{r.machine.name} was never launched (an unfinished `up`): its request is "
            "cancelled and marked failed; nothing of it bills",
            highlight=False,
            soft_wrap=True,
        )
    else:
        out.print(
            f"{r.machine.name} {done if r.changed else same}", highlight=False, soft_wrap=True
        )


def _acted_json(r: Any) -> dict[str, Any]:
    from provisioner.workflows.many import Failed

    if isinstance(r, Failed):
        return {"name": r.name, "error": r.error, "exit_code": r.exit_code}
    return {"name": r.name, "changed": r.changed, "machine": machine_json(r.machine)}


def _warn(warning: str | None) -> None:
    if warning is not None:
        err.print(f"warning: {warning}", highlight=False, markup=False, soft_wrap=True)


def _confirm(question: str) -> None:
    """Ask on a terminal; without one (a script), refuse: acting on several machines needs
    --yes there, never a silent yes."""
    from provisioner.errors import UserError

    if not sys.stdin.isatty():
        raise UserError(f"{question} Not asked without a terminal: add --yes to confirm")
    if not typer.confirm(question, err=True):
        raise typer.Abort()


_fleet(
    "Stop machines: compute billing ends, the disks are kept.",
    "stop",
    "stopped",
    "was already stopped",
)
_fleet("Start stopped machines.", "start", "started", "is already running")
_fleet("Terminate machines and everything they bill for.", "down", "terminated", "was already gone")


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
    """Machines carrying our tag that the state does not know (they bill, unseen), network
    pieces of ours no machine uses, and volumes of ours no experiment uses. Lists them;
    --terminate removes the machines (after confirmation) and network pieces; a volume is
    removed only by `provisioner volume rm`."""
    from provisioner.workflows import gc as flow  # SQLAlchemy: not for --help

    def ask(count: int) -> None:
        if not yes:
            _confirm(f"terminate {plural(count, 'orphaned machine')}?")

    found = flow.gc(get_app(ctx), flow.GcRequest(cloud or None, terminate), ask)
    if output is Output.json:
        print_json(_gc_json(found))
    else:
        _gc_text(found)


def _gc_text(found: Any) -> None:
    for o in found.orphans:
        terminated = "[red]terminated[/] " if o in found.terminated else ""
        out.print(terminated + str(o), highlight=False, soft_wrap=True)
    if not found.orphans:
        out.print("no orphans", soft_wrap=True)
    for cl, pieces in found.network.items():
        for piece in pieces:
            how = "[red]removed[/] " if found.removed else "unused: "
            out.print(f"{how}{cl} {piece}", soft_wrap=True)
    for v in found.volumes:  # listed only, never removed here: a volume holds data
        out.print(f"unused: {v}", highlight=False, markup=False, soft_wrap=True)
    for c, why in found.not_asked.items():
        err.print(
            f"[yellow]{c}[/]: not asked: {why.removeprefix(f'{c}: ')}",
            highlight=False,
            soft_wrap=True,
        )


def _gc_json(found: Any) -> dict[str, Any]:
    return {
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
            for o in found.orphans
        ],
        "terminated": [o.instance.id for o in found.terminated],
        "unused_network": found.network,
        "network_removed": found.removed,
        "volumes": [
            {
                "cloud": v.cloud,
                "id": v.id,
                "name": v.name,
                "zone": v.zone,
                "size_gb": v.size_gb,
                "why": v.why,
            }
            for v in found.volumes
        ],
        "not_asked": found.not_asked,
    }
