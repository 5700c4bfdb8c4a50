"""plan, up, status, stop, start, down."""

from __future__ import annotations

import sys
from contextlib import nullcontext
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
from provisioner.fleet import money_text as _money
from provisioner.schema import MachineStatus as S


@app.command()
def plan(
    ctx: typer.Context,
    spec: str = typer.Argument(..., help="experiment file"),
    top: int = typer.Option(10, min=1, help="how many candidates to show"),
    output: Output = OUTPUT,
) -> None:
    """Rank the offers an experiment may use, with why the others were turned down. Needs no
    credentials and launches nothing."""
    from provisioner.spec import load_experiment  # pydantic: not for --help
    from provisioner.views import plan as views  # policies and the catalog: not for --help

    application = get_app(ctx)
    experiment = load_experiment(
        spec, application.settings.money_rates.per_base, lambda: application.actor
    )
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


def _guard_lines(application: Any, m: Any) -> None:
    """At ``up``: who enforces each of the machine's rules (its own agent, or the scheduler)."""
    from provisioner.views.plan import machine_guard

    for line in machine_guard(application, m):
        out.print(f"  enforced by: {line}", highlight=False, soft_wrap=True)


@app.command()
def up(
    ctx: typer.Context,
    spec: str = typer.Argument(..., help="experiment file"),
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
    from provisioner import machines  # SQLAlchemy: not for --help
    from provisioner.machines import waiting  # as above
    from provisioner.spec import load_experiment  # pydantic: not for --help

    application = get_app(ctx)
    experiment = load_experiment(
        spec, application.settings.money_rates.per_base, lambda: application.actor
    )
    capacity_wait = _capacity_wait(experiment, retry_until_up, timeout)
    application.policies  # noqa: B018  (a bad policy file is reported before the state is opened)
    quiet = output is Output.json
    existing = _existing(application, experiment.name)
    # "requested": resume it; "waiting" with a wait asked: follow it
    resume = ("requested", "waiting") if capacity_wait is not None else ("requested",)
    if existing is not None and existing.status not in resume:
        if not quiet and not detach and _run_resumed(application, existing):
            return
        _already(existing, experiment.to_json(), spec, output)
        return
    say = (
        (lambda msg: None)
        if quiet
        else (lambda msg: err.print(msg, highlight=False, soft_wrap=True))
    )
    try:
        with err.status(f"launching {experiment.name}…") if not quiet else nullcontext():
            if capacity_wait is None:
                result = machines.up(application, experiment, spec_path=spec, progress=say)
            else:
                result = waiting.up_until_up(
                    application, experiment, wait=capacity_wait, spec_path=spec, progress=say
                )
        m = result.machine
        _refresh_ssh_config(application)  # before waiting: a wait that times out leaves it
        if result.already:  # another `up` of this name won the race
            _already(m, experiment.to_json(), spec, output)
            return
        if wait and not detach and m.status in (S.PENDING, S.RUNNING):
            with err.status(f"waiting for {m.name}…") if not quiet else nullcontext():
                m = machines.wait_ready(application, m.name, timeout=wait_timeout, progress=say)
                _start_due_run(application, m, experiment, say, wait_timeout)
    except KeyboardInterrupt:
        said = _interrupted_up(application, experiment.name, spec)
        err.print(said, highlight=False, markup=False, soft_wrap=True)
        if quiet:
            print_json({"error": said, "exit_code": 130})
        raise typer.Exit(130) from None
    _refresh_ssh_config(application)
    if quiet:
        print_json(
            {
                "already": False,
                "machine": machine_json(m),
                "attempts": [a.to_json() for a in result.attempts],
                **_volumes_json(application, m, result),
            }
        )
        return
    out.print(
        f"[green]launched[/] {m.name} on {m.cloud} {m.zone or m.region}: {m.instance_type} "
        f"({m.gpu_count}×{m.gpu}, {m.market}) at {_money(m.rate, m.currency)}/h",
        soft_wrap=True,
    )
    if m.disk_rate is not None:
        out.print(
            f"  disk {m.disk_gb} GB: {_money(m.disk_rate, m.currency)}/h while it exists",
            soft_wrap=True,
        )
    if m.address_rate is not None:
        out.print(
            f"  public IPv4: {m.address_rate.normalize():f} {m.currency}/h "
            + ("while it runs" if m.address_billed == "running" else "until it is deleted"),
            soft_wrap=True,
        )
    _volume_lines(application, m, result)
    out.print(
        f"  instance {m.instance_id}" + (f", address {m.public_ip}" if m.public_ip else ""),
        soft_wrap=True,
    )
    if experiment.run and not detach and _run_started(application, m):
        _follow_run(application, m.name, experiment)
        return
    if experiment.run and not _run_started(application, m):
        out.print(
            f"  job run starts once {m.name} answers SSH (the scheduler's reconcile pass starts "
            f"it; `provisioner logs {m.name} -f` then)",
            soft_wrap=True,
        )
    if experiment.run:
        out.print(f"  job run started: `provisioner logs {m.name} -f`", soft_wrap=True)
    out.print(f"  connect with `provisioner ssh {m.name}`", soft_wrap=True)
    _guard_lines(application, m)
    if not machines.can_stop(m):
        from provisioner.jobs.sweep import UNSTOPPABLE_WARN_MINUTES

        out.print(
            f"  a spot machine on {m.cloud} cannot be stopped: an out-of-hours idle stop "
            f"terminates it and its boot disk, not its volumes (the owner is warned "
            f"{UNSTOPPABLE_WARN_MINUTES} "
            f"minutes before); remove it with `provisioner down {m.name}`",
            soft_wrap=True,
        )
        return
    out.print(
        f"  stop it with `provisioner stop {m.name}`, remove it with `provisioner down {m.name}`",
        soft_wrap=True,
    )


def _start_due_run(application: Any, m: Any, experiment: Any, say: Any, timeout: float) -> None:
    """A cloud machine's job starts once it answers SSH: now, after the wait; tried again
    (bounded by ``timeout``) while its SSH port is open but the login is not ready yet
    (cloud-init still installing the key)."""
    import time

    from provisioner.machines import jobs

    if m.status != S.RUNNING or not (experiment.run or experiment.setup):
        return
    deadline = time.monotonic() + timeout
    while jobs.run_due(application, m):
        jobs.ensure_run(application, m, experiment, progress=say)
        if not jobs.run_due(application, m) or time.monotonic() + 5 > deadline:
            return
        time.sleep(5)


def _run_started(application: Any, m: Any) -> bool:
    from provisioner.machines import jobs

    return jobs.RUN in jobs.jobs_of(application, m)


def _run_resumed(application: Any, m: Any) -> bool:
    """A running machine whose stored experiment has a ``run`` that never started (an earlier
    `up` was interrupted between the launch and the job): started now and followed."""
    from provisioner.machines import jobs
    from provisioner.spec import Experiment

    stored = Experiment.model_validate(m.spec)
    if m.status != S.RUNNING or not stored.run or not jobs.ensure_run(application, m, stored):
        return False
    out.print(f"{m.name} was launched before; its run had not started: started now")
    _follow_run(application, m.name, stored)
    return True


def _follow_run(application: Any, name: str, experiment: Any) -> None:
    """The run's output as it comes, then what on_finish did; exit 1 when the run failed.
    Ctrl-C leaves the job running."""
    from provisioner.cli import jobs

    out.print(
        f"  job run (on_finish: {experiment.on_finish}); its output follows "
        f"(Ctrl-C leaves it running: `provisioner logs {name} -f`)",
        soft_wrap=True,
    )
    try:
        job = jobs.follow(application, name, "run")
    except KeyboardInterrupt:
        err.print(
            f"{name}: the job keeps running; `provisioner logs {name} -f` follows it again",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        raise typer.Exit(130) from None
    out.print(jobs.outcome_line(application, name, job), highlight=False, soft_wrap=True)
    if job is None or job.exit_code != 0:
        raise typer.Exit(1)


def _pins(result: Any) -> list[Any]:
    from provisioner.planner import VolumePin

    return [c for c in (result.plan.checks if result.plan else []) if isinstance(c, VolumePin)]


def _volumes_json(application: Any, m: Any, result: Any) -> dict[str, Any]:
    if not (m.spec or {}).get("volumes"):
        return {}
    from provisioner.machines import volumes

    names = {v["name"]: v["path"] for v in m.spec["volumes"]}
    listed = [v for v in volumes.listing(application, m.project) if v.volume.name in names]
    return {
        "volumes": [{**v.as_json(), "path": names[v.volume.name]} for v in listed],
        "pinned": [p.as_json() for p in _pins(result)],
    }


def _volume_lines(application: Any, m: Any, result: Any) -> None:
    """Each volume: where it is mounted, its size and rate; the pin, when one chose the zone."""
    if not (m.spec or {}).get("volumes"):
        return
    from provisioner.machines import volumes

    for pin in _pins(result):
        out.print(f"  {pin}", highlight=False, soft_wrap=True)
    names = {v["name"]: v["path"] for v in m.spec["volumes"]}
    for v in volumes.listing(application, m.project):
        if v.volume.name in names:
            out.print(
                f"  volume {v.volume.name} {v.volume.size_gb} GB at {names[v.volume.name]} "
                f"({v.status}): {volumes.rate_text(v.volume)} until `provisioner volume rm "
                f"{v.volume.name}`",
                highlight=False,
                soft_wrap=True,
            )


def _capacity_wait(experiment: Any, retry: bool, timeout: str | None) -> Any:
    """How long ``up`` waits for capacity (a timedelta), or None: fail at once. The flag with
    its --timeout, else the file's ``lifecycle.on_no_capacity.wait``, else 6 h."""
    from policies.duration import parse_duration
    from provisioner.errors import UserError
    from provisioner.machines.waiting import DEFAULT_WAIT

    asked = experiment.lifecycle.on_no_capacity
    if timeout is not None and not retry:
        raise UserError("--timeout is how long --retry-until-up waits: give both, or neither")
    if not retry:
        return asked.wait if asked is not None else None
    if timeout is None:
        return asked.wait if asked is not None else DEFAULT_WAIT
    try:
        wait = parse_duration(timeout)
    except ValueError as e:
        raise UserError(f"--timeout {timeout!r}: {e}") from None
    if wait.total_seconds() <= 0:
        raise UserError(f"--timeout {timeout!r}: must be longer than zero")
    return wait


def _existing(application: Any, name: str) -> Any:
    from provisioner.state import live_machine  # SQLAlchemy: not for --help

    with application.db.session() as s:
        return live_machine(s, name)


def spec_differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """``field: old → new`` for each leaf that differs between two stored specs."""
    if isinstance(old, dict) and isinstance(new, dict):
        diffs: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            diffs += spec_differences(old.get(k), new.get(k), f"{prefix}{k}.")
        return diffs
    if old == new:
        return []
    return [f"{prefix.rstrip('.')}: {_short(old)} → {_short(new)}"]


def _short(v: Any) -> str:
    text = "—" if v is None or v == {} or v == [] else str(v)
    return text if len(text) <= 40 else text[:39] + "…"


def _already(m: Any, new_spec: dict[str, Any], path: str, output: Output) -> None:
    """``up`` of a name that exists: nothing launched. The same spec is no error (say how to
    use it); a changed one is (exit 2), with what differs and what to run."""
    diffs = spec_differences(m.spec or {}, new_spec)
    where = "waiting for capacity" if m.status == S.WAITING else f"{m.status} on {m.cloud or '—'}"
    if output is Output.json:
        print_json({"already": True, "machine": machine_json(m), "differences": diffs})
    elif diffs:
        err.print(
            f"[red]error:[/] {m.name} already exists ({where}) from a different spec; "
            f"nothing launched. What differs (recorded → {path}):",
            highlight=False,
            soft_wrap=True,
        )
        for d in diffs:
            err.print(f"  {d}", highlight=False, markup=False, soft_wrap=True)
        err.print(
            f"To launch the new spec: `provisioner down {m.name}` then `provisioner up {path}`"
            + (
                f" (or `provisioner start {m.name}` to use the old one)"
                if m.status == S.STOPPED
                else ""
            ),
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    else:
        hint = (
            f"start it with `provisioner start {m.name}`"
            if m.status == S.STOPPED
            else f"follow it with `provisioner up {path} --retry-until-up`, or cancel it with "
            f"`provisioner down {m.name}`"
            if m.status == S.WAITING
            else f"see `provisioner status {m.name}`"
        )
        out.print(
            f"{m.name} already exists ({where}); nothing launched — {hint}",
            highlight=False,
            soft_wrap=True,
        )
    if diffs:
        raise typer.Exit(2)


def _interrupted_up(application: Any, name: str, path: str) -> str:
    """After Ctrl-C: the state ``up`` left, and the commands that resume or undo it."""
    try:
        m = _existing(application, name)
    except Exception:  # the state itself was mid-write: say what we can
        m = None
    if m is None:
        return f"interrupted: nothing of {name} was written; run `provisioner up {path}`"
    queued = _queued(application, m)
    if queued is not None:
        return queued
    if m.status == S.REQUESTED:
        return (
            f"interrupted: {name} is requested (recorded, launch not finished; a machine may "
            f"be starting). Resume with `provisioner up {path}`, or undo with "
            f"`provisioner down {name}`"
        )
    return (
        f"interrupted: {name} is {m.status} on {m.cloud} {m.zone or m.region} "
        f"({m.instance_id}) and bills. See `provisioner status {name}`, connect with "
        f"`provisioner ssh {name}` once it answers, or remove it with `provisioner down {name}`"
    )


def _queued(application: Any, m: Any) -> str | None:
    """The Ctrl-C message of an intent waiting for capacity (None: it is not): it stays
    queued, the scheduler keeps trying, and how to cancel it."""
    from provisioner.fleet import at_text
    from provisioner.machines import waiting

    try:
        m, w = waiting.state(application, m.id)
    except Exception:  # the state itself was mid-write: the plain message
        return None
    if w is None or m.status not in (S.WAITING, S.REQUESTED):
        return None
    until = at_text(w.until, application.clock.now())
    midway = (
        " (a try was under way: the next one adopts whatever it launched)"
        if m.status == S.REQUESTED
        else ""
    )
    return (
        f"interrupted: {m.name} stays queued (waiting for capacity until {until}){midway}; the "
        f"scheduler keeps trying (`provisioner scheduler run`, or `provisioner sweep` from "
        f"cron); cancel with `provisioner down {m.name}`"
    )


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
    m = machines.find(application, name)
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


def _refresh_ssh_config(application: Any) -> None:
    """Keep an installed ssh-config current after a machine came, went or moved."""
    from provisioner import keys

    try:
        keys.refresh(application)
    except OSError as e:
        err.print(
            f"warning: could not rewrite {keys.config_path(application)}: {e}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


def _fleet(verb: str, fn_name: str, done: str, same: str, applies: tuple[str, ...]) -> None:
    def command(
        ctx: typer.Context,
        names: list[str] = typer.Argument(None, help="machine names", show_default=False),
        all_: bool = typer.Option(False, "--all", "-a", help="every machine it applies to"),
        project: str = typer.Option(None, "--project", help="the machines of this project"),
        yes: bool = typer.Option(False, "--yes", "-y", help="do not ask before acting on several"),
        output: Output = OUTPUT,
    ) -> None:
        from provisioner import machines  # SQLAlchemy: not for --help
        from provisioner.errors import ProvisionerError, UserError

        if bool(names) == bool(all_ or project):
            raise UserError(f"name the machines to {fn_name}, or use --all or --project P")
        application = get_app(ctx)
        chosen = list(dict.fromkeys(names or [])) or _select(application, project, applies)
        if not chosen:
            scope = f"in project {project!r}" if project else "at all"
            out.print(f"no machine to {fn_name} {scope}", highlight=False, soft_wrap=True)
            return
        if (all_ or project or len(chosen) > 1) and not yes:
            _confirm(f"{fn_name} {plural(len(chosen), 'machine')}: {', '.join(chosen)}?")
        results: list[dict[str, Any]] = []
        for name in chosen:
            try:
                before = _status_of(application, name) if fn_name == "down" else None
                m, changed = getattr(machines, fn_name)(application, name)
            except ProvisionerError as e:
                results.append({"name": name, "error": str(e), "exit_code": e.exit_code})
                if output is not Output.json:
                    err.print(
                        f"[red]error:[/] {name}: {e}", highlight=False, markup=True, soft_wrap=True
                    )
                continue
            results.append({"name": name, "changed": changed, "machine": machine_json(m)})
            if output is Output.json:
                continue
            if before == S.WAITING and m.status == S.FAILED:
                out.print(
                    f"{m.name} was waiting for capacity and was never launched: the wait is "
                    "cancelled and marked failed; nothing of it bills",
                    highlight=False,
                    soft_wrap=True,
                )
            elif before == S.REQUESTED and m.status == S.FAILED:
                out.print(
                    f"{m.name} was never launched (an unfinished `up`): its request is "
                    "cancelled and marked failed; nothing of it bills",
                    highlight=False,
                    soft_wrap=True,
                )
            else:
                out.print(f"{m.name} {done if changed else same}", highlight=False, soft_wrap=True)
        _refresh_ssh_config(application)
        if output is Output.json:
            one = len(results) == 1 and names
            print_json(results[0] if one else results)
        failed = [r["exit_code"] for r in results if "error" in r]
        if failed:
            raise typer.Exit(max(failed) if len(failed) == len(results) else 1)

    command.__doc__ = (
        f"{verb} Name one or more machines, or choose them with --all or --project (several "
        "need confirmation, or --yes)."
    )
    app.command(fn_name)(command)


def _select(application: Any, project: str | None, applies: tuple[str, ...]) -> list[str]:
    from sqlalchemy import select  # not for --help

    from provisioner.models import Machine  # as above

    q = (
        select(Machine.name)
        .where(Machine.status.in_(applies))
        .order_by(Machine.created_at, Machine.name)
    )
    if project:
        q = q.where(Machine.project == project)
    with application.db.session() as s:
        return list(dict.fromkeys(s.scalars(q)))


def _status_of(application: Any, name: str) -> str | None:
    m = _existing(application, name)
    return None if m is None else m.status


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
    ("running", "pending"),
)
_fleet("Start stopped machines.", "start", "started", "is already running", ("stopped",))
_fleet(
    "Terminate machines and everything they bill for.",
    "down",
    "terminated",
    "was already gone",
    ("requested", "waiting", "pending", "running", "stopping", "stopped", "preempted"),
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
    """Machines carrying our tag that the state does not know (they bill, unseen), network
    pieces of ours no machine uses, and volumes of ours no experiment uses. Lists them;
    --terminate removes the machines (after confirmation) and network pieces; a volume is
    removed only by `provisioner volume rm`."""
    from provisioner import machines  # SQLAlchemy: not for --help

    application = get_app(ctx)
    found, errors = machines.orphans(application, cloud or None)
    done: list[Any] = []
    if terminate and found:
        doomed = [o for o in found if not o.adoptable_by]
        if doomed and not yes:
            _confirm(f"terminate {plural(len(doomed), 'orphaned machine')}?")
        done = machines.collect(application, found)
    network = machines.unused_network(application, cloud or None, errors, remove=terminate)
    from provisioner.machines import volumes

    stray = volumes.strays(application, cloud or None, errors)
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
                "volumes": [
                    {
                        "cloud": v.cloud,
                        "id": v.id,
                        "name": v.name,
                        "zone": v.zone,
                        "size_gb": v.size_gb,
                        "why": v.why,
                    }
                    for v in stray
                ],
                "not_asked": errors,
            }
        )
        return
    for o in found:
        out.print(
            ("[red]terminated[/] " if o in done else "") + str(o), highlight=False, soft_wrap=True
        )
    if not found:
        out.print("no orphans", soft_wrap=True)
    for cl, pieces in network.items():
        for piece in pieces:
            out.print(
                f"{'[red]removed[/] ' if terminate else 'unused: '}{cl} {piece}", soft_wrap=True
            )
    for v in stray:  # listed only, never removed here: a volume holds data
        out.print(f"unused: {v}", highlight=False, markup=False, soft_wrap=True)
    for c, why in errors.items():
        err.print(
            f"[yellow]{c}[/]: not asked: {why.removeprefix(f'{c}: ')}",
            highlight=False,
            soft_wrap=True,
        )
