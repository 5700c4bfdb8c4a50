"""Secret key files the product makes once and trusts afterwards (the dashboard's session key,
the SSH private keys it generates):
read only when they are what was written — a regular file (not a symlink, not a FIFO), owned
by this user, readable by no one else, of the exact length made — else said in one log line
and replaced with a new random key, never trusted. A key anyone else could read or write, or
one cut short, signs nothing: what it signed (the dashboard's sessions) ends, which is right.

Written atomically: the new key goes to a temporary file made with ``O_CREAT|O_EXCL`` and mode
0600, then renamed over the old name (a rename replaces a symlink itself, never its target).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from pathlib import Path

log = logging.getLogger("provisioner.secretfile")


def key(path: Path, size: int = 32) -> bytes:
    """The ``size``-byte key in ``path``: made when missing, replaced when bad (see above)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    made = _make(path, size)
    if made is not None:
        return made
    got, why = _read(path, size)
    if got is not None:
        return got
    log.warning("%s: %s; replaced with a new key (what it signed ends)", path, why)
    return _replace(path, size)


def why_not(path: Path) -> str | None:
    """Why the secret file ``path`` (of any length: an SSH private key) is not to be trusted;
    None: it may be. Its own ``stat``, not its target's: a symlink is not trusted."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return problem(st)


def problem(st: os.stat_result, size: int | None = None) -> str | None:
    """Why a key file with this ``stat`` is not to be trusted (None: it may be); ``size``:
    the exact length written (None: any but empty)."""
    if stat.S_ISLNK(st.st_mode):
        return "a symlink, not the key file made here"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"mode {stat.S_IMODE(st.st_mode):04o}: others may read or write it (0600 expected)"
    if size is not None and st.st_size != size:
        return f"{st.st_size} bytes, not the {size} of a key made here"
    if st.st_size == 0:
        return "0 bytes: empty"
    return None


def _make(path: Path, size: int) -> bytes | None:
    """A new key at ``path`` when there is none (None: a file or a link is already there)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _NOFOLLOW, 0o600)
    except FileExistsError:
        return None
    return _write(fd, size)


def _read(path: Path, size: int) -> tuple[bytes | None, str]:
    """The key, or None and why not; the checks are on the file opened, not on its name."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        if e.errno == errno.ELOOP or path.is_symlink():
            return None, "a symlink, not the key file made here"
        return None, f"cannot be read ({e.strerror or e})"
    with os.fdopen(fd, "rb") as f:
        why = problem(os.fstat(f.fileno()), size)
        if why is not None:
            return None, why
        data = f.read(size + 1)
    if len(data) != size:
        return None, f"{len(data)} bytes, not the {size} of a key made here"
    return data, ""


def _replace(path: Path, size: int) -> bytes:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _NOFOLLOW, 0o600)
    try:
        new = _write(fd, size)
        if path.is_dir() and not path.is_symlink():
            path.rmdir()  # an empty folder in its place; a full one fails below, said
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return new


def _write(fd: int, size: int) -> bytes:
    new = secrets.token_bytes(size)
    with os.fdopen(fd, "wb") as f:
        f.write(new)
        f.flush()
        os.fsync(f.fileno())
    return new


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
