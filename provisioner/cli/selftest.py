"""selftest: one small real run on a cloud, to check the guard works there."""

from __future__ import annotations

import typer

from provisioner.cli import OUTPUT, Output, app, err, get_app, out, print_json


@app.command("selftest")
def selftest(
    ctx: typer.Context,
    cloud: str = typer.Option(..., "--cloud", help="the cloud to check (its credentials are used)"),
    job_seconds: int = typer.Option(60, "--job-seconds", min=1, max=600, help="the job's length"),
    timeout: str = typer.Option("15m", "--timeout", help="how long the whole run may take"),
    output: Output = OUTPUT,
) -> None:
    """Launch the cloud's cheapest machine with a volume and a one-minute job, and check what a
    team relies on: the agent is heard, the job's end is recorded, the machine stops itself
    (the cloud dates the stop), the instance carries the billing tag. Everything it made is
    removed, also when interrupted; it prints what it cost. Exit 1 when a check fails."""
    from policies.duration import parse_duration  # pydantic: not for --help
    from provisioner import selftest as selftesting  # SQLAlchemy: not for --help
    from provisioner.errors import UserError

    try:
        limit = parse_duration(timeout)
    except ValueError as e:
        raise UserError(f"--timeout: {e}") from None
    application = get_app(ctx)
    quiet = output is Output.json
    say = (lambda _: None) if quiet else (lambda m: err.print(m, highlight=False, markup=False))
    result = selftesting.run(application, cloud, job_seconds=job_seconds, timeout=limit, say=say)
    cost = ", ".join(str(m.rounded()) for m in result.cost) or "nothing"
    if quiet:
        print_json(
            {
                "cloud": result.cloud,
                "machine": result.name,
                "ok": result.ok,
                "checks": [c.__dict__ for c in result.checks],
                "cost": result.cost,
                "left": result.left,
            }
        )
    else:
        out.print(f"selftest {cloud}: {'passed' if result.ok else 'FAILED'}; it cost {cost}")
        for command in result.left:
            out.print(f"  left behind: run `{command}`", markup=False)
    if not result.ok:
        raise typer.Exit(1)
