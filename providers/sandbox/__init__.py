"""The sandbox cloud: a simulated cloud behind the same contract as the real adapters
(:mod:`providers.sandbox.adapter`). It is declared exactly as a real cloud is: a folder, a spec
with typed options, one registry line, its catalog rows (``provisioner/data/catalog``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from providers.spec import (
    STOPS,
    Capabilities,
    CloudSpec,
    Count,
    GuestShutdown,
    Name,
    Options,
    Seconds,
    Wait,
)


class SandboxOptions(Options):
    """Faults set here hold from the start; :meth:`SandboxProvider.inject` changes them at run
    time for every process sharing the sandbox."""

    db_path: Name | None = None  # its own SQLite file; default: in the provisioner home
    latency_seconds: float = Field(0.3, ge=0, le=60)  # per call
    capacity: dict[Name, Count] = Field(default_factory=dict)  # {zone: machines it can hold}
    quota_gpus: dict[Name, Count] = Field(default_factory=dict)  # {region: GPUs}
    throttle: Count = 0  # the next N calls are throttled
    auth_fail: bool = False
    preempt_after_seconds: Seconds | None = None  # spot machines older than this are preempted
    # Where its machines answer SSH, and as whom: by default a TEST-NET-2 address that never
    # routes; 127.0.0.1 and the current user let a real sshd on loopback stand in for one.
    public_ip: Name | None = None
    ssh_port: int = Field(22, ge=1, le=65535)
    ssh_user: Name | None = None
    # Each machine runs the agent a cloud machine runs (provisioner/agent.py, as a process):
    # its guard stops the machine from inside (autostop, on_finish, max lifetime) with no
    # command run. ``agent_path`` names another agent file (a test's stand-in).
    agent: bool = True
    agent_interval_seconds: Seconds = 5.0
    agent_path: Name | None = None
    retry_base_seconds: Wait = 0.05
    retry_max_seconds: Wait = 0.5

    def in_home(self, home: Path) -> SandboxOptions:
        """Its machines in ``sandbox.db`` of the home, unless ``db_path`` says where."""
        return (
            self if self.db_path else self.model_copy(update={"db_path": str(home / "sandbox.db")})
        )


SPEC = CloudSpec(
    name="sandbox",
    title="Sandbox (simulated)",
    currency="USD",  # its sandbox-ru region prices in RUB, to exercise conversion
    options=SandboxOptions,
    adapter="providers.sandbox.adapter:SandboxProvider",
    ssh_user="provisioner",
    extra=None,
    sdk=(),
    capabilities=Capabilities(
        stop_spot=True,
        cap_spot_price=True,
        zones=True,
        batch=False,
        why={"batch": "sandbox: it simulates one machine per call, as most clouds act"},
    ),
    simulated=True,
    prices_from="its own fixed price list",
    # the sandbox's machines stop when their agent powers them off (the guard simulated)
    guest_shutdown=GuestShutdown(STOPS, STOPS, "simulated: the sandbox marks the machine stopped"),
)
