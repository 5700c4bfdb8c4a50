"""dashboard: the team dashboard in a browser, served by waitress."""

from __future__ import annotations

import typer

from provisioner.cli import app, err, get_app


@app.command()
def dashboard(
    ctx: typer.Context,
    listen: str = typer.Option(
        None, help="host:port (default: dashboard.listen in settings, 127.0.0.1:8765)"
    ),
) -> None:
    """The fleet, spend against each budget, one machine's history and plans, in a browser.
    On loopback by default, where anyone on this computer may look; acting on a machine needs
    signing in with a personal token (`provisioner token create`) everywhere. Listening wider
    needs $PROVISIONER_DASHBOARD_TOKEN (or dashboard.token in settings) or personal tokens."""
    from provisioner.dashboard import is_loopback, make_app  # SQLAlchemy, Jinja2: not for --help
    from provisioner.errors import UserError

    application = get_app(ctx)
    cfg = application.settings.dashboard
    listen = listen or cfg.listen
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UserError(f"--listen {listen!r}: write host:port, e.g. 127.0.0.1:8765")
    if not is_loopback(host) and not cfg.secret and not _personal_access(application):
        raise UserError(
            f"--listen {listen}: reachable beyond this computer, so a token is required; "
            "set PROVISIONER_DASHBOARD_TOKEN (or dashboard.token in settings), or create "
            "personal ones (`provisioner token create`)"
        )
    application.db  # noqa: B018  (migrate, and fail on a bad state URL, before listening)
    wsgi = make_app(application, listen=listen).warm()
    from waitress.server import create_server

    try:
        server = create_server(wsgi, host=host, port=int(port), threads=4, ident="provisioner")
    except OSError as e:
        raise UserError(f"--listen {listen}: {e.strerror or e}") from None
    shown = f"[{host}]" if ":" in host else host
    bound = getattr(server, "effective_port", port)  # port 0: the one the system chose
    err.print(f"dashboard on http://{shown}:{bound}/ (Ctrl-C to stop)", highlight=False)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


def _personal_access(application: object) -> bool:
    """Whether anyone could log in without the shared token: a trusted proxy names users, or
    a personal token is live."""
    from pathlib import Path

    from provisioner import tokens

    settings = application.settings  # type: ignore[attr-defined]
    if settings.identity.trusted_proxies:
        return True
    url = settings.database_url
    if url.startswith("sqlite") and not Path(url.split("///", 1)[-1]).is_file():
        return False  # no state yet, so no token: and nothing is written to find that out
    return tokens.any_usable(application)  # type: ignore[arg-type]
