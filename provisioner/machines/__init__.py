"""A machine's life: ``launch`` (intent → attempts → adoption), ``actions`` (stop, start, down,
batched; waiting until ready) and ``reconcile`` (observations, orphans, gc), over ``record``
(events, transitions, one cloud call) and ``attempts`` (the typed launch attempt).

Callers use the names below; the modules are where to read each part."""

from provisioner.machines.actions import (
    DOWN_WAIT_SECONDS,
    Outcome,
    act_many,
    check_start,
    down,
    down_many,
    hold,
    restart,
    start,
    stop,
    stop_many,
    wait_ready,
)
from provisioner.machines.attempts import Blocklist, LaunchAttempt, launch_token
from provisioner.machines.launch import (
    Progress,
    UpResult,
    adopt,
    cancel_requested,
    check,
    refuse_by_policy,
    resource_name,
    up,
)
from provisioner.machines.reconcile import (
    Observation,
    Orphan,
    collect,
    orphans,
    reconcile,
    unused_network,
)
from provisioner.machines.record import (
    can_stop,
    disk_rate,
    find,
    find_to_act,
    provider_call,
    record_event,
    ref,
    transition,
)

__all__ = [
    "DOWN_WAIT_SECONDS",
    "Blocklist",
    "LaunchAttempt",
    "Observation",
    "Orphan",
    "Outcome",
    "Progress",
    "UpResult",
    "act_many",
    "adopt",
    "can_stop",
    "cancel_requested",
    "check",
    "check_start",
    "collect",
    "disk_rate",
    "down",
    "down_many",
    "find",
    "find_to_act",
    "hold",
    "launch_token",
    "orphans",
    "provider_call",
    "reconcile",
    "record_event",
    "ref",
    "refuse_by_policy",
    "resource_name",
    "restart",
    "start",
    "stop",
    "stop_many",
    "transition",
    "unused_network",
    "up",
    "wait_ready",
]
