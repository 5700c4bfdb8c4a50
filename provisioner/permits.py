"""Who may act on a machine (or a volume), and the words when they may not: one check for the
CLI, the workflows below it, the dashboard and the scheduler.

The rule is :func:`provisioner.identity.may_act`: the owner, the scheduler, or whom a policy
that applies to the machine's project and owner grants ``act_as`` that owner. Every operation
on one named machine (stop, start, down, exec, logs, sync, ssh, keep, autostop) and ``volume
rm`` checks it where the operation is done (:mod:`provisioner.machines`, :mod:`provisioner.jobs`),
so each caller meets it; a refusal is :class:`NotOwner` (exit 2) in the dashboard's own words
(``dash_do_forbidden``). Machines chosen by what they are (``--all``, ``--project``, the ssh
config) are only those the actor may act on (:func:`sort_out`). Looking — ``status``,
``events``, ``report``, the fleet pages — stays open to every member."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, TypeVar

from provisioner.errors import UserError
from provisioner.identity import may_act
from provisioner.words import messages

if TYPE_CHECKING:
    from policies.schema import Policy
    from provisioner.app import App

__all__ = ["NotOwner", "check", "check_may_act", "may_act", "refusal", "sort_out"]

#: the message ids of a refusal: over a machine (the dashboard's words), over a volume
MACHINE = "dash_do_forbidden"
VOLUME = "volume_forbidden"


class Owned(Protocol):
    """A row with an owner and a project: a machine or a volume."""

    @property
    def owner(self) -> str: ...

    @property
    def project(self) -> str: ...


_R = TypeVar("_R", bound=Owned)


def refusal(who: str, owner: str | None, language: str = "en", key: str = MACHINE) -> str:
    """The words of a refusal in ``language``: ``who`` is not the owner and has no ``act_as``."""
    return messages(language)[key].format(who=who, owner=owner or "?")


class NotOwner(UserError):
    """``who`` may not act on ``what`` (a machine's or volume's name), owned by ``owner``:
    exit 2, ``what: <the words>``."""

    def __init__(self, what: str, who: str, owner: str, key: str = MACHINE) -> None:
        self.what, self.who, self.owner, self.key = what, who, owner, key
        super().__init__(f"{what}: {self.words()}")

    def words(self, language: str = "en") -> str:
        return refusal(self.who, self.owner, language, self.key)


def check_may_act(
    policies: list[Policy], who: str, owner: str, project: str, what: str, key: str = MACHINE
) -> None:
    """Refuse (:class:`NotOwner`, exit 2) unless ``who`` may act for ``owner`` in
    ``project``; ``what`` names the machine or volume in the words."""
    if not may_act(policies, who, owner, project):
        raise NotOwner(what, who, owner, key)


def check(app: App, row: Owned, what: str, key: str = MACHINE) -> None:
    """Refuse unless who acts in this app (its actor, or a dashboard request's user) may act
    on ``row`` (a machine or volume named ``what``)."""
    check_may_act(app.policies, app.actor, row.owner, row.project, what, key)


def sort_out(app: App, rows: Iterable[_R]) -> tuple[list[_R], int]:
    """The rows who acts may act on, in their order, and how many of others' were left out."""
    mine, others = [], 0
    policies, who = app.policies, app.actor
    for r in rows:
        if may_act(policies, who, r.owner, r.project):
            mine.append(r)
        else:
            others += 1
    return mine, others


def left_out(count: int, verb: str = "act on") -> str | None:
    """One line saying ``count`` machines of others were left out (None: none were)."""
    if not count:
        return None
    what = "1 machine" if count == 1 else f"{count} machines"
    return (
        f"left out {what} of other owners: you may {verb} only yours and those a policy "
        "grants you act_as over"
    )
