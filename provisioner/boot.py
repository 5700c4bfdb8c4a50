"""What a launch gives a machine at boot, put together once: the user's ``startup_script``,
with the idle agent (its token and endpoint, the cloud whose preemption notice it watches, what
it does on one) when settings name the endpoint agents report to, the job supervisor when the
experiment runs a job on a cloud that runs jobs over SSH, and the volumes' mount script.

``up`` builds each launch's startup data here (``machines/launch.py``); ``plan`` and ``up``
measure the same data against each cloud's limit before anything is launched
(:mod:`provisioner.fits`). Nothing here loads the database or the agent's HTTP client, so
``plan`` stays light.
"""

from __future__ import annotations

from collections.abc import Sequence

import providers
from provisioner import startup
from provisioner.app import App
from provisioner.spec import Experiment

#: Stand-ins of the real length for a measure: a token (``secrets.token_urlsafe(32)``) and a
#: machine id (``models.new_id``: a uuid4's hex).
SAMPLE_TOKEN = "t" * 43
SAMPLE_MACHINE = "m" * 32


def startup_for(
    app: App,
    experiment: Experiment,
    cloud: str,
    mounts: Sequence[tuple[str, str]],
    *,
    token: str | None = SAMPLE_TOKEN,
    machine_id: str = SAMPLE_MACHINE,
    ssh_user: str | None = None,
    runs_jobs: bool | None = None,
) -> str | None:
    """The startup data a launch of ``experiment`` on ``cloud`` sends, before the adapter puts
    it in the cloud's envelope: the agent with its ``token`` (when settings name an endpoint),
    the supervisor, the ``mounts`` (device, path). ``ssh_user`` and ``runs_jobs``: the
    adapter's (default: the cloud's spec; only the simulated sandbox runs jobs itself)."""
    spec = providers.spec(cloud)
    if not app.settings.scheduler.endpoint_url:
        token = None
    data = with_supervisor(
        app,
        experiment,
        cloud,
        token,
        machine_id,
        runs_jobs=spec.simulated if runs_jobs is None else runs_jobs,
    )
    return startup.with_mounts(data, mounts, ssh_user or spec.ssh_user)


def startup_data(
    app: App, machine_id: str, experiment: Experiment, token: str | None, cloud: str
) -> str | None:
    """The user's startup script, with the idle agent added when settings name the endpoint
    agents report to: its per-machine ``token``, the ``cloud`` whose preemption notice it
    watches, and what it does on one (``lifecycle.on_preemption_notice``)."""
    sched = app.settings.scheduler
    if token is None or not sched.endpoint_url:
        return experiment.startup_script
    notice = experiment.lifecycle.on_preemption_notice
    return startup.startup_data(
        experiment.startup_script,
        sched.endpoint_url,
        token,
        sched.agent_interval_seconds,
        machine_id,
        cloud=cloud,
        on_notice=notice.for_agent() if notice else None,
    )


def with_supervisor(
    app: App,
    experiment: Experiment,
    cloud: str,
    token: str | None,
    machine_id: str,
    *,
    runs_jobs: bool | None = None,
) -> str | None:
    """The startup data, with ``provisioner-job`` installed first when the experiment runs a
    job on a cloud that runs it over SSH (the sandbox runs jobs itself; ``runs_jobs`` None:
    ask the cloud's adapter)."""
    data = startup_data(app, machine_id, experiment, token, cloud)
    wants = experiment.run or experiment.setup or experiment.workdir
    if runs_jobs is None and wants:
        runs_jobs = app.provider(cloud).runs_jobs
    if not wants or runs_jobs:
        return data
    return startup.with_supervisor(data)
