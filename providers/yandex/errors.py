"""gRPC statuses (of a call, or an ``Operation.error``) → the taxonomy; the evidence for each
rule is in the package docstring. grpc and protobuf are imported inside :func:`map_error`."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from providers.base import (
    AuthError,
    CapacityError,
    InvalidRequest,
    NotFound,
    ProviderError,
    QuotaError,
    Throttled,
)

# What Yandex Compute answers, with where it is written down (sources in the package docstring):
# - "Not enough resources": the zone has no hardware for the VM (Yandex docs, "Not enough
#   resources" error; also what a preemptible VM gets when a zone runs out). The docs give the
#   text, not the gRPC code, and list INTERNAL as "e.g. insufficient computing resources": the
#   text decides, whatever the code.
# - "The limit on maximum number of active operations has exceeded.": RESOURCE_EXHAUSTED on
#   Create when the folder has too many operations running (quota "concurrent operations per
#   folder", 15); it clears as they finish, so it is retried.
# - "The limit on maximum number of <GPU devices|cores|...> has exceeded.": RESOURCE_EXHAUSTED
#   at once in the answer to Create when a cloud quota is used up.
# - A QuotaFailure in the status details (``google.rpc`` or Yandex's public
#   ``yandex.cloud.quota``) names the quota outright.
_NOT_ENOUGH_RESOURCES = "not enough resources"
_ACTIVE_OPERATIONS = "the limit on maximum number of active operations has exceeded"
_QUOTA_LIMIT = re.compile(r"\bthe limit on (maximum|total) .+ has exceeded")
_QUOTA_DETAILS = {"google.rpc.QuotaFailure", "yandex.cloud.quota.QuotaFailure"}


def by_code(
    code: str,
    message: str,
    what: str,
    zone: str | None = None,
    details: Sequence[str] = (),
) -> ProviderError:
    """One gRPC status (from a call or an ``Operation.error``) → the taxonomy. ``details``: the
    message types in the status details (``google.rpc.Status.details``), e.g.
    ``yandex.cloud.quota.QuotaFailure``. The code decides first; within RESOURCE_EXHAUSTED the
    texts above tell quota and the operations limit apart."""
    message = " ".join(message.split())  # one line, even for the SDK's nested errors
    text = f"yandex: {what}: {message} [{code}]"
    low = message.lower()
    if code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return AuthError(text, code=code)
    if code == "UNAVAILABLE" and "getting metadata from plugin failed" in low:
        return AuthError(text, code=code)  # the SDK could not obtain an IAM token
    if _NOT_ENOUGH_RESOURCES in low:
        return CapacityError(f"{text} (zone {zone})" if zone else text, code=code)
    if _QUOTA_DETAILS.intersection(details):
        return QuotaError(text, code=code, scope="region")
    if code == "RESOURCE_EXHAUSTED":
        return _exhausted(text, code, low)
    if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL", "ABORTED"):
        return Throttled(text, code=code)
    if code == "NOT_FOUND":
        return NotFound(text, code=code)
    return InvalidRequest(text, code=code)


def _exhausted(text: str, code: str, low: str) -> ProviderError:
    """RESOURCE_EXHAUSTED, told apart by its (lowercased) text ``low``."""
    if _ACTIVE_OPERATIONS in low:
        return Throttled(text, code=code)
    if _QUOTA_LIMIT.search(low):
        # Yandex quotas are per cloud, and the cloud has one region
        return QuotaError(text, code=code, scope="region")
    # Anything else is what the code is documented to mean, "the request limit exceeded":
    # retried a bounded number of times, then the candidate fails with this text.
    return Throttled(text, code=code)


def detail_types(status: Any) -> list[str]:
    """The message types in a ``google.rpc.Status``'s details, by full name."""
    return [d.type_url.rsplit("/", 1)[-1] for d in status.details]


def map_error(exc: Exception, what: str, zone: str | None = None) -> ProviderError | None:
    """The taxonomy error for a ``grpc.RpcError`` (``what`` names the call, ``zone`` the zone a
    capacity error is about), with the status details' types when the trailer carries them;
    None for anything else."""
    import grpc

    if not isinstance(exc, grpc.RpcError):
        return None
    details: list[str] = []
    trailers = getattr(exc, "trailing_metadata", None)  # a grpc.Call; other RpcErrors lack it
    for key, value in (trailers() if trailers else None) or ():
        if key == "grpc-status-details-bin":  # the full google.rpc.Status, details included
            from google.protobuf.message import DecodeError
            from google.rpc import status_pb2  # type: ignore[import-untyped]  # no py.typed

            try:
                details = detail_types(status_pb2.Status.FromString(value))
            except DecodeError:  # a malformed trailer leaves the code and the text
                details = []
    return by_code(exc.code().name, exc.details() or "", what, zone, details)
