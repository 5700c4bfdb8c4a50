"""Whether an experiment's startup data fits each cloud it may launch on, measured before
anything is launched or billed.

Each cloud declares what one launch may carry (``providers.<cloud>.LIMITS``; docs/LIMITS.md).
The startup data is built as the launch builds it (the agent, the supervisor, the volumes'
mount script, the preemption-notice action, the user's ``startup_script`` and the SSH key),
put in the cloud's envelope exactly as its adapter puts it (gzip-compressed cloud-init, or
text), and measured. A cloud it does not fit is dropped from the plan with the numbers; when
it fits none, ``plan`` and ``up`` refuse with one line (exit 2).
"""

from __future__ import annotations

import hashlib

import providers
from providers.limits import TooLarge, check_startup
from provisioner import boot
from provisioner.app import App
from provisioner.errors import UserError
from provisioner.planner import Plan
from provisioner.spec import Experiment

#: Stand-ins of the real length: an ed25519 public key with a comment, and a volume's device path
#: as long as any cloud names one (an AWS NVMe link: ``vol`` and the volume id's 17 hex digits,
#: each volume its own, as they compress); the token's is ``boot.SAMPLE_TOKEN``.
SAMPLE_TOKEN = boot.SAMPLE_TOKEN
SAMPLE_KEY = "ssh-ed25519 " + "A" * 68 + " someone@a-laptop-with-a-long-name.example.com"


def sample_device(i: int) -> str:
    """The ``i``-th volume's stand-in device path."""
    digits = hashlib.sha256(f"volume {i}".encode()).hexdigest()[:17]
    return f"/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol{digits}"


FIELD = "startup_script"


def too_large(app: App, experiment: Experiment, cloud: str) -> TooLarge | None:
    """What does not fit when ``experiment`` is launched on ``cloud``; None when it fits (or
    the cloud declares no limit)."""
    spec = providers.spec(cloud)
    limits = spec.limits
    if limits is None:
        return None
    mounts = [(sample_device(i), v.path) for i, v in enumerate(experiment.volumes)]
    data = boot.startup_for(app, experiment, cloud, mounts)  # as the launch builds it
    key = experiment.ssh_public_key or SAMPLE_KEY
    # the instance's other metadata (GCP, Yandex): its ssh-keys value and the few flags set
    other = len(f"ssh-keys{spec.ssh_user}:{key}") + 128
    return check_startup(cloud, limits, data, key, spec.ssh_user, other_metadata=other)


def drop_unfit(
    app: App,
    experiment: Experiment,
    plan: Plan,
    source: str | None = None,
) -> dict[str, TooLarge]:
    """Drop the candidates of each cloud the startup data does not fit, each counted in the
    plan's reasons with its numbers. When that leaves none, refuse (exit 2) with one line:
    the file and field, each cloud, the size and the limit. Returns what did not fit."""
    where = f"{source or experiment.name}: {FIELD}"
    found: dict[str, TooLarge] = {}
    for cloud in dict.fromkeys(c.offer.cloud for c in plan.candidates):
        if (big := too_large(app, experiment, cloud)) is not None:
            found[cloud] = big
    if not found:
        return found
    keep = []
    for c in plan.candidates:
        if (big := found.get(c.offer.cloud)) is not None:
            plan.reject(f"{where}: {big}", c.offer)
        else:
            keep.append(c)
    if not keep:
        clouds = "; ".join(_short(b) for b in found.values())
        raise UserError(f"{where}: the startup data fits no cloud offered: {clouds}")
    plan.candidates = keep
    return found


def _short(big: TooLarge) -> str:
    lim = big.limits
    if big.total:
        return (
            f"{big.cloud} {big.size:,} bytes of metadata, at most {lim.metadata_total_max:,} "
            f"({lim.startup_field} and the other keys)"
        )
    return f"{big.cloud} {big.size:,} bytes ({lim.headroom})"
