"""Who runs provisioner (the *actor*), and whom they may launch for.

- On PostgreSQL the actor is the database role of the connection (``SELECT current_user``):
  each member of a team connects as their own role, which the server authenticates.
- On SQLite (one user's state file) it is the OS user of this process (its effective uid).
- ``identity.members`` in settings maps either name to an e-mail; an unmapped name is
  ``<name>@<identity.domain>`` (default ``localhost``).
- The scheduler's own actions are the actor ``scheduler``.

An experiment's ``owner`` is the actor unless a policy that applies to it grants ``act_as``
(:func:`check_owner`); a file without ``owner`` belongs to the actor.
"""

from __future__ import annotations

import os
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from policies.schema import matching
from provisioner.errors import UserError

if TYPE_CHECKING:
    from provisioner.app import App
    from provisioner.settings import Settings
    from provisioner.spec import Experiment

#: the actor of what the scheduler does on its own (sweeps, relaunches, budget stops)
SCHEDULER = "scheduler"

_roles: dict[str, str] = {}  # database URL → role: one query per process


def os_user() -> str:
    """The OS user this process runs as (its effective uid; $USER can be set to anything)."""
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a uid with no passwd entry (some containers)
        return f"uid{os.geteuid()}"


def database_role(app: App) -> str:
    """The PostgreSQL role this process connects as (cached per database URL)."""
    url = app.settings.database_url
    if url not in _roles:
        from sqlalchemy import text

        with app.db.engine.connect() as conn:
            _roles[url] = str(conn.execute(text("SELECT current_user")).scalar())
    return _roles[url]


def email_of(settings: Settings, name: str) -> str:
    """The e-mail of a database role or OS user ``name`` (``identity.members``, else
    ``<name>@<identity.domain>``)."""
    ident = settings.identity
    return ident.members.get(name) or f"{name}@{ident.domain}"


def actor(app: App) -> str:
    """The e-mail of who runs this process (see the module's doc)."""
    if app.settings.database_url.startswith("postgresql"):
        return email_of(app.settings, database_role(app))
    return email_of(app.settings, os_user())


def may_act_as(app: App, experiment: Experiment, who: str) -> bool:
    """Whether ``who`` may launch ``experiment`` for its owner: they are its owner, or a
    policy that applies to the experiment grants them ``act_as`` that owner."""
    owner = experiment.owner
    if who in (owner, SCHEDULER):
        return True
    for p in matching(app.policies, experiment.project, owner):
        for actor_glob, owners in p.act_as.items():
            if fnmatchcase(who, actor_glob) and any(fnmatchcase(owner, o) for o in owners):
                return True
    return False


def check_owner(app: App, experiment: Experiment) -> None:
    """Refuse (exit 2) a launch for an owner who is not the actor, unless ``act_as`` grants it."""
    who = app.actor
    if not may_act_as(app, experiment, who):
        raise UserError(
            f"{experiment.name}: owner {experiment.owner} is not you ({who}); launching for "
            "someone else needs a policy's act_as (e.g. act_as: {" + who + ": ['*']}), or "
            "leave owner out of the file"
        )
