"""EC2's instances as the contract's :class:`~providers.base.Instance`: states, a spot
interruption as a preemption, when a stop happened (from StateTransitionReason's text), and
timestamps parsed fast."""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from providers.aws.volumes import TAG_TOKEN
from providers.base import Instance, MachineState

PREEMPTION_REASONS = frozenset({"Server.SpotInstanceTermination", "Server.SpotInstanceShutdown"})
_STATES = {
    "pending": MachineState.PENDING,
    "running": MachineState.RUNNING,
    "stopping": MachineState.STOPPING,
    "stopped": MachineState.STOPPED,
    "shutting-down": MachineState.TERMINATED,  # cannot come back; billing has ended
    "terminated": MachineState.TERMINATED,
}
STOPPED_OR_GONE = ("stopping", "stopped", "shutting-down", "terminated")
_HALTED = (MachineState.STOPPING, MachineState.STOPPED, MachineState.TERMINATED)


def instances_of(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [raw for res in response.get("Reservations", []) for raw in res.get("Instances", [])]


def instance_of(raw: Mapping[str, Any], region: str, zone: str) -> Instance:
    tags = {t["Key"]: t["Value"] for t in raw.get("Tags", [])}
    spot = raw.get("InstanceLifecycle") == "spot"
    code, reason = _state_reason(raw)
    state = _STATES.get(raw["State"]["Name"], MachineState.PENDING)
    if spot and code in PREEMPTION_REASONS and state in _HALTED:
        state = MachineState.PREEMPTED
    return Instance(
        id=raw["InstanceId"],
        name=tags.get("Name", ""),
        region=region,
        zone=zone,
        instance_type=raw["InstanceType"],
        state=state,
        spot=spot,
        labels={k: v for k, v in tags.items() if k not in ("Name", TAG_TOKEN)},
        public_ip=raw.get("PublicIpAddress"),
        private_ip=raw.get("PrivateIpAddress"),
        launched_at=raw.get("LaunchTime"),
        state_reason=reason,
        stopped_at=_transition_time(raw.get("StateTransitionReason") or ""),
    )


def _state_reason(raw: Mapping[str, Any]) -> tuple[str, str | None]:
    """StateReason's code, and the reason said: it with its message, else the transition's."""
    reason = raw.get("StateReason") or {}
    code, message = reason.get("Code") or "", reason.get("Message") or ""
    if message and not message.startswith(code):
        message = f"{code}: {message}" if code else message
    return code, message or code or raw.get("StateTransitionReason") or None


# StateTransitionReason ("The reason for the most recent state transition", botocore's ec2
# model, Instance) is text, and EC2 dates a stop or terminate in it: "User initiated
# (2020-03-05 04:45:19 GMT)" for a user's, "Service initiated (… GMT)" for EC2's own, a spot
# interruption among them (its code is in StateReason). moto writes "UTC" for "GMT".
_TRANSITION_TIME = re.compile(r"\((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) (?:GMT|UTC)\)")


def parse_timestamp(value: Any) -> datetime:
    """A response's timestamp: ISO 8601 with its zone (what EC2 sends) by the standard
    library; anything else by botocore's parser (dateutil: ~40 µs each, three per instance, so
    0.11 s of a 1,000-machine sweep's listing)."""
    if isinstance(value, str):
        try:
            at = datetime.fromisoformat(value)
        except ValueError:
            pass
        else:
            if at.tzinfo is not None:
                return at
    from botocore.utils import parse_timestamp as botocore_parse

    return botocore_parse(value)


def _transition_time(reason: str) -> datetime | None:
    """When the last state transition happened, from StateTransitionReason's text."""
    m = _TRANSITION_TIME.search(reason)
    return datetime.fromisoformat(m[1]).replace(tzinfo=UTC) if m else None
