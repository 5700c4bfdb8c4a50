"""What a machine is given at boot: the idle agent, installed as a service by the startup data
(beside the user's own script), and the per-machine token it signs with. Only the token's
SHA-256 is stored; the token itself travels once, in the startup data."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any

from providers.userdata import combine
from provisioner.pyshrink import shrink

if TYPE_CHECKING:
    from provisioner.app import App

AGENT_DIR = "/etc/provisioner"
AGENT_USER = "provisioner-agent"  # a system user: the token file is its own, mode 0600


def token_hash(token: str) -> str:
    """What is stored of a token, and the key its heartbeats are signed with."""
    from provisioner import agent  # its HTTP client: not for `plan`, which measures startups

    return agent.signing_key(token)


def issue_token(app: App, machine_id: str) -> str:
    """A fresh agent token for ``machine_id``; only its hash is kept."""
    from provisioner.state import machine as machine_row  # SQLAlchemy: not for `plan`

    token = secrets.token_urlsafe(32)
    with app.db.session() as s:
        machine_row(s, machine_id).agent_token_hash = token_hash(token)
    return token


def startup_data(
    user_script: str | None,
    endpoint: str,
    token: str,
    interval: int,
    machine_id: str,
    *,
    cloud: str | None = None,
    on_notice: dict[str, str] | None = None,
) -> str:
    """The machine's startup script: install the agent as a service (it never blocks or fails
    the boot), then run the user's own script unchanged. A ``#cloud-config`` user script is
    combined as a MIME multipart document, which cloud-init reads.

    ``cloud``: the agent watches that cloud's preemption notice; ``on_notice`` (the
    experiment's ``lifecycle.on_preemption_notice``) is what it then does to the job. The agent
    runs as root when there is one, as the job it signals does (the user's script runs as
    root); else as its own system user."""
    # without comments and docstrings (the same program): 16 KB is all EC2 takes
    agent_py = shrink(resources.files("provisioner").joinpath("agent.py").read_text("utf-8"))
    cmd = (
        f"/usr/bin/env python3 {AGENT_DIR}/agent.py --endpoint {_sh(endpoint)} "
        f"--machine {_sh(machine_id)} --token-file {AGENT_DIR}/agent-token "
        f"--interval {int(interval)}"
    )
    if cloud:
        cmd += f" --cloud {_sh(cloud)}"
    if on_notice:
        cmd += f" --on-notice-file {AGENT_DIR}/on-notice.json"
    install = _render_install(
        agent_dir=AGENT_DIR,
        token=token,
        agent_py=agent_py,
        cmd=cmd,
        user=AGENT_USER,
        on_notice=json.dumps(on_notice) if on_notice else "",
    )
    if not user_script:
        return install
    if user_script.lstrip().startswith("#cloud-config") or user_script.startswith("Content-Type:"):
        return combine(install, user_script) or install  # cloud-init runs the parts in order
    end = "PV_USER_SCRIPT_" + secrets.token_hex(6)
    script = user_script if user_script.startswith("#!") else "#!/bin/bash\n" + user_script
    return (
        f"{install}mkdir -p /var/lib/provisioner\n"
        f"cat > /var/lib/provisioner/startup <<'{end}'\n{script.rstrip()}\n{end}\n"
        "chmod 700 /var/lib/provisioner/startup\nexec /var/lib/provisioner/startup\n"
    )


SUPERVISOR_PATH = "/usr/local/bin/provisioner-job"  # where the startup data installs it


def supervisor_script() -> str:
    """``provisioner-job``: runs a job detached on a cloud machine, keeps its output and exit
    code (see :mod:`provisioner.machines.remote`)."""
    return resources.files("provisioner").joinpath("templates/provisioner-job.sh").read_text()


def supervisor_install() -> str:
    """The shell script (run as root at boot) that installs ``provisioner-job``."""
    body = supervisor_script()
    body = body if body.endswith("\n") else body + "\n"
    path = SUPERVISOR_PATH
    return (  # as text, not base64: the startup data is gzip-compressed (docs/LIMITS.md)
        "#!/bin/sh\n# provisioner-job: the supervisor of provisioner's jobs\n"
        f"cat > {path}.tmp <<'PV_JOB_EOF'\n{body}PV_JOB_EOF\n"
        f"chmod 0755 {path}.tmp && mv {path}.tmp {path}\n"
    )


def with_supervisor(data: str | None) -> str:
    """``data`` with ``provisioner-job`` installed first (as :func:`with_mounts` does)."""
    return _prepend(data, supervisor_install())


def mount_script(mounts: Sequence[tuple[str, str]], owner: str = "") -> str:
    """The shell script that mounts each volume: ``mounts`` are (device path the machine sees
    it at, mount path), in the order they are attached; ``owner`` (the login user) is given a
    disk it formats."""
    return _render(
        "templates/mount-volumes.sh",
        mounts=[(_sh(dev), _sh(path)) for dev, path in mounts],
        owner=_sh(owner),
    )


def with_mounts(data: str | None, mounts: Sequence[tuple[str, str]], owner: str = "") -> str | None:
    """``data`` (the startup data :func:`startup_data` made, or the user's script) with the
    volumes mounted first: inside a shell script, after its first line; beside a
    ``#cloud-config`` or MIME document, as the first part cloud-init runs."""
    if not mounts:
        return data
    return _prepend(data, mount_script(mounts, owner))


def _prepend(data: str | None, script: str) -> str:
    """``script`` run before ``data``: inside a shell script, after its first line; beside a
    ``#cloud-config`` or MIME document, as the first part cloud-init runs."""
    if not data:
        return script
    if not data.startswith("#!"):
        if data.lstrip().startswith("#cloud-config") or data.startswith("Content-Type:"):
            return combine(script, data) or script
        data = "#!/bin/bash\n" + data
    shebang, _, rest = data.partition("\n")
    body = script.partition("\n")[2]
    return f"{shebang}\n{body}{rest}"


def _render_install(**values: str) -> str:
    return _render("templates/agent-install.sh", **values)


def _render(name: str, **values: Any) -> str:
    from jinja2 import Environment, StrictUndefined  # only when a machine is launched

    template = resources.files("provisioner").joinpath(name)
    env = Environment(undefined=StrictUndefined, keep_trailing_newline=True, autoescape=False)
    return env.from_string(template.read_text(encoding="utf-8")).render(**values)


def _sh(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


# --- recording -------------------------------------------------------------------------------
