"""Cloud adapters behind one contract (:mod:`providers.base`), looked up by name.

:data:`REGISTRY` is the one list of clouds: a new cloud is its folder (a package whose
``__init__`` declares ``SPEC`` without importing any SDK, see :mod:`providers.spec`) and one line
here. Importing this package imports no cloud SDK: each adapter module is imported on first use,
and the adapters themselves import their SDK inside methods.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from providers.base import Provider, ProviderError
from providers.spec import CloudSpec, Options

REGISTRY: tuple[str, ...] = (
    "aws",
    "gcp",
    "azure",
    "yandex",
    "sbercloud",
    "sandbox",
)
"""Every cloud, in display order: one line each."""


@cache
def spec(name: str) -> CloudSpec:
    if name not in REGISTRY:
        raise KeyError(f"unknown cloud {name!r}; known: {', '.join(REGISTRY)}")
    found: CloudSpec = importlib.import_module(f"providers.{name}").SPEC
    return found


def specs() -> tuple[CloudSpec, ...]:
    return tuple(spec(n) for n in REGISTRY)


CLOUDS: tuple[str, ...] = tuple(n for n in REGISTRY if not spec(n).simulated)
"""The real clouds, in display order (the registry less the simulated one)."""
ALL: tuple[str, ...] = REGISTRY


class MissingSDK(ProviderError):
    """The cloud's SDK is not installed: the message names the pip extra that brings it."""


def sdk_problem(name: str) -> str | None:
    """One sentence when the cloud's SDK is missing, else None (asks the import system where
    the modules are; imports none of them)."""
    s = spec(name)
    for module in s.sdk:
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:  # a parent package is missing
            found = None
        if found is None:
            return (
                f"{name}: its SDK ({module}) is not installed: "
                f"pip install 'gpu-provisioner[{s.extra}]'"
            )
    return None


def _load(target: str) -> Any:
    """What a spec names as ``"module:attr"``, imported now."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def provider_class(name: str) -> type[Provider]:
    cls: type[Provider] = _load(spec(name).adapter)
    return cls


def has_volumes(name: str) -> bool:
    """Whether the cloud has network disks (:attr:`Provider.volumes`), told from its adapter
    class without building one: the planner asks it for clouds whose SDK may be missing."""
    return provider_class(name).volumes is not Provider.volumes


def catalog_rows(name: str) -> Callable[[Path], list[dict[str, Any]]] | None:
    """The cloud's builder of its shipped catalog rows from reference price files (the spec's
    ``catalog_rows``), or None when its catalog is kept by hand."""
    target = spec(name).catalog_rows
    return _load(target) if target else None


def billing_source(name: str) -> Callable[..., Any]:
    """The cloud's billing source (the spec's ``billing``): ``fetch(provider, start, end)``
    returning a :class:`providers.billing.Bill`. Raises BillingUnsupported with the reason."""
    from providers.billing import BillingUnsupported

    s = spec(name)
    if not s.billing:
        raise BillingUnsupported(s.billing_why or f"{name}: no billing source")
    return _load(s.billing)


def create(
    name: str,
    options: Options | Mapping[str, Any] | None = None,
    *,
    clock: Callable[[], datetime] | None = None,
) -> Provider:
    """The adapter for ``name``. Raises :class:`MissingSDK` when its SDK is not installed."""
    problem = sdk_problem(name)
    if problem:
        raise MissingSDK(problem)
    return provider_class(name)(options, clock=clock)
