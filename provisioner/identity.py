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
from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from policies.schema import matching
from provisioner.errors import UserError

if TYPE_CHECKING:
    from policies.schema import Policy
    from provisioner.settings import Settings
    from provisioner.spec import Experiment
    from provisioner.state import Database

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


def database_role(db: Database) -> str:
    """The PostgreSQL role this process connects as (cached per database URL)."""
    if db.url not in _roles:
        from sqlalchemy import text

        with db.engine.connect() as conn:
            _roles[db.url] = str(conn.execute(text("SELECT current_user")).scalar())
    return _roles[db.url]


def email_of(settings: Settings, name: str) -> str:
    """The e-mail of a database role or OS user ``name`` (``identity.members``, else
    ``<name>@<identity.domain>``)."""
    ident = settings.identity
    return ident.members.get(name) or f"{name}@{ident.domain}"


def actor(settings: Settings, db: Callable[[], Database]) -> str:
    """The e-mail of who runs this process (see the module's doc); ``db`` is asked only on
    PostgreSQL."""
    if settings.database_url.startswith("postgresql"):
        return email_of(settings, database_role(db()))
    return email_of(settings, os_user())


def grants(policies: list[Policy], who: str, owner: str) -> bool:
    """Whether one of ``policies`` lets ``who`` act as ``owner`` (``act_as``)."""
    for p in policies:
        for actor_glob, owners in p.act_as.items():
            if fnmatchcase(who, actor_glob) and any(fnmatchcase(owner, o) for o in owners):
                return True
    return False


def may_act(policies: list[Policy], who: str, owner: str, project: str) -> bool:
    """Whether ``who`` may act for ``owner`` in ``project`` — launch for them, or act on their
    machine or volume: they are the owner, or the scheduler, or a policy that applies to the
    project and owner grants them ``act_as`` that owner. The one rule of the CLI, the
    workflows below it and the dashboard (:mod:`provisioner.permits` says the refusal)."""
    if who in (owner, SCHEDULER):
        return True
    return grants(matching(policies, project, owner), who, owner)


def may_act_as(policies: list[Policy], experiment: Experiment, who: str) -> bool:
    """Whether ``who`` may launch ``experiment`` for its owner (:func:`may_act`)."""
    return may_act(policies, who, experiment.owner, experiment.project)


def check_owner(policies: list[Policy], experiment: Experiment, who: str) -> None:
    """Refuse (exit 2) a launch for an owner who is not the actor, unless ``act_as`` grants it."""
    if not may_act_as(policies, experiment, who):
        raise UserError(
            f"{experiment.name}: owner {experiment.owner} is not you ({who}); launching for "
            "someone else needs a policy's act_as (e.g. act_as: {" + who + ": ['*']}), or "
            "leave owner out of the file"
        )
