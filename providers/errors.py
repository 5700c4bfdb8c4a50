"""The one error taxonomy every adapter raises: what a caller decides on (another zone, another
cloud, retry, give up), with the cloud's own code kept. Imports nothing of ours, so the call
helper (:mod:`providers.retry`) and the contract (:mod:`providers.base`) both stand on it."""

from __future__ import annotations

from typing import ClassVar, Literal


class ProviderError(Exception):
    """Base of every adapter error. ``code`` keeps the cloud's own error code."""

    retryable: ClassVar[bool] = False

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code

    def __str__(self) -> str:
        msg = super().__str__()
        return f"{msg} [{self.code}]" if self.code and self.code not in msg else msg


class CapacityError(ProviderError):
    """The zone has no stock of this type right now: try another zone."""


class QuotaError(ProviderError):
    """A quota blocks the launch. ``scope`` says how far: the region, or the whole cloud
    (e.g. GCP GPUS_ALL_REGIONS)."""

    def __init__(
        self, message: str, *, code: str | None = None, scope: Literal["region", "cloud"] = "region"
    ) -> None:
        super().__init__(message, code=code)
        self.scope = scope


class AuthError(ProviderError):
    """Credentials missing, expired or refused: the whole cloud is out."""


class InvalidRequest(ProviderError):
    """The cloud rejected the request itself (bad image, type not offered here…)."""


class ConfigurationError(InvalidRequest):
    """The cloud's settings lack something every request needs (a folder, a project): the
    whole cloud is out until they are set, so it is said once, not once per zone."""


class Throttled(ProviderError):
    """Rate limited or a transient server error: retried with backoff by the adapter."""

    retryable = True


class NotFound(ProviderError):
    """The machine does not exist (any more)."""
