"""What a machine is given at boot: the idle agent, installed as a service by the startup data
(beside the user's own script), and the per-machine token it signs with. Only the token's
SHA-256 is stored; the token itself travels once, in the startup data."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import secrets
from collections.abc import Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any

from providers.userdata import combine
from provisioner.pyshrink import shrink

if TYPE_CHECKING:
    from provisioner.app import App

AGENT_DIR = "/etc/provisioner"  # secrets only (the heartbeat token): 0700
AGENT_LIB = "/usr/local/lib/provisioner"  # agent.py and agent_guard.py, side by side
AGENT_BIN = "/usr/local/bin/provisioner-agent"  # a link to agent.py (a #!/usr/bin/env python3)
STATE_DIR = "/var/lib/provisioner/agent"  # guard.json, samples.jsonl, stop.json: 0755, no secrets
PULL_COMMENT = "provisioner-pull"


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


@functools.cache
def agent_sources(cloud: str | None = None) -> dict[str, str]:
    """The agent's two files as a machine on ``cloud`` gets them: the same program, shrunk
    (:mod:`provisioner.pyshrink`: the startup data has each cloud's size limit to fit in),
    without the preemption-notice watchers of the other clouds (``@watcher("gcp")``…)."""
    out = {}
    for name in ("agent.py", "agent_guard.py"):
        text = resources.files("provisioner").joinpath(name).read_text(encoding="utf-8")
        body = shrink(text, _other_watchers(text, cloud)).rstrip("\n")
        out[name] = (body if body.startswith("#!") else "#!/usr/bin/env python3\n" + body) + "\n"
    return out


def _other_watchers(source: str, cloud: str | None) -> set[str]:
    """The top-level classes registered with ``@watcher(CLOUD)`` for a cloud but ``cloud``."""
    import ast

    out = set()
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for d in node.decorator_list:
            if (
                isinstance(d, ast.Call)
                and isinstance(d.func, ast.Name)
                and d.func.id == "watcher"
                and [a.value for a in d.args if isinstance(a, ast.Constant)] != [cloud]
            ):
                out.add(node.name)
    return out


def pull_line(public_key: str) -> str:
    """The ``authorized_keys`` line of the team's pull key: it may run the agent's report and
    nothing else (no shell, no forwarding, no pty)."""
    kind, _, rest = public_key.strip().partition(" ")
    body = rest.split(" ", 1)[0]  # type and base64: its own comment dropped
    if not (
        re.fullmatch(r"[a-z0-9-]+(@openssh\.com)?", kind)
        and re.fullmatch(r"[A-Za-z0-9+/]+=*", body)
    ):
        raise ValueError("pull key: expected an OpenSSH public key (type base64 [comment])")
    return f'restrict,command="{AGENT_BIN} --report" {kind} {body} {PULL_COMMENT}'


def startup_data(
    user_script: str | None,
    endpoint: str | None,
    token: str | None,
    interval: int,
    machine_id: str,
    *,
    cloud: str | None = None,
    on_notice: dict[str, str] | None = None,
    guard: dict[str, Any] | None = None,
    pull_key: str | None = None,
    login_user: str = "",
) -> str:
    """The machine's startup script: install the agent as a service (it never blocks or fails
    the boot), then run the user's own script unchanged. A ``#cloud-config`` user script is
    combined as a MIME multipart document, which cloud-init reads.

    The agent runs on every machine, as root (it powers the machine off and reads the login
    user's jobs): ``guard`` is its ``guard.json``; with an ``endpoint`` it also sends signed
    heartbeats with ``token`` (kept in /etc/provisioner, 0700). ``cloud``: it watches that
    cloud's preemption notice; ``on_notice`` (``lifecycle.on_preemption_notice``) is what it then
    does to the job. ``pull_key``: the team's pull public key, put in ``login_user``'s
    authorized_keys restricted to ``provisioner-agent --report``."""
    cmd = f"{AGENT_BIN} --state-dir {STATE_DIR} --interval {int(interval)}"
    if endpoint and token:
        cmd += (
            f" --endpoint {_sh(endpoint)} --machine {_sh(machine_id)}"
            f" --token-file {AGENT_DIR}/agent-token"
        )
    if cloud:
        cmd += f" --cloud {_sh(cloud)}"
    if on_notice:
        cmd += f" --on-notice-file {AGENT_DIR}/on-notice.json"
    install = _render_install(
        agent_dir=AGENT_DIR,
        lib=AGENT_LIB,
        bin=AGENT_BIN,
        state_dir=STATE_DIR,
        sources=agent_sources(cloud),
        token=token if endpoint and token else "",
        guard=json.dumps(guard, sort_keys=True) if guard else "",
        cmd=cmd,
        on_notice=json.dumps(on_notice) if on_notice else "",
        user=_sh(login_user) if pull_key and login_user else "",
        pull=_sh(pull_line(pull_key)) if pull_key and login_user else "",
    )
    if not user_script:
        return install
    if user_script.lstrip().startswith("#cloud-config") or user_script.startswith("Content-Type:"):
        return combine(install, user_script) or install  # cloud-init runs the parts in order
    script = user_script if user_script.startswith("#!") else "#!/bin/bash\n" + user_script
    # the heredoc's end from the script's own digest (a script cannot hold its own digest), so
    # the same startup makes the same bytes: what `plan` measured is what the cloud gets
    end = "PV_USER_SCRIPT_" + hashlib.sha256(script.encode()).hexdigest()[:12]
    return (
        f"{install}mkdir -p /var/lib/provisioner\n"
        f"cat > /var/lib/provisioner/startup <<'{end}'\n{script.rstrip()}\n{end}\n"
        "chmod 700 /var/lib/provisioner/startup\nexec /var/lib/provisioner/startup\n"
    )


#: where startup data once installed the job supervisor; machines launched since get it from the
#: first SSH call (``machines/remote.py``), which looks here first
SUPERVISOR_PATH = "/usr/local/bin/provisioner-job"


def supervisor_script() -> str:
    """``provisioner-job``: runs a job detached on a cloud machine, keeps its output and exit
    code (see :mod:`provisioner.machines.remote`)."""
    return resources.files("provisioner").joinpath("templates/provisioner-job.sh").read_text()


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
    script = mount_script(mounts, owner)
    if not data:
        return script
    if not data.startswith("#!"):
        if data.lstrip().startswith("#cloud-config") or data.startswith("Content-Type:"):
            return combine(script, data) or script
        data = "#!/bin/bash\n" + data
    shebang, _, rest = data.partition("\n")
    body = script.partition("\n")[2]
    return f"{shebang}\n{body}{rest}"


def _render_install(**values: Any) -> str:
    return _render("templates/agent-install.sh", **values)


def _render(name: str, **values: Any) -> str:
    return _template(name).render(**values)


@functools.cache
def _template(name: str) -> Any:
    from jinja2 import Environment, StrictUndefined  # only when a machine is launched

    template = resources.files("provisioner").joinpath(name)
    env = Environment(undefined=StrictUndefined, keep_trailing_newline=True, autoescape=False)
    return env.from_string(template.read_text(encoding="utf-8"))


def _sh(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


# --- recording -------------------------------------------------------------------------------
