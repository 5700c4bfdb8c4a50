"""What a cloud accepts in one launch, declared once per cloud (``CloudSpec.limits``) with the
source of each number: the size of the startup data, and the limits met on tags, labels and
names. The adapters build what they send from it (:func:`startup_payload`), the plan measures a
startup against it before anything is launched, and the emulators answer a request past it as
the cloud does. docs/LIMITS.md is the same table for people.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from providers.userdata import cloud_init, decoded, gzipped

__all__ = ["Limits", "TooLarge", "check_startup", "decoded", "startup_payload", "startup_size"]

#: How the startup data travels: ``gzip`` — cloud-init's user data, gzip-compressed (cloud-init
#: uncompresses gzip content before anything else: cloud-init docs, "User data formats",
#: "Gzip compressed content"); ``cloud-init`` — cloud-init's user data as text (a text-only
#: field: a metadata value); ``script`` — the startup script itself, as text (GCP's
#: ``startup-script`` metadata, run by the guest environment, not by cloud-init).
Envelope = Literal["gzip", "cloud-init", "script"]


@dataclass(frozen=True)
class Limits:
    """One cloud's documented limits on a launch request. Sizes are bytes."""

    startup_field: str  # where the startup data goes, in the API's own words
    startup_max: int  # the most that field takes, counted as ``startup_counts`` says
    startup_counts: str  # what is counted: "raw bytes before base64", "characters"…
    envelope: Envelope
    startup_source: str  # where the limit is written down
    # all metadata of one instance together, when the startup is one metadata value among
    # others (GCP, Yandex); None: the startup field is the only bound
    metadata_total_max: int | None = None
    key_in_startup: bool = True  # the SSH key travels inside the startup data (cloud-init)
    max_tags: int = 0  # tags/labels per resource
    tag_key_max: int = 0
    tag_value_max: int = 0
    tag_rule: str = ""  # what characters a key and a value may hold, in the cloud's words
    tags_source: str = ""
    name_max: int = 0  # the instance (VM, server) name
    name_rule: str = ""
    name_source: str = ""

    @property
    def headroom(self) -> str:
        return f"{self.startup_field}: at most {self.startup_max:,} {self.startup_counts}"


def startup_payload(
    limits: Limits, script: str | None, ssh_public_key: str | None, user: str | None
) -> bytes | str | None:
    """What the adapter puts in ``limits.startup_field`` for ``script`` and the key (for
    ``user``): bytes for the ``gzip`` envelope (the SDK or the adapter base64-encodes them),
    text otherwise; None when there is nothing to send."""
    if limits.envelope == "script":
        return script or None
    key = ssh_public_key if limits.key_in_startup else None
    # compressed whole: the script as a text part of its own (base64 inside would cost a third)
    document = cloud_init(script, key, user=user, inline=limits.envelope == "gzip")
    if document is None:
        return None
    return gzipped(document) if limits.envelope == "gzip" else document


def startup_size(
    limits: Limits, script: str | None, ssh_public_key: str | None, user: str | None
) -> int:
    """The size ``limits.startup_max`` is compared with (0: nothing is sent)."""
    payload = startup_payload(limits, script, ssh_public_key, user)
    if payload is None:
        return 0
    return len(payload if isinstance(payload, bytes) else payload.encode())


@dataclass(frozen=True)
class TooLarge:
    """A startup a cloud would refuse: its size against the limit."""

    cloud: str
    size: int
    limits: Limits
    total: bool = False  # the instance's metadata all together is what is too large

    def __str__(self) -> str:
        how = {"gzip": "gzip-compressed", "cloud-init": "as cloud-init text", "script": "as text"}
        what = "the startup data with the other metadata" if self.total else "the startup data"
        limit = (
            f"all metadata at most {self.limits.metadata_total_max:,} bytes"
            if self.total
            else self.limits.headroom
        )
        return (
            f"{what} is {self.size:,} bytes on {self.cloud} ({how[self.limits.envelope]}); "
            f"{limit} ({self.limits.startup_source})"
        )


def check_startup(
    cloud: str,
    limits: Limits,
    script: str | None,
    ssh_public_key: str | None,
    user: str | None,
    other_metadata: int = 0,
) -> TooLarge | None:
    """None when the startup fits ``limits``; else what is too large. ``other_metadata``: the
    bytes of the instance's other metadata keys and values, counted against
    ``metadata_total_max`` with the startup."""
    size = startup_size(limits, script, ssh_public_key, user)
    if size > limits.startup_max:
        return TooLarge(cloud, size, limits)
    total = limits.metadata_total_max
    if total is not None and size + other_metadata > total:
        return TooLarge(cloud, size + other_metadata, limits, total=True)
    return None
