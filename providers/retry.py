"""The one call helper: map a cloud's exception into the taxonomy, and retry
:class:`~providers.errors.Throttled` with exponential backoff and full jitter, bounded."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from providers.errors import ProviderError, Throttled
from providers.spec import Options

T = TypeVar("T")
ErrorMap = Callable[[Exception], Exception | None]  # None or the exception itself: not ours


def call_with_retry(
    fn: Callable[[], T],
    options: Options | None = None,
    map_error: ErrorMap | None = None,
    *,
    attempts: int | None = None,
) -> T:
    """Run ``fn``. An exception ``map_error`` recognises is raised as its taxonomy error (the
    original chained); a Throttled one is retried up to ``retry_attempts`` times in all, waiting
    a random 0..min(retry_max_seconds, retry_base_seconds·2ⁿ). The last Throttled is re-raised."""
    from tenacity import (  # imported on the first call, not with the contract
        Retrying,
        retry_if_exception_type,
        stop_after_attempt,
        wait_random_exponential,
    )

    opts = options or Options()

    def attempt() -> T:
        try:
            return fn()
        except ProviderError:
            raise
        except Exception as exc:
            mapped = map_error(exc) if map_error else None
            if mapped is None or mapped is exc:
                raise
            raise mapped from exc

    retrying = Retrying(
        retry=retry_if_exception_type(Throttled),
        stop=stop_after_attempt(attempts or opts.retry_attempts),
        wait=wait_random_exponential(
            multiplier=opts.retry_base_seconds, max=opts.retry_max_seconds
        ),
        reraise=True,
    )
    return retrying(attempt)


def wait_until(
    fetch: Callable[[], T],
    done: Callable[[T], bool],
    *,
    timeout: float,
    interval: float,
    current: T | None = None,
) -> tuple[T, bool]:
    """The one operation wait: ``fetch`` (starting from ``current`` when given) until ``done``
    or ``timeout`` seconds, pausing ``interval`` between fetches (0 where the API's own call
    waits, as GCP's operations.wait does). Returns the last value and whether it was done."""
    deadline = time.monotonic() + timeout
    value = fetch() if current is None else current
    while not done(value):
        if time.monotonic() >= deadline:
            return value, False
        if interval:
            time.sleep(interval)
        value = fetch()
    return value, True
