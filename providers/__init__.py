"""Cloud adapters behind one contract (:mod:`providers.base`), looked up lazily by name.

Importing this package imports no cloud SDK: each adapter module is imported on first use, and
the adapters themselves import their SDK inside methods.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from providers.base import Provider

CLOUDS: tuple[str, ...] = ("aws", "gcp", "azure", "yandex", "sbercloud")
"""The real clouds, in display order. ``sandbox`` is the simulated one."""

_ADAPTERS: dict[str, str] = {
    "sandbox": "providers.sandbox:SandboxProvider",
    "aws": "providers.aws:AWSProvider",
    "gcp": "providers.gcp:GCPProvider",
    "azure": "providers.azure:AzureProvider",
    "yandex": "providers.yandex:YandexProvider",
    "sbercloud": "providers.sbercloud:SberCloudProvider",
}

ALL: tuple[str, ...] = (*CLOUDS, "sandbox")


def provider_class(name: str) -> type[Provider]:
    try:
        target = _ADAPTERS[name]
    except KeyError:
        raise KeyError(f"unknown cloud {name!r}; known: {', '.join(ALL)}") from None
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def create(name: str, options: Mapping[str, Any] | None = None) -> Provider:
    return provider_class(name)(options)
