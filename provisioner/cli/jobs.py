"""logs and exec: the job's output (followed with :func:`provisioner.workflows.up.follow`, as
``up`` follows the experiment's ``run``), and another job beside it."""

from __future__ import annotations

import sys

import typer

from provisioner.cli import OUTPUT, Output, app, err, get_app, out, print_json, text_table, write


def _stdout(chunk: bytes) -> None:
    sys.stdout.buffer.write(chunk)
    sys.stdout.flush()


def tail(data: bytes, lines: int | None) -> bytes:
    """The last ``lines`` lines of ``data`` (all when None)."""
    if lines is None:
        return data
    if lines <= 0:
        return b""
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:])


@app.command()
def logs(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="machine"),
    follow_: bool = typer.Option(False, "--follow", "-f", help="keep writing until the job ends"),
    lines: int = typer.Option(None, "--tail", "-n", min=0, help="only the last N lines first"),
    job: str = typer.Option("run", "--job", "-j", help="which job: run, exec-1, exec-2…"),
    attempt: int = typer.Option(
        None, "--attempt", min=1, help="an earlier attempt (a run started again after a preemption)"
    ),
) -> None:
    """The output of the machine's job (its experiment's `run`, or an `exec` job with --job):
    from the machine, or as kept with the state when it ended (its last MiB; the machine
    stopped or gone). With -f, followed until the job ends. Exits with the job's exit code once
    it ended (a failed setup: the setup's; cancelled: 143; killed with its machine: 137),
    0 while it runs."""
    from provisioner.jobs import finish
    from provisioner.workflows import job_control

    application = get_app(ctx)
    read = job_control.read(application, name, job, attempt)
    if read.note:
        err.print(f"job {job}: {read.note}", highlight=False, markup=False, soft_wrap=True)
    if read.seen:  # the end seen, the output read, then on_finish (it may stop the machine)
        from provisioner.machines import jobs

        finish.on_ended(application, jobs.named(application, name), read.seen)
    _stdout(tail(read.data, lines))
    if follow_ and read.job is not None and read.job.running:
        from provisioner.workflows.up import follow  # SQLAlchemy: not for --help

        followed = follow(application, name, job, offset=len(read.data), write=_stdout)
        if followed is None:  # gone with its machine: nothing more to say of it
            return
        read = job_control.LogRead(b"", followed)
    if read.ended:
        err.print(f"job {job}: {read.end}", highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(read.code)


@app.command()
def cancel(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="machine"),
    job_ids: list[str] = typer.Argument(None, metavar="[JOB]...", help="run, exec-1…"),
    all_: bool = typer.Option(False, "--all", help="every job that runs on the machine"),
    grace: float = typer.Option(
        None, "--grace", min=0, help="seconds between TERM and KILL (settings: jobs)"
    ),
) -> None:
    """End jobs on the machine: TERM to each job's processes, KILL after the grace; recorded as
    cancelled. Cancelling `run` then does what its on_finish says (stop, terminate, keep)."""
    from provisioner.errors import UserError
    from provisioner.workflows import job_control

    if bool(job_ids) == all_:
        raise UserError("name the jobs to cancel, or --all (not both)")
    done = job_control.cancel(get_app(ctx), name, None if all_ else job_ids, grace)
    if not done.jobs and not done.dropped:
        out.print(f"{name}: no job was running", highlight=False, markup=False)
    for jid in done.dropped:
        out.print(f"{name}: job {jid} cancelled (it was queued)", highlight=False, markup=False)
    for j in done.jobs:
        out.print(f"{name}: job {j.id} {j.end}", highlight=False, markup=False, soft_wrap=True)
    for a in done.actions:
        if a.action in ("stop", "terminate"):
            what = f"{a.action} failed: {a.error}" if a.error else f"{a.action} ({a.why})"
            out.print(f"{name}: {what}", highlight=False, markup=False, soft_wrap=True)


@app.command("exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def exec_(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="machine"),
    command: list[str] = typer.Argument(..., help="the command, after --"),
    gpus: int = typer.Option(
        0, "--gpus", min=0, help="GPUs it needs: it waits until they are free (the run: all)"
    ),
) -> None:
    """Start another job on the machine, detached, with the experiment's env; prints its id
    (`provisioner logs NAME --job ID` shows its output). With --gpus N it waits its turn until
    N GPUs are free (CUDA_VISIBLE_DEVICES set to them): `provisioner queue NAME` lists it."""
    import shlex

    from provisioner.machines import gpuqueue

    application = get_app(ctx)
    text = command[0] if len(command) == 1 else shlex.join(command)
    job_id, started = gpuqueue.submit(application, name, text, gpus)
    out.print(job_id, highlight=False, markup=False)
    said = (
        f"started {job_id} on {name}: `provisioner logs {name} --job {job_id} -f`"
        if started
        else f"queued {job_id} on {name}: it starts when {gpus} GPUs are free "
        f"(`provisioner queue {name}`)"
    )
    err.print(said, highlight=False, markup=False, soft_wrap=True)


@app.command()
def queue(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="machine"),
    output: Output = OUTPUT,
) -> None:
    """The machine's jobs: running, ended (with their exit code) and queued for GPUs."""
    from provisioner.machines import gpuqueue

    rows = gpuqueue.listing(get_app(ctx), name)
    if output is Output.json:
        print_json({"jobs": [r.to_json() for r in rows]})
        return
    columns = [("job", "<", 0), ("state", "<", 0), ("gpus", "<", 1), ("command", "<", 2)]
    write(text_table(columns, [[r.job, r.state, r.gpus, r.command] for r in rows]))


@app.command()
def sync(ctx: typer.Context, name: str = typer.Argument(..., help="machine")) -> None:
    """Copy the experiment's workdir to its running machine again (rsync over SSH on a cloud,
    honouring .gitignore), where its jobs run."""
    from provisioner.machines import jobs

    count, how, workdir = jobs.sync(get_app(ctx), name)
    out.print(
        f"copied {count} files of {workdir} to {name} ({how})",
        highlight=False,
        markup=False,
        soft_wrap=True,  # a path is copied whole, not wrapped at 80 columns
    )
