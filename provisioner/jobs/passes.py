"""What one pass of a job did to each machine, and why; and the stop or terminate it acts with.
Every action is an event on the machine, with its reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from provisioner import machines
from provisioner.app import App
from provisioner.errors import ProvisionerError

# event reasons the scheduler writes (reports and /metrics count them)
REASONS = (
    "off-hours-idle",
    "idle",
    "autostop",
    "max-lifetime",
    "preempted",
    "recovered",
    "on-finish",
)


@dataclass
class Action:
    machine: str
    action: str  # stop | terminate | start (in place) | relaunch | record | keep (left alone)
    reason: str
    why: str
    done: bool = False
    error: str | None = None
    idle_since: datetime | None = None  # start of the window proven idle (for idle waste)
    warn_minutes: int = 0  # the owner is mailed this long before the machine is acted on

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __str__(self) -> str:
        verb = {"keep": "left alone", "warn": "owner warned", "start": "start in place"}.get(
            self.action, self.action
        )
        state = "" if self.done or self.action == "keep" else " (dry run)"
        if self.error:
            state = f" FAILED: {self.error}"
        return f"{self.machine}: {verb} [{self.reason}] — {self.why}{state}"


@dataclass
class Pass:
    job: str
    leader: bool = True
    dry_run: bool = False
    actions: list[Action] = field(default_factory=list)
    checked: int = 0
    orphans: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""
    #: what the pass's pull of the machines' reports could not read, one line each: seen, not
    #: acted on (:mod:`provisioner.machines.pull`)
    pulls: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "leader": self.leader,
            "dry_run": self.dry_run,
            "checked": self.checked,
            "actions": [a.as_json() for a in self.actions],
            "orphans": self.orphans,
            "note": self.note,
            "pulls": self.pulls,
        }


def describe(result: Any) -> list[str]:
    """Lines for people: a pass's actions and orphans, or whatever a job returned."""
    if isinstance(result, Pass):
        if not result.leader:
            return [f"skipped: {result.note}"]
        lines = [str(a) for a in result.actions]
        lines += [f"orphan: {o['cloud']} {o['id']} ({o['name']})" for o in result.orphans]
        lines += result.pulls
        return lines + ([result.note] if result.note else [])  # a lease lost midway
    if isinstance(result, list):
        return [str(x) for x in result]
    return [] if result is None else [str(result)]


def act(app: App, action: Action) -> None:
    """Stop or terminate the action's machine; the outcome is written on the action."""
    fn = machines.stop if action.action == "stop" else machines.down
    try:
        detail = {"why": action.why}
        if action.idle_since is not None:
            detail["idle_since"] = action.idle_since.isoformat()
        _, changed = fn(app, action.machine, reason=action.reason, detail=detail)
        action.done = True
        if not changed:
            action.why += " (it already was)"
    except ProvisionerError as e:  # on the action: the daemon logs it, the CLI shows it
        action.error = str(e)
