"""Bounded retry with exponential backoff and full jitter for :class:`~providers.base.Throttled`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from providers.base import Throttled

T = TypeVar("T")


def call_with_retry(fn: Callable[[], T], options: Mapping[str, Any] | None = None) -> T:
    """Run ``fn``; on Throttled retry up to ``retry_attempts`` times (default 6) waiting a random
    0..min(retry_max_seconds, retry_base_seconds·2ⁿ). The last Throttled is re-raised."""
    opts = options or {}
    retrying = Retrying(
        retry=retry_if_exception_type(Throttled),
        stop=stop_after_attempt(int(opts.get("retry_attempts", 6))),
        wait=wait_random_exponential(
            multiplier=float(opts.get("retry_base_seconds", 0.5)),
            max=float(opts.get("retry_max_seconds", 20)),
        ),
        reraise=True,
    )
    return retrying(fn)
