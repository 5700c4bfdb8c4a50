"""Compute Engine errors (an HTTP reason, or an operation's error code) → the taxonomy. The
SDK (google-api-core, google-auth, requests) is imported inside :func:`map_error`."""

from __future__ import annotations

import re
from typing import Any, Literal

from providers.base import (
    AuthError,
    CapacityError,
    InvalidRequest,
    NotFound,
    ProviderError,
    QuotaError,
    Throttled,
)

# Zone-level failures: the next zone may well work. ZONE_RESOURCE_POOL_EXHAUSTED(_WITH_DETAILS)
# are Google's resource-availability errors (compute/docs/troubleshooting/
# troubleshooting-resource-availability); SkyPilot's GCP failover also blocks the zone on
# UNSUPPORTED_OPERATION (a Spot VM preempted while it was being created) and insufficientCapacity.
_CAPACITY = {
    "ZONE_RESOURCE_POOL_EXHAUSTED",
    "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
    "UNSUPPORTED_OPERATION",
    "insufficientCapacity",
}
# An attachable GPU the zone does not offer: a synchronous 400 badRequest "The resource
# 'projects/P/zones/Z/acceleratorTypes/A' was not found". The zone lacks the type, so the launch
# is a CapacityError (the failover blocks the zone and moves on), not an InvalidRequest (which
# blocks nothing, so every other host shape in the same zone would be refused the same way).
_ACCELERATOR_MISSING = re.compile(r"/zones/[^/']+/acceleratorTypes/[^/']+' was not found")
# A machine type / disk type / accelerator combination the series cannot take. GCE has been seen
# to carry it under a capacity code too (scylladb/scylla-cluster-tests, capacity_errors.py): no
# other zone can fix it, so it is never a CapacityError.
_INCOMPATIBLE = "features are not compatible for creating instance"
_NO_NETWORK = "referenced network resource cannot be found"
# An organization policy refusing a request names its constraint ("Constraint constraints/
# compute.<name> violated for project ...", HTTP 412 conditionNotMet, as GCE answers for
# requireShieldedVm and vmExternalIpAccess). With compute.requireOsLogin enforced, "requests that
# set enable-oslogin to false in VM or project metadata are rejected" (compute/docs/oslogin/
# manage-oslogin-in-an-org): our metadata SSH key cannot be used in that project.
_OS_LOGIN_ENFORCED = "constraints/compute.requireOsLogin"
OS_LOGIN_HINT = (
    " (your organization enforces OS Login, so the metadata SSH key provisioner logs in with is "
    "refused: ask an organization policy admin to exempt this project from "
    "constraints/compute.requireOsLogin, or set `project` in the gcp settings to one without it)"
)
_QUOTA = {"QUOTA_EXCEEDED", "quotaExceeded"}
_THROTTLED = {
    "rateLimitExceeded",
    "userRateLimitExceeded",
    "RATE_LIMIT_EXCEEDED",
    "backendError",
    "RESOURCE_OPERATION_RATE_EXCEEDED",
}


def by_code(code: str, message: str, status: int | None = None) -> ProviderError:
    """One GCP error (HTTP reason or operation error code) → the taxonomy."""
    text = message if message.startswith("gcp:") else f"gcp: {message}"
    refused = _refused_as_asked(code, message, text)
    if refused is not None:
        return refused
    if _zone_lacks(code, message):
        return CapacityError(text, code=code)
    if code in _QUOTA:
        return QuotaError(text, code=code, scope=_quota_scope(message))
    return _by_status(code, status, text)


def _by_status(code: str, status: int | None, text: str) -> ProviderError:
    """The rest, by the throttling codes and the HTTP status."""
    if code in _THROTTLED or status == 429 or (status or 0) >= 500:
        return Throttled(text, code=code)
    if status in (401, 403):
        return AuthError(text, code=code)
    if status == 404 or code in ("notFound", "RESOURCE_NOT_FOUND"):
        return NotFound(text, code=code)
    return InvalidRequest(text, code=code)


def _refused_as_asked(code: str, message: str, text: str) -> InvalidRequest | None:
    """A request no zone can fix, by its message (with a hint where the user can fix it)."""
    if _INCOMPATIBLE in message:
        return InvalidRequest(text, code=code)
    if _OS_LOGIN_ENFORCED in message:
        return InvalidRequest(text + OS_LOGIN_HINT, code=code)
    if _NO_NETWORK in message:
        hint = " (set `network`/`subnetwork` in the gcp settings to a VPC network of this project)"
        return InvalidRequest(text + hint, code=code)
    return None


def _zone_lacks(code: str, message: str) -> bool:
    """A zone-level failure: out of capacity, or without the accelerator asked for."""
    if code in _CAPACITY or any(c in message for c in _CAPACITY):
        return True
    return bool(_ACCELERATOR_MISSING.search(message))


def _quota_scope(message: str) -> Literal["region", "cloud"]:
    """A quota's scope: the whole cloud for a global or ALL_REGIONS quota, else the region."""
    quota = re.search(r"Quota '([A-Z0-9_-]+)'", message)
    everywhere = "globally" in message or bool(quota and "ALL_REGIONS" in quota.group(1))
    return "cloud" if everywhere else "region"


def map_error(exc: Exception, what: str = "") -> ProviderError | None:
    """The taxonomy error for a Google API, auth or transport exception; None for anything
    else. (GCP's own messages name the resource, so ``what`` is not needed.)"""
    import requests
    from google.api_core import exceptions as api_exceptions
    from google.auth import exceptions as auth_exceptions

    if isinstance(exc, api_exceptions.GoogleAPICallError):
        return _api_call_error(exc)
    if isinstance(exc, auth_exceptions.GoogleAuthError):
        return AuthError(
            f"gcp: credentials refused ({type(exc).__name__}: {exc})", code=type(exc).__name__
        )
    if isinstance(exc, requests.exceptions.RequestException):
        return Throttled(f"gcp: API unreachable ({type(exc).__name__})", code=type(exc).__name__)
    return None


def _api_call_error(exc: Any) -> ProviderError:
    """A google-api-core error: its first error reason (else its own reason, else its class
    name) is the code."""
    reasons = [e.get("reason", "") for e in exc.errors or () if isinstance(e, dict)]
    code = next((r for r in reasons if r), None) or exc.reason or type(exc).__name__
    status = exc.code if isinstance(exc.code, int) else None
    return by_code(code, exc.message or str(exc), status)


def operation_error(operation: Any) -> ProviderError:
    errors = list(operation.error.errors)
    code = errors[0].code
    message = "; ".join(e.message for e in errors if e.message) or code
    status = operation.http_error_status_code or None
    return by_code(code, message, status)
