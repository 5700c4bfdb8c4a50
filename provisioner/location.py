"""Where settings and state live, with the standard library only: :mod:`provisioner.settings`
validates ``home`` and ``state_url`` with these checks, and a command that needs nothing but
the state's location and defaults (``status``) can find it without pydantic (~75 ms)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import platformdirs

APP = "provisioner"
PREFIX = "PROVISIONER_"

#: Every field of :class:`provisioner.settings.Settings` (tests/test_cli.py checks the list):
#: a variable ``PROVISIONER_<field>`` or ``PROVISIONER_<field>__<key>``, in any case, sets it.
FIELDS = (
    "state_url",
    "clouds",
    "currency",
    "rates",
    "prices",
    "disk_prices",
    "address_prices",
    "policies",
    "smtp",
    "scheduler",
    "ownership",
    "dashboard",
    "notify",
    "identity",
    "home",
    "timezone",
    "teams",
    "database",
    "workdir",
    "jobs",
)


#: The default of ``scheduler.heartbeat_grace_seconds``: an agent silent longer is not heard.
HEARTBEAT_GRACE_SECONDS = 300


def data_dir() -> Path:
    return Path(os.environ.get("PROVISIONER_HOME") or platformdirs.user_data_dir(APP))


def default_config_path() -> Path:
    return Path(platformdirs.user_config_dir(APP)) / "settings.yaml"


def _virtual(path: Path) -> bool:
    """/proc and /sys: writable to root on paper, never a place for files."""
    return path.resolve().parts[1:2] in (("proc",), ("sys",))


def checked_home(v: Path) -> Path:
    """``home``, its ``~`` expanded; ValueError when no directory can be made there."""
    v = v.expanduser()
    parent = v
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if v.exists() and not v.is_dir():
        raise ValueError(f"{str(v)!r} is not a directory")
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK) or _virtual(parent):
        raise ValueError(f"cannot create a directory in {str(parent)!r}: choose a writable place")
    return v


def checked_state_url(v: str | None) -> str | None:
    if v is not None and not re.match(r"^(sqlite|postgresql(\+psycopg)?)://", v):
        raise ValueError(
            f"write sqlite:///PATH or postgresql://USER@HOST:PORT/DB (got {v.split(':', 1)[0]!r}…)"
        )
    return v


def database_url(state_url: str | None, home: Path) -> str:
    return state_url or f"sqlite:///{home / 'state.db'}"


def plain_database_url(config: str | None = None) -> str | None:
    """The state's URL as ``load_settings(config).database_url`` gives it, when no settings file
    applies and the environment sets nothing but ``PROVISIONER_HOME`` or
    ``PROVISIONER_STATE_URL`` (upper case, valid): every other field is then at its default,
    which is valid. None when settings must decide (a file to read, another variable, a value
    they would refuse: loading them says so with its file, line or variable)."""
    if config or os.environ.get("PROVISIONER_CONFIG") or default_config_path().exists():
        return None
    given: dict[str, str] = {}
    for name, value in os.environ.items():
        field = name.lower().removeprefix(PREFIX.lower())
        if field == name.lower() or field.split("__")[0] not in FIELDS:
            continue  # not a setting: PROVISIONER_CONFIG, PROVISIONER_CLOCK, …
        if field.split("__")[0] == "identity":
            continue  # who runs it: this path writes nothing, so no event records them
        if field not in ("home", "state_url") or name != name.upper() or not value:
            return None
        given[field] = value
    try:
        state_url = checked_state_url(given.get("state_url"))
        home = checked_home(Path(given["home"]) if "home" in given else data_dir())
    except ValueError:
        return None
    return database_url(state_url, home)
