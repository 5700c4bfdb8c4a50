"""What a launch gives a machine at boot, put together once: the user's ``startup_script``,
with the agent and its guard on every machine (with its token when settings name the endpoint
agents report to, the cloud whose preemption notice it watches, what it does on one, the team's
pull key), and the volumes' mount script. The job supervisor is not in it: jobs are started over
SSH, and the first SSH call installs it (``machines/remote.py``), which keeps the agent and the
user's own script inside EC2's 16 KB (docs/LIMITS.md).

``up`` builds each launch's startup data here (``machines/launch.py``); ``plan`` and ``up``
measure the same data against each cloud's limit before anything is launched
(:mod:`provisioner.fits`). Nothing here loads the database or the agent's HTTP client, so
``plan`` stays light.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import providers
from provisioner import guard, startup
from provisioner.app import App
from provisioner.spec import Experiment

#: Stand-ins of the real length for a measure: a token (``secrets.token_urlsafe(32)``), a
#: machine id (``models.new_id``: a uuid4's hex) and the team's pull key (an ed25519 one).
SAMPLE_TOKEN = "t" * 43
SAMPLE_MACHINE = "m" * 32
SAMPLE_PULL_KEY = "ssh-ed25519 " + "A" * 68


def startup_for(
    app: App,
    experiment: Experiment,
    cloud: str,
    mounts: Sequence[tuple[str, str]],
    *,
    token: str | None = SAMPLE_TOKEN,
    machine_id: str = SAMPLE_MACHINE,
    ssh_user: str | None = None,
    pull_key: str | None = SAMPLE_PULL_KEY,
) -> str | None:
    """The startup data a launch of ``experiment`` on ``cloud`` sends, before the adapter puts
    it in the cloud's envelope: the agent and its guard (every machine), its ``token`` (when
    settings name an endpoint), the team's ``pull_key``, the ``mounts`` (device, path).
    ``ssh_user``: the adapter's (default: the cloud's spec)."""
    spec = providers.spec(cloud)
    if not app.settings.scheduler.endpoint_url:
        token = None
    user = ssh_user or spec.ssh_user
    data = startup_data(app, machine_id, experiment, token, cloud, user, pull_key)
    return startup.with_mounts(data, mounts, user)


def guard_of(app: App, machine_id: str, experiment: Experiment, user: str) -> dict[str, Any]:
    """The machine's own guard (the agent's ``guard.json``: :mod:`provisioner.guard`), from the
    experiment and the policies that match it: what the machine enforces by itself."""
    rules = guard.rules(experiment, app.policies)
    return guard.guard_doc(rules, machine_id, app.clock.now(), user)


def startup_data(
    app: App,
    machine_id: str,
    experiment: Experiment,
    token: str | None,
    cloud: str,
    user: str,
    pull_key: str | None,
) -> str:
    """The user's startup script, with the agent installed first on every machine: its
    ``guard.json``, the ``cloud`` whose preemption notice it watches and what it does on one
    (``lifecycle.on_preemption_notice``); with the scheduler's endpoint, its per-machine
    ``token`` for heartbeats; ``pull_key``: the team's, restricted to the agent's report."""
    sched = app.settings.scheduler
    notice = experiment.lifecycle.on_preemption_notice
    return startup.startup_data(
        experiment.startup_script,
        sched.endpoint_url,
        token,
        sched.agent_interval_seconds,
        machine_id,
        cloud=cloud,
        on_notice=notice.for_agent() if notice else None,
        guard=guard_of(app, machine_id, experiment, user),
        pull_key=pull_key,
        login_user=user,
    )
