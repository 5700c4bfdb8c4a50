"""policy apply, diff, log, show: the team's rules in its PostgreSQL state (provisioner.team)."""

from __future__ import annotations

import typer

from provisioner.cli import OUTPUT, Output, app, err, get_app, out, print_json, text_table, write

policy_app = typer.Typer(
    help="The team's rules (policies, act_as, member map) in its PostgreSQL state."
)
app.add_typer(policy_app, name="policy")


@policy_app.command("apply")
def apply(
    ctx: typer.Context,
    note: str = typer.Option(None, "--note", help="why, kept with the version"),
) -> None:
    """Apply your policy files and identity.members/admins/scheduler as the team's rules: a
    new version (only an admin may), or "unchanged" when they are the rules in force."""
    from provisioner import team  # SQLAlchemy, pydantic: not for --help

    application = get_app(ctx)
    done = team.apply(
        application.db, application.settings, application.clock.now(), application.actor, note
    )
    if not done.changed:
        out.print(f"unchanged (version {done.version})")
        return
    out.print(
        f"applied version {done.version}: {done.members} members, {done.grants} act_as grants"
    )
    for role in done.missing:
        err.print(
            f"warning: no role {role} on the server: create it (CREATE ROLE {role} LOGIN) and "
            "apply again to grant it the state's tables",
            highlight=False,
        )


@policy_app.command("diff")
def diff(ctx: typer.Context) -> None:
    """Your policy files and identity settings against the team's rules in force, as a
    unified diff; exit 0: the same, 1: they differ."""
    from provisioner import team

    application = get_app(ctx)
    if not team.team_state(application.db):
        from provisioner.errors import UserError

        raise UserError(team.SQLITE)
    rules = team.newest(application.db)
    if rules is None:
        err.print(team.NOT_APPLIED, highlight=False)
    text = team.diff(application.settings, rules)
    if text:
        write(text.rstrip("\n"))
        raise typer.Exit(1)
    out.print(f"no difference with the team's rules (version {rules.version if rules else '-'})")


@policy_app.command("log")
def log(ctx: typer.Context, output: Output = OUTPUT) -> None:
    """Every version of the team's rules: who applied it, when, its digest and note."""
    from provisioner import team

    application = get_app(ctx)
    if not team.team_state(application.db):
        from provisioner.errors import UserError

        raise UserError(team.SQLITE)
    rows = team.history(application.db)
    if output is Output.json:
        print_json(
            [
                {
                    "version": r.version,
                    "applied_at": r.applied_at,
                    "applied_by": r.applied_by,
                    "role": r.role,
                    "digest": r.digest,
                    "note": r.note,
                }
                for r in rows
            ]
        )
        return
    if not rows:
        out.print(team.NOT_APPLIED, highlight=False)
        return
    columns = [("version", ">", 0), ("applied (UTC)", "<", 0), ("by", "<", 0), ("role", "<", 0)]
    columns += [("digest", "<", 0), ("note", "<", 0)]
    table = [
        [str(r.version), f"{r.applied_at:%Y-%m-%d %H:%M}", r.applied_by, r.role, r.digest[:12]]
        for r in rows
    ]
    for row, r in zip(table, rows, strict=True):
        row.append(r.note or "")
    write(text_table(columns, table))


@policy_app.command("show")
def show(
    ctx: typer.Context,
    version: int = typer.Argument(None, help="a version (default: the one in force)"),
) -> None:
    """One version of the team's rules as stored: its canonical document, indented."""
    import json

    from provisioner import team
    from provisioner.errors import UserError

    application = get_app(ctx)
    if not team.team_state(application.db):
        raise UserError(team.SQLITE)
    rules = team.newest(application.db, version)
    if rules is None:
        raise UserError(team.NOT_APPLIED)
    out.print(
        f"version {rules.version}, applied {rules.applied_at:%Y-%m-%d %H:%M} UTC by "
        f"{rules.applied_by} ({rules.role}), sha256 {rules.digest}",
        highlight=False,
    )
    write(json.dumps(rules.document, indent=2, sort_keys=True, ensure_ascii=False))
