"""The ``user_data`` of a new server: one cloud-init document carrying the SSH key and the
startup script, base64-encoded as the ECS API wants (at most 32 KB before encoding).

Huawei's own SSH mechanism (``key_name``) needs a key pair registered beforehand; cloud-init's
``ssh_authorized_keys`` works with the plain public key the request carries.
"""

from __future__ import annotations

import base64

from providers.base import InvalidRequest
from providers.userdata import cloud_init

MAX_BYTES = 32 * 1024


def build(script: str | None, ssh_public_key: str | None, user: str) -> str | None:
    """Base64 cloud-init user data with the key (for ``user``, made by cloud-init) and the
    script, or None when there is none."""
    text = cloud_init(script, ssh_public_key, user=user)
    if text is None:
        return None
    raw = text.encode()
    if len(raw) > MAX_BYTES:
        raise InvalidRequest(
            f"sbercloud: user data is {len(raw)} bytes; the ECS API takes at most {MAX_BYTES}"
        )
    return base64.b64encode(raw).decode()
