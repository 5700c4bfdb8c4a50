"""An experiment's ``workdir``: the files `up` copies to the machine, chosen and checked before
anything is launched (`plan` and `up` refuse a bad one with its file, line and field).

Refused: the whole file system or the home directory; a special file (named pipe, socket,
device: reading one blocks or never ends), also behind a symlink; more files or bytes than
settings allow (``workdir.max_files``, ``workdir.max_bytes``): code and configs belong here,
data on a volume. The walk stops at the first file over a limit, so a huge tree costs no more
than the limit.
"""

from __future__ import annotations

import fnmatch
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

MAX_FILES = 10_000  # a workdir is code and configs; data belongs on a volume
MAX_BYTES = 1 << 30  # 1 GiB
SPECIAL = {
    stat.S_IFIFO: "a named pipe",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


class BadWorkdir(ValueError):
    """A workdir that is not copied: the reason, with the path."""


def files(
    workdir: str, max_files: int = MAX_FILES, max_bytes: int = MAX_BYTES
) -> tuple[list[str], str]:
    """The files of ``workdir`` to copy, relative and sorted, and how they were chosen: ``git
    ls-files`` (tracked and untracked, less what .gitignore excludes) in a git work tree, else a
    walk skipping what the top-level .gitignore's simple patterns match (``name``, ``*.ext``,
    ``dir/``, ``/rooted``; no ``!`` negation) and ``.git``. :class:`BadWorkdir` for a path
    that is no workdir, a special file, or a tree over the limits."""
    root = Path(workdir)
    if root == Path(root.anchor):
        raise BadWorkdir(f"{workdir} is the whole file system: name the folder of your code")
    if root == Path.home().resolve() or root == Path(os.path.expanduser("~")):
        raise BadWorkdir(f"{workdir} is the home directory: name the folder of your code")
    try:
        listed = subprocess.run(
            ["git", "-C", workdir, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
        names: Iterator[str] = (f for f in listed.decode().split("\0") if f)
        how = "git ls-files"
    except (OSError, subprocess.SubprocessError):
        names, how = _walk(root), ".gitignore (simple patterns)"
    out: list[str] = []
    size = 0
    for rel in names:
        path = root / rel
        try:
            st = path.stat()  # through a symlink: what would be read
        except OSError:
            continue  # gone meanwhile, or a dangling symlink: nothing to copy
        kind = SPECIAL.get(stat.S_IFMT(st.st_mode))
        if kind:
            raise BadWorkdir(f"{path} is {kind}: a workdir holds regular files only")
        if not stat.S_ISREG(st.st_mode):
            continue  # a directory (a submodule) is walked by its own entries
        out.append(rel)
        size += st.st_size
        if len(out) > max_files:
            raise BadWorkdir(
                f"{workdir} has more than {max_files:,} files to copy (workdir.max_files in "
                "settings): keep data on a volume, or list it in .gitignore"
            )
        if size > max_bytes:
            raise BadWorkdir(
                f"{workdir} has more than {max_bytes:,} bytes to copy (workdir.max_bytes in "
                "settings): keep data on a volume, or list it in .gitignore"
            )
    return sorted(out), how


def _walk(root: Path) -> Iterator[str]:
    patterns = []
    ignore = root / ".gitignore"
    if ignore.is_file():
        for line in ignore.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "!")):
                patterns.append(line)

    def ignored(rel: str, is_dir: bool) -> bool:
        name = rel.rsplit("/", 1)[-1]
        for p in patterns:
            dir_only = p.endswith("/")
            p = p.rstrip("/")
            if dir_only and not is_dir:
                continue
            if p.startswith("/") or "/" in p:
                if fnmatch.fnmatchcase(rel, p.lstrip("/")):
                    return True
            elif fnmatch.fnmatchcase(name, p):
                return True
        return False

    for here, dirs, names in os.walk(root):
        base = Path(here).relative_to(root).as_posix()
        prefix = "" if base == "." else base + "/"
        dirs[:] = sorted(d for d in dirs if d != ".git" and not ignored(prefix + d, True))
        yield from (prefix + n for n in sorted(names) if not ignored(prefix + n, False))
