"""azure-core exceptions → the taxonomy. The ARM error code is in
``HttpResponseError.error.code``, both for a refused request and a failed operation; azure-core
is imported inside :func:`map_error`."""

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

_CAPACITY = {
    "SkuNotAvailable",
    "AllocationFailed",
    "ZonalAllocationFailed",
    "OverconstrainedAllocationRequest",
    "OverconstrainedZonalAllocationRequest",
    "SpotPriceGreaterThanProvidedMaxPrice",
}
_QUOTA = {"QuotaExceeded", "ResourceQuotaExceeded"}
_AUTH = {
    "AuthenticationFailed",
    "AuthorizationFailed",
    "InvalidAuthenticationToken",
    "InvalidAuthenticationTokenTenant",
    "ExpiredAuthenticationToken",
    "LinkedAuthorizationFailed",
    "ClientAuthenticationError",
}
_NOT_FOUND = {"ResourceNotFound", "NotFound", "ResourceGroupNotFound"}


def map_error(err: BaseException, what: str = "") -> ProviderError | None:
    """An azure-core exception → the taxonomy (None for anything else). ARM's messages name
    the resource, so ``what`` is not needed."""
    from azure.core.exceptions import (
        ClientAuthenticationError,
        HttpResponseError,
        ServiceRequestError,
        ServiceResponseError,
    )

    if isinstance(err, ProviderError):
        return err
    if isinstance(err, ServiceRequestError | ServiceResponseError):
        return Throttled(f"azure: {_first_line(err)}", code=type(err).__name__)
    if not isinstance(err, HttpResponseError):
        return None
    error = getattr(err, "error", None)
    code = getattr(error, "code", None) or None
    message = getattr(error, "message", None) or _first_line(err)
    status = err.status_code
    text = f"azure: {code}: {message}" if code else f"azure: {message}"
    if isinstance(err, ClientAuthenticationError) and status in (None, 401):
        # DefaultAzureCredential's first line is generic; the sign-in's own answer (an AADSTS
        # code and its text, never the secret) is on the line of the credential that tried.
        aadsts = [line.strip() for line in str(err).splitlines() if "AADSTS" in line]
        if aadsts:
            text = f"azure: {aadsts[0]}"
        return AuthError(text, code=code or "ClientAuthenticationError")
    if status == 429 or code == "TooManyRequests":
        return Throttled(text, code=code or "TooManyRequests")
    if code in _CAPACITY:
        return CapacityError(text, code=code)
    if code in _QUOTA or (code == "OperationNotAllowed" and "quota" in message.lower()):
        return QuotaError(text, code=code, scope="region")  # Azure vCPU quotas are regional
    if code in _AUTH or (status in (401, 403) and code != "RequestDisallowedByPolicy"):
        return AuthError(text, code=code)
    if code in _NOT_FOUND or status == 404:
        return NotFound(text, code=code or "NotFound")
    if status is not None and status >= 500:
        return Throttled(text, code=code or str(status))
    return InvalidRequest(text, code=code)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
