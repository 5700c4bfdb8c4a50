"""logs and exec: the job's output (followed with :func:`provisioner.workflows.up.follow`, as
``up`` follows the experiment's ``run``), and another job beside it."""

from __future__ import annotations

import sys
from typing import Any

import typer

from provisioner.cli import app, err, get_app, out
from provisioner.schema import MachineStatus as S


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
) -> None:
    """The output of the machine's job (its experiment's `run`, or an `exec` job with --job),
    kept on the machine; with -f, followed until the job ends."""
    from provisioner.errors import ProvisionerError
    from provisioner.jobs import finish
    from provisioner.machines import jobs

    application = get_app(ctx)
    m = jobs.named(application, name)
    try:  # the end seen, the output read, then on_finish (it may stop a cloud machine)
        seen = jobs.check_ended(application, m)
    except ProvisionerError:
        seen = []  # could not ask: the output read below says why
    known = jobs.jobs_of(application, m)
    if job not in known:
        due = (m.spec or {}).get("run") and jobs.run_due(application, m, after_failure=False)
        if job == jobs.RUN and m.status in (S.PENDING, S.RUNNING) and due:
            raise _user_error(
                f"{m.name}'s run has not started: it starts once the machine answers SSH "
                "(the scheduler's reconcile pass starts it)"
            )
        have = ", ".join(known) or "none"
        raise _user_error(f"{m.name} has no job {job!r} (its jobs: {have})")
    data = jobs.output(application, m, job)
    finish.on_ended(application, m, seen)
    _stdout(tail(data, lines))
    ended = known[job]
    if follow_ and ended.running:
        from provisioner.workflows.up import follow  # SQLAlchemy: not for --help

        followed = follow(application, name, job, offset=len(data), write=_stdout)
        if followed is None:  # gone with its machine: nothing more to say of it
            return
        ended = followed
    if not ended.running:
        err.print(f"job {job}: {_end(ended)}", highlight=False, markup=False, soft_wrap=True)


def _end(job: Any) -> str:
    return f"exited {job.exit_code}" if job.exit_code is not None else "killed with its machine"


def _user_error(msg: str) -> Exception:
    from provisioner.errors import UserError

    return UserError(msg)


@app.command("exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def exec_(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="machine"),
    command: list[str] = typer.Argument(..., help="the command, after --"),
) -> None:
    """Start another job on the machine, detached, with the experiment's env; prints its id
    (`provisioner logs NAME --job ID` shows its output)."""
    import shlex

    from provisioner.machines import jobs

    application = get_app(ctx)
    text = command[0] if len(command) == 1 else shlex.join(command)
    job_id = jobs.exec_job(application, name, text)
    out.print(job_id, highlight=False, markup=False)
    err.print(
        f"started {job_id} on {name}: `provisioner logs {name} --job {job_id} -f`",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )


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
