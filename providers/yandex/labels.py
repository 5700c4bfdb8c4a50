"""Yandex's rules for what we send: labels folded to what the API accepts, and the
``idempotency-key`` a token becomes. Shared by the adapter and its volumes."""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping

_IDEMPOTENCY_NS = uuid.UUID("8d6f0f1e-2b47-5a8e-9a3c-6e0d1c5b7a01")


def sanitise_label(text: str, *, key: bool) -> str:
    """Yandex labels: lowercase ``[a-z0-9_-]`` (keys start with a letter), at most 63 chars."""
    out = re.sub(r"[^a-z0-9_-]", "_", text.lower())[:63]
    if key and not out[:1].isalpha():
        out = ("l" + out)[:63]
    return out


def sanitise_labels(labels: Mapping[str, str]) -> dict[str, str]:
    return {sanitise_label(k, key=True): sanitise_label(v, key=False) for k, v in labels.items()}


def idempotency_key(token: str) -> str:
    """Yandex wants a UUID: the same token always gives the same one. (Yandex answers a reused
    key with the first operation, failed or not: a new placement needs a new token, as
    lifecycle's per-candidate tokens are.)"""
    return str(uuid.uuid5(_IDEMPOTENCY_NS, token))
