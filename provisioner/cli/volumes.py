"""volume ls, volume rm: the network disks experiments keep per project and name."""

from __future__ import annotations

import typer

from provisioner.cli import OUTPUT, Output, app, get_app, out, print_json, text_table, write

volume_app = typer.Typer(
    help="Network disks kept per project and name (`volumes:` in an experiment file)."
)
app.add_typer(volume_app, name="volume")


@volume_app.command("ls")
def ls(
    ctx: typer.Context,
    project: str = typer.Option(None, "--project", help="only this project's volumes"),
    output: Output = OUTPUT,
) -> None:
    """Every volume: where it is, its size, the machine it is attached to, its rate and what
    it has cost so far (it bills from creation until `volume rm`)."""
    from provisioner.machines import volumes  # SQLAlchemy: not for --help

    listed = volumes.listing(get_app(ctx), project)
    if output is Output.json:
        print_json({"volumes": [v.as_json() for v in listed]})
        return
    if not listed:
        out.print("no volumes", soft_wrap=True)
        return
    rows = [
        [
            v.volume.name,
            v.volume.project,
            f"{v.volume.cloud}/{v.volume.zone or v.volume.region}",
            f"{v.volume.size_gb} GB",
            v.status,
            v.attached_to or "—",
            volumes.rate_text(v.volume),
            " + ".join(str(m) for m in v.spent) or "nothing yet",
        ]
        for v in listed
    ]
    columns = [
        ("name", "<", 0),
        ("project", "<", 1),
        ("where", "<", 2),
        ("size", ">", 3),
        ("status", "<", 0),
        ("attached to", "<", 4),
        ("rate", ">", 5),
        ("spent", ">", 0),
    ]
    write(text_table(columns, rows))


@volume_app.command("rm")
def rm(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="volume name"),
    project: str = typer.Option(None, "--project", help="the volume's project, if several"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask"),
    output: Output = OUTPUT,
) -> None:
    """Delete a volume and the data on it, in its cloud; its billing ends. Refused while a
    live machine has it attached."""
    from provisioner.cli.machines import _confirm
    from provisioner.machines import volumes  # SQLAlchemy: not for --help

    application = get_app(ctx)
    v = volumes.find(application, name, project)
    volumes.check_remove(application, v)  # before asking: a refusal is not a question
    if not yes:
        _confirm(
            f"delete volume {v.name} of project {v.project} ({v.size_gb} GB in {v.cloud} "
            f"{v.zone or v.region}) and every file on it?"
        )
    gone = volumes.remove(application, v)
    if output is Output.json:
        print_json({"deleted": gone.name, "project": gone.project, "volume_id": gone.volume_id})
        return
    out.print(
        f"[red]deleted[/] volume {gone.name} of project {gone.project} "
        f"({gone.volume_id or 'never created'}); its billing ended",
        highlight=False,
        soft_wrap=True,
    )
