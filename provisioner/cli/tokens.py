"""token create, token list, token revoke: personal tokens for the dashboard."""

from __future__ import annotations

from typing import Any

import typer

from provisioner.cli import OUTPUT, Output, app, get_app, out, print_json, text_table, write

token_app = typer.Typer(help="Personal tokens: how the dashboard knows who you are.")
app.add_typer(token_app, name="token")


@token_app.command("create")
def create(
    ctx: typer.Context,
    user: str = typer.Option(None, "--user", help="whose token (default: you)"),
    expires: str = typer.Option(None, "--expires", help="e.g. 90d, 12h (default: never)"),
    output: Output = OUTPUT,
) -> None:
    """Print a new personal token once (only its salted hash is kept): the dashboard takes it
    as `Authorization: Bearer <token>` or on its login page."""
    from policies.duration import parse_duration  # pydantic: not for --help
    from provisioner import tokens  # SQLAlchemy: not for --help
    from provisioner.errors import UserError

    application = get_app(ctx)
    try:
        life = parse_duration(expires) if expires is not None else None
    except ValueError as e:
        raise UserError(f"--expires: {e}") from None
    if life is not None and life.total_seconds() < 60:  # 0s would read as "never"
        raise UserError(f"--expires {expires!r}: give a lifetime of a minute or more (e.g. 90d)")
    issued = tokens.create(application, user or application.actor, life)
    if output is Output.json:
        print_json(
            {
                "id": issued.id,
                "user": issued.user,
                "token": issued.token,
                "expires_at": issued.expires_at,
            }
        )
        return
    until = f"until {issued.expires_at:%Y-%m-%d %H:%M} UTC" if issued.expires_at else "no expiry"
    out.print(f"token {issued.id} for {issued.user} ({until}); shown once, keep it secret:")
    print(issued.token)


@token_app.command("list")
def listing(ctx: typer.Context, output: Output = OUTPUT) -> None:
    """Every token: its id, user, who created it, when it expires or was revoked (never the
    token itself)."""
    from provisioner import tokens

    application = get_app(ctx)
    rows = tokens.listing(application)
    if output is Output.json:
        print_json(
            [
                {
                    "id": t.id,
                    "user": t.user,
                    "created_at": t.created_at,
                    "created_by": t.created_by,
                    "expires_at": t.expires_at,
                    "revoked_at": t.revoked_at,
                    "usable": tokens.usable(application, t),
                }
                for t in rows
            ]
        )
        return
    if not rows:
        out.print("no tokens (`provisioner token create` makes one)")
        return

    def state(t: Any) -> str:
        if t.revoked_at is not None:
            return f"revoked {t.revoked_at:%Y-%m-%d %H:%M}"
        if t.expires_at is None:
            return "no expiry"
        word = "expires" if tokens.usable(application, t) else "expired"
        return f"{word} {t.expires_at:%Y-%m-%d %H:%M}"

    columns = [("id", "<", 0), ("user", "<", 0), ("created (UTC)", "<", 0), ("by", "<", 0)]
    columns.append(("state (UTC)", "<", 0))
    table = [[t.id, t.user, f"{t.created_at:%Y-%m-%d %H:%M}", t.created_by, state(t)] for t in rows]
    write(text_table(columns, table))


@token_app.command("revoke")
def revoke(ctx: typer.Context, token_id: str = typer.Argument(..., help="the token's id")) -> None:
    """End a token now, and every dashboard session opened with it."""
    from provisioner import tokens

    application = get_app(ctx)
    t = tokens.revoke(application, token_id)
    out.print(f"token {t.id} of {t.user} revoked")
