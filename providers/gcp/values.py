"""GCP's values as its API takes and gives them: labels folded to what it accepts, its times
(RFC 3339 with a Pacific offset) read as UTC. Shared by the adapter and its helpers."""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime


def label_value(text: str) -> str:
    """GCP label values: lowercase ``[a-z0-9_-]``, at most 63 characters."""
    return re.sub(r"[^a-z0-9_-]", "-", str(text).lower())[:63]


def labels(source: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for key, value in source.items():
        clean = label_value(key)
        if not clean[:1].isalpha():
            clean = f"k-{clean}"[:63]
        out[clean] = label_value(value)
    return out


def utc(at: datetime | None) -> datetime | None:
    """GCP writes its times with a Pacific offset (``…-08:00``); the state keeps UTC."""
    if at is None:
        return None
    return at.astimezone(UTC) if at.tzinfo else at.replace(tzinfo=UTC)


def timestamp(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text) if text else None
    except ValueError:
        return None
