"""The ``user_data`` of a new server: one cloud-init document carrying the SSH key and the
startup script, base64-encoded as the ECS API wants (at most 32 KB before encoding).

Huawei's own SSH mechanism (``key_name``) needs a key pair registered beforehand; cloud-init's
``ssh_authorized_keys`` works with the plain public key the request carries.
"""

from __future__ import annotations

import base64

import yaml

from providers.base import InvalidRequest

MAX_BYTES = 32 * 1024
SCRIPT_PATH = "/var/lib/provisioner/startup.sh"


def build(script: str | None, ssh_public_key: str | None) -> str | None:
    """Base64 user data, or None when there is nothing to inject. A script that is already a
    ``#cloud-config`` document gets the key merged in; any other script is written to disk and
    run once by ``runcmd``."""
    if not script and not ssh_public_key:
        return None
    config: dict = {}
    if script and script.lstrip().startswith("#cloud-config"):
        loaded = yaml.safe_load(script)
        if loaded is not None and not isinstance(loaded, dict):
            raise InvalidRequest("sbercloud: user data #cloud-config is not a mapping")
        config = loaded or {}
    elif script:
        config["write_files"] = [
            {
                "path": SCRIPT_PATH,
                "permissions": "0755",
                "encoding": "b64",
                "content": base64.b64encode(script.encode()).decode(),
            }
        ]
        config["runcmd"] = [[SCRIPT_PATH]]
    if ssh_public_key:
        config.setdefault("ssh_authorized_keys", []).append(ssh_public_key.strip())
    text = "#cloud-config\n" + yaml.safe_dump(config, sort_keys=False)
    raw = text.encode()
    if len(raw) > MAX_BYTES:
        raise InvalidRequest(
            f"sbercloud: user data is {len(raw)} bytes; the ECS API takes at most {MAX_BYTES}"
        )
    return base64.b64encode(raw).decode()
