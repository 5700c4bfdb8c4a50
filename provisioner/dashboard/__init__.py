"""The team dashboard: the fleet, the money against each budget and the idle waste, in a browser.
A WSGI application over the same state database as the CLI; ``provisioner dashboard`` serves it,
and the scheduler's daemon can mount it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from provisioner.dashboard.web import Dashboard
from provisioner.dashboard.wsgi import is_loopback

if TYPE_CHECKING:
    from provisioner.app import App

__all__ = ["Dashboard", "is_loopback", "make_app"]


def make_app(app: App, *, listen: str | None = None, token: str | None = None) -> Dashboard:
    """The dashboard's WSGI callable for ``app``. ``listen`` (``host:port``, default
    ``dashboard.listen`` in settings) says where it is reachable: on a loopback address anyone
    may look (acting needs a signed-in person everywhere); anywhere wider every request needs
    ``token`` (default: ``dashboard.token`` or ``$PROVISIONER_DASHBOARD_TOKEN``) or a
    personal one — with none set, every request is refused."""
    cfg = app.settings.dashboard
    host = (listen or cfg.listen).rpartition(":")[0] or "127.0.0.1"
    return Dashboard(app, token=token or cfg.secret, open_access=is_loopback(host), hosts=cfg.hosts)
