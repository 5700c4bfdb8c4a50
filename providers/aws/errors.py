"""botocore exceptions → the adapter error taxonomy. botocore is imported inside the function."""

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

CAPACITY_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientCapacity",
        "UnfulfillableCapacity",
        "Unsupported",  # the type is not offered in that AZ
        "SpotMaxPriceTooLow",  # the spot price here is above our cap; another AZ may be cheaper
    }
)
QUOTA_CODES = frozenset(
    {"InstanceLimitExceeded", "VcpuLimitExceeded", "MaxSpotInstanceCountExceeded"}
)
AUTH_CODES = frozenset(
    {
        "AuthFailure",
        "UnauthorizedOperation",
        "ExpiredToken",
        "ExpiredTokenException",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "AccessDeniedException",
        "OptInRequired",
    }
)
THROTTLE_CODES = frozenset(
    {
        "RequestLimitExceeded",
        "Throttling",
        "ThrottlingException",
        "InternalError",
        "InternalFailure",
        "ServiceUnavailable",
        "Unavailable",
    }
)
NOT_FOUND_CODES = frozenset({"InvalidInstanceID.NotFound", "InvalidVolume.NotFound"})
INVALID_CODES = frozenset(
    {
        "IdempotentParameterMismatch",
        "InvalidParameterValue",
        "InvalidParameterCombination",
        "InvalidParameter",
        "MissingParameter",
        "UnsupportedOperation",
        "IncorrectInstanceState",
        # volumes: AttachVolume to an instance in another AZ ("The volume 'vol-…' is not in the
        # same availability zone as instance 'i-…'", linuxkit/linuxkit#2388), to a second
        # instance ("vol-… is already attached to an instance", portworx/px-dev#42), and
        # DeleteVolume of an attached one (VolumeInUse); IncorrectState: the volume is not in
        # a state for the call (Detach of an available one)
        "InvalidVolume.ZoneMismatch",
        "VolumeInUse",
        "IncorrectState",
        "IncorrectSpotRequestState",
        "ParameterNotFound",
        "ValidationException",
    }
)


def map_error(exc: Exception, what: str) -> ProviderError | None:
    """The taxonomy error for a botocore exception (``what`` names the call), or None when it
    is not a botocore error. The AWS error code is kept in ``.code``."""
    from botocore import exceptions as bx
    from botocore.parsers import ResponseParserError

    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code") or "Unknown")
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        message = f"aws: {what}: {err.get('Message') or code} [{code}]"
        return by_code(code, status, message)
    if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError):
        return AuthError(f"aws: {what}: no credentials found", code="NoCredentialsError")
    if isinstance(exc, bx.SSOError | bx.TokenRetrievalError | bx.CredentialRetrievalError):
        return AuthError(f"aws: {what}: credentials could not be loaded", code=type(exc).__name__)
    if isinstance(exc, bx.HTTPClientError | bx.ConnectionError | ResponseParserError):
        # A lost, late or garbled response, or a refused connection: transient. Every call
        # retried here is safe to repeat (launch carries its ClientToken).
        return Throttled(
            f"aws: {what}: connection problem ({type(exc).__name__})", code=type(exc).__name__
        )
    if isinstance(exc, bx.BotoCoreError):
        return ProviderError(f"aws: {what}: {exc}", code=type(exc).__name__)
    return None


def by_code(code: str, status: int, message: str) -> ProviderError:
    """One AWS error code (and HTTP status) → the taxonomy."""
    if code in CAPACITY_CODES:
        return CapacityError(message, code=code)
    if code in QUOTA_CODES:
        return QuotaError(message, code=code, scope="region")
    if code in AUTH_CODES:
        return AuthError(message, code=code)
    if code in NOT_FOUND_CODES:
        return NotFound(message, code=code)
    if code in THROTTLE_CODES or status >= 500:
        return Throttled(message, code=code)
    if code in INVALID_CODES or code.startswith(("InvalidAMIID.", "Invalid")):
        return InvalidRequest(message, code=code)
    return ProviderError(message, code=code)
