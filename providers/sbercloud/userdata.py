"""The ``user_data`` of a new server: one cloud-init document carrying the SSH key and the
startup script, gzip-compressed (ECS takes "text, a text file or a gzip file") and
base64-encoded as the ECS API wants: at most 32 KB before encoding (providers/sbercloud
``LIMITS``).

Huawei's own SSH mechanism (``key_name``) needs a key pair registered beforehand; cloud-init's
``ssh_authorized_keys`` works with the plain public key the request carries.
"""

from __future__ import annotations

import base64

from providers.base import InvalidRequest
from providers.limits import check_startup, startup_payload
from providers.sbercloud import LIMITS

MAX_BYTES = LIMITS.startup_max


def build(script: str | None, ssh_public_key: str | None, user: str) -> str | None:
    """Base64 of the gzip-compressed cloud-init user data with the key (for ``user``, made by
    cloud-init) and the script, or None when there is none."""
    payload = startup_payload(LIMITS, script, ssh_public_key, user)
    if not isinstance(payload, bytes):
        return None
    if too_large := check_startup("sbercloud", LIMITS, script, ssh_public_key, user):
        raise InvalidRequest(f"sbercloud: {too_large}")
    return base64.b64encode(payload).decode()
