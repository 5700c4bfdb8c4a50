"""Huawei ECS errors → the provider taxonomy.

Codes are from the ECS API reference error table (opentelekomcloud/docs
``doc/source/ecs/api-reference/error-code-description.md``; Huawei Cloud publishes the same table)
and the API gateway's error codes (support.huaweicloud.com ``devg-apisign/api-sign-errorcode``):

- Ecs.0319 "Insufficient flavor capacity" (400), Ecs.0044 "disk type sold out in AZ" → capacity;
- Ecs.0001 number of ECSs, Ecs.0013 EIP, Ecs.0021 EVS disks, Ecs.0022 ECS group → quota. ECS quotas
  are per project, and a Huawei project is one region, so the scope is ``region``;
- Ecs.0003 / Ecs.0004 / Ecs.0023 / Ecs.0110 and HTTP 401/403, APIGW.03xx → auth;
- APIGW.0308 / HTTP 429, any 5xx (e.g. Ecs.0603 "try again 1 minute later") → throttled;
- Ecs.0114 / Ecs.0614 (404) → not found; any other 4xx → invalid request.

huaweicloudsdkcore 3.1.219 turns a 429 on a GET into its own error with code "429" (urllib3's
retry bookkeeping eats the body), so the HTTP status is what we rely on for throttling.
"""

from __future__ import annotations

from providers.base import (
    AuthError,
    CapacityError,
    InvalidRequest,
    NotFound,
    ProviderError,
    QuotaError,
    Throttled,
)

CAPACITY_CODES = frozenset({"Ecs.0319", "Ecs.0044"})
QUOTA_CODES = frozenset({"Ecs.0001", "Ecs.0013", "Ecs.0021", "Ecs.0022"})
AUTH_CODES = frozenset({"Ecs.0003", "Ecs.0004", "Ecs.0023", "Ecs.0110"})
NOT_FOUND_CODES = frozenset({"Ecs.0114", "Ecs.0614"})
_CAPACITY_WORDS = (
    "sold out",
    "sellout",
    "capacity is not enough",
    "insufficient flavor capacity",
    "insufficient resource",
    "no valid host",
)


def by_code(status: int | None, code: str | None, message: str, *, where: str) -> ProviderError:
    """One error of the ECS API (``status`` None for a failed async job). ``where`` says what was
    attempted (e.g. "create pi2.2xlarge.4 in ru-moscow-1a") and leads the message."""
    code = code or (str(status) if status else None)
    text = f"sbercloud: {where}: {message or 'no message'}"
    if code and code not in text:
        text = f"{text} [{code}]"
    kind = _kind(status, code, (message or "").lower())
    if kind is QuotaError:  # ECS quotas are per project, and a project is one region
        return QuotaError(text, code=code, scope="region")
    return kind(text, code=code)


def _kind(status: int | None, code: str | None, lowered: str) -> type[ProviderError]:
    """The taxonomy's class for an error: its code first, then its (lowercased) message, then
    its HTTP status."""
    if _throttled(status, code):
        return Throttled
    if code in CAPACITY_CODES:
        return CapacityError
    if code in QUOTA_CODES:
        return QuotaError
    if any(w in lowered for w in _CAPACITY_WORDS):
        return CapacityError
    if "quota" in lowered:
        return QuotaError
    if _refused(status, code):
        return AuthError
    if _not_found(status, code):
        return NotFound
    return InvalidRequest


def _throttled(status: int | None, code: str | None) -> bool:
    return status == 429 or code == "APIGW.0308" or (status is not None and status >= 500)


def _refused(status: int | None, code: str | None) -> bool:
    return status in (401, 403) or code in AUTH_CODES or (code or "").startswith("APIGW.03")


def _not_found(status: int | None, code: str | None) -> bool:
    return code in NOT_FOUND_CODES or (status == 404 and not (code or "").startswith("APIGW"))


def map_error(exc: Exception, where: str) -> ProviderError | None:
    """Map a ``huaweicloudsdkcore`` SdkException (None for anything else). Secrets never appear
    in these. A lost connection counts as transient: every call we retry is idempotent (create
    by its token)."""
    from huaweicloudsdkcore.exceptions import exceptions as sdk

    if not isinstance(exc, sdk.SdkException):
        return None
    if isinstance(exc, sdk.ServiceResponseException):
        return by_code(exc.status_code, exc.error_code, exc.error_msg or "", where=where)
    if isinstance(exc, sdk.ConnectionException | sdk.RequestTimeoutException):
        return Throttled(f"sbercloud: {where}: {exc.error_msg}", code="connection")
    return InvalidRequest(f"sbercloud: {where}: {getattr(exc, 'error_msg', exc)}", code="sdk")
