"""Our labels → ECS server tags that the API accepts.

Huawei ECS takes at most 10 tags per server; a key is 1..36 characters, a value 0..43; neither
may hold an ASCII control character (0-31) nor any of ``=*<>\\,|/``; keys are unique per server
(huaweicloudsdkecs ``PrePaidServerTag``; Huawei's ``ECS.ServerTags`` reference; the API answers
Ecs.0905..Ecs.0908 otherwise). The SDK 3.1.219 docstring leaves ``/`` out of the value rule while
Huawei's reference and the C++ SDK keep it, so ``/`` is replaced in values too.

EVS is stricter: a disk's tag key (1..36) and value (0..43) "Can contain only digits, letters,
hyphens (-), and underscores (_)", at most 10 tags (EVS API reference, "Creating EVS Disks",
opentelekomcloud-docs/elastic-volume-service): :func:`volume_tags`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from providers.base import TAG_MACHINE, TAG_MANAGED_BY, TAG_OWNER, TAG_PROJECT

MAX_TAGS = 10
MAX_KEY = 36
MAX_VALUE = 43
FORBIDDEN = re.compile(r"[\x00-\x1f=*<>\\,|/]")
VOLUME_FORBIDDEN = re.compile(r"[^0-9A-Za-z_-]")
OURS = (TAG_MANAGED_BY, TAG_MACHINE, TAG_PROJECT, TAG_OWNER)


def _fold(text: str, limit: int, forbidden: re.Pattern[str] = FORBIDDEN) -> str:
    return forbidden.sub("_", text)[:limit]


def volume_tags(labels: Mapping[str, str]) -> dict[str, str]:
    """As :func:`server_tags`, folded to what EVS takes for a disk."""
    return server_tags(labels, VOLUME_FORBIDDEN)


def server_tags(
    labels: Mapping[str, str], forbidden: re.Pattern[str] = FORBIDDEN
) -> dict[str, str]:
    """Folds ``labels`` into tags ECS accepts, never failing the launch over a label.

    Forbidden characters become ``_``; keys are cut to 36 characters and values to 43. Our own
    keys (``providers.base`` TAG_*) come first, then the user's labels in their order; a key that
    folds empty or onto a key already taken is dropped, and so are user labels past the tenth
    tag. Our keys and a machine id fit verbatim, so finding our servers by tag still works."""
    ordered = [k for k in OURS if k in labels] + [k for k in labels if k not in OURS]
    tags: dict[str, str] = {}
    for key in ordered:
        folded = _fold(key, MAX_KEY, forbidden).strip()
        if not folded or folded in tags:
            continue
        tags[folded] = _fold(labels[key], MAX_VALUE, forbidden)
        if len(tags) == MAX_TAGS:
            break
    return tags
