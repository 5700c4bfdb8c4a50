"""Who acts in this thread when it is not the process's actor: a dashboard request acts as
its signed-in user, while the other requests the same process serves act as theirs.

A :class:`~contextvars.ContextVar`: each thread (each request a WSGI server serves) sees its
own value, so one request's user never lands in another's events. ``App.actor`` and the
events a database session writes read it before the process's actor."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_who: ContextVar[str | None] = ContextVar("provisioner_acting", default=None)


def current() -> str | None:
    """Who acts in this thread, when set by :func:`acting_as` (None: the process's actor)."""
    return _who.get()


@contextmanager
def acting_as(who: str) -> Iterator[None]:
    """Within the block, this thread acts as ``who``: its events record them."""
    token = _who.set(who)
    try:
        yield
    finally:
        _who.reset(token)
