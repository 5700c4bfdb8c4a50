"""Durations as people write them in experiment and policy files."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

_TEXT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_LONGEST = timedelta(days=3650)  # anything longer is a typo, not a lifetime


def parse_duration(value: Any) -> timedelta:
    """``90m``, ``48h``, ``2d``, ``1w``, a bare number of hours, or ISO 8601 (``PT12H``, as a
    stored spec writes it). Up to ten years."""
    if isinstance(value, timedelta):
        d = value
    elif isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r} (write e.g. 90m, 48h, 2d)")
    elif isinstance(value, int | float):
        d = _bounded(float(value) * 3600, value)
    elif isinstance(value, str) and value.startswith("P"):
        from pydantic import TypeAdapter, ValidationError

        try:
            d = TypeAdapter(timedelta).validate_python(value)
        except ValidationError:
            raise ValueError(f"not an ISO 8601 duration: {value!r}") from None
    else:
        m = _TEXT.match(str(value))
        if not m:
            raise ValueError(f"not a duration: {value!r} (write e.g. 90m, 48h, 2d)")
        d = _bounded(float(m.group(1)) * _UNITS[m.group(2)], value)
    if d < timedelta(0):
        raise ValueError(f"{value!r} is negative")
    if d > _LONGEST:
        raise ValueError(f"{value!r} is longer than ten years")
    return d


#: The shortest and longest autostop (experiment file, `provisioner autostop`, a policy's cap).
AUTOSTOP_MIN, AUTOSTOP_MAX = timedelta(minutes=1), timedelta(days=7)


def autostop_duration(value: Any) -> timedelta:
    """An autostop duration (``30m``, ``2h``): from one minute to seven days."""
    d = parse_duration(value)
    if not AUTOSTOP_MIN <= d <= AUTOSTOP_MAX:
        raise ValueError(f"{value!r}: autostop must be from 1 min to 7 days")
    return d


def _bounded(seconds: float, value: Any) -> timedelta:
    if seconds < 0:
        raise ValueError(f"{value!r} is negative")
    if not seconds < _LONGEST.total_seconds() * 2:  # also catches inf and nan
        raise ValueError(f"{value!r} is longer than ten years")
    return timedelta(seconds=seconds)


def format_duration(d: timedelta) -> str:
    """A duration as people read it: ``45 s``, ``12 min``, ``3 h 20 min``, ``2 d 4 h``
    (never ``0.2 h``), to the nearest unit shown."""
    s = round(d.total_seconds())
    if s < 0:
        return "-" + format_duration(-d)
    if s < 60:
        return f"{s} s"
    minutes = round(s / 60)
    if minutes < 60:
        return f"{minutes} min"
    h, m = divmod(minutes, 60)
    if h < 48:
        return f"{h} h {m} min" if m else f"{h} h"
    days, h = divmod(round(minutes / 60), 24)
    return f"{days} d {h} h" if h else f"{days} d"


def short_duration(d: timedelta) -> str:
    """``30m``, ``2h``, ``1d``, ``90s``: as a file or a command writes it."""
    s = round(d.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s % size == 0:
            return f"{s // size}{unit}"
    return f"{s}s"
