"""azure-core exceptions → the taxonomy. The ARM error code is in
``HttpResponseError.error.code``, both for a refused request and a failed operation; azure-core
is imported inside :func:`map_error`."""

from __future__ import annotations

from dataclasses import dataclass
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
    answer = _Answer.of(err)
    if isinstance(err, ClientAuthenticationError) and answer.status in (None, 401):
        return _sign_in_refused(err, answer)
    return answer.classified()


@dataclass(frozen=True)
class _Answer:
    """ARM's answer to a refused request or a failed operation: its error code (None when it
    gave none), message, HTTP status, and the line the taxonomy's error carries."""

    code: str | None
    message: str
    status: int | None

    @classmethod
    def of(cls, err: Any) -> _Answer:
        error = getattr(err, "error", None)
        message = getattr(error, "message", None) or _first_line(err)
        return cls(getattr(error, "code", None) or None, message, err.status_code)

    @property
    def text(self) -> str:
        return f"azure: {self.code}: {self.message}" if self.code else f"azure: {self.message}"

    @property
    def throttled(self) -> bool:
        return self.status == 429 or self.code == "TooManyRequests"

    @property
    def quota(self) -> bool:
        return self.code in _QUOTA or (
            self.code == "OperationNotAllowed" and "quota" in self.message.lower()
        )

    @property
    def auth(self) -> bool:
        return self.code in _AUTH or (
            self.status in (401, 403) and self.code != "RequestDisallowedByPolicy"
        )

    @property
    def not_found(self) -> bool:
        return self.code in _NOT_FOUND or self.status == 404

    @property
    def server_error(self) -> bool:
        return self.status is not None and self.status >= 500

    def classified(self) -> ProviderError:
        code, text = self.code, self.text
        if self.throttled:
            return Throttled(text, code=code or "TooManyRequests")
        if code in _CAPACITY:
            return CapacityError(text, code=code)
        if self.quota:
            return QuotaError(text, code=code, scope="region")  # Azure vCPU quotas are regional
        if self.auth:
            return AuthError(text, code=code)
        if self.not_found:
            return NotFound(text, code=code or "NotFound")
        if self.server_error:
            return Throttled(text, code=code or str(self.status))
        return InvalidRequest(text, code=code)


def _sign_in_refused(err: BaseException, answer: _Answer) -> AuthError:
    # DefaultAzureCredential's first line is generic; the sign-in's own answer (an AADSTS
    # code and its text, never the secret) is on the line of the credential that tried.
    aadsts = [line.strip() for line in str(err).splitlines() if "AADSTS" in line]
    text = f"azure: {aadsts[0]}" if aadsts else answer.text
    return AuthError(text, code=answer.code or "ClientAuthenticationError")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
