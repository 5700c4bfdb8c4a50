"""The sandbox a systemd unit, a cron line or a pod gives its command, emulated with bubblewrap
for tests/test_deploy.py: the host's root read-only, the writable and hidden places put in it,
the command run as the unit's (or pod's) user with no capability left."""

from __future__ import annotations

import os
import pwd
import shlex
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT


class Unit:
    """A unit file as systemd reads it: sections of (key, value) in order, ``%`` specifiers of a
    system unit resolved (an unknown one fails: the test must learn what it means)."""

    SPECIFIERS = {"%S": "/var/lib", "%%": "%"}

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sections: dict[str, list[tuple[str, str]]] = {}
        section = ""
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("["):
                section = line.strip("[]")
                self.sections.setdefault(section, [])
                continue
            key, _, value = line.partition("=")
            self.sections[section].append((key.strip(), self._resolve(value.strip())))

    def _resolve(self, value: str) -> str:
        out, i = "", 0
        while i < len(value):
            if value[i] == "%":
                spec = value[i : i + 2]
                assert spec in self.SPECIFIERS, f"{self.path.name}: specifier {spec} not emulated"
                out, i = out + self.SPECIFIERS[spec], i + 2
            else:
                out, i = out + value[i], i + 1
        return out

    def all(self, key: str, section: str = "Service") -> list[str]:
        return [v for k, v in self.sections.get(section, []) if k == key]

    def get(self, key: str, default: str = "", section: str = "Service") -> str:
        values = self.all(key, section)
        return values[-1] if values else default

    def keys(self, section: str = "Service") -> set[str]:
        return {k for k, _ in self.sections.get(section, [])}


#: [Service] directives the sandbox below reproduces (or that only tell systemd how to supervise)


def bwrap(
    mounts: list[tuple[str, str, str]], *, hide: tuple[str, ...] = (), own_pids: bool = True
) -> list[str]:
    """``bwrap`` arguments for the host's root read-only with ``mounts`` (destination, kind:
    bind | ro-bind | tmpfs | dev | proc, source) placed in it. No mount point is ever made on the
    host: each destination's ancestors become directories of the sandbox's own root, every host
    entry beside them bound back read-only, and that root is made read-only at the end. ``hide``:
    empty read-only directories (systemd's ProtectHome=). ``own_pids``: a PID namespace, so
    whatever the command leaves running ends with it, as when systemd stops a oneshot unit's
    control group or a pod ends (under cron it is hygiene: the test leaves nothing behind)."""
    mounts = [*mounts, *((h, "tmpfs", "") for h in hide)]
    dests = {d for d, _, _ in mounts}

    def inside(p: Path) -> bool:
        return any(p == Path(d) or Path(d) in p.parents for d in dests)

    expanded = {str(a) for d in dests for a in Path(d).parents if not inside(a)}
    args: list[str] = []

    def fill(directory: str) -> None:
        for entry in sorted(os.listdir(directory)):
            p = os.path.join(directory, entry)
            if p in dests:
                continue
            if p in expanded:
                args.extend(["--dir", p])
                fill(p)
            elif os.path.islink(p):
                args.extend(["--symlink", os.readlink(p), p])
            elif os.path.exists(p):
                args.extend(["--ro-bind", p, p])

    fill("/")
    made = set(expanded)
    for dest, kind, src in sorted(mounts, key=lambda m: len(Path(m[0]).parts)):
        for a in reversed(Path(dest).parents):  # within a tmpfs: traversable, as on the host
            if str(a) not in made and str(a) not in dests:
                args.extend(["--perms", "0755", "--dir", str(a)])
                made.add(str(a))
        if kind == "tmpfs":
            args.extend(["--perms", "0755" if dest in hide else "1777", "--tmpfs", dest])
        elif kind in ("dev", "proc"):
            args.extend([f"--{kind}", dest])
        else:
            args.extend([f"--{kind}", src, dest])
    args.extend(["--remount-ro", "/"])
    for h in hide:
        args.extend(["--remount-ro", h])
    pids = ["--unshare-pid"] if own_pids else []
    return ["bwrap", "--die-with-parent", "--new-session", *pids, "--chdir", "/", *args]


def code_mounts() -> list[tuple[str, str, str]]:
    """The tree under test, its venv and the interpreter the venv was made from (pyenv's, say,
    under /root), where they are: ProtectHome= or a private /tmp may hide them otherwise, and
    their ancestors become traversable by any user. A packaged install lives in /usr instead."""
    paths = [ROOT, Path(sys.prefix), Path(sys.base_prefix)]
    paths = [p for p in paths if Path("/usr") not in (p, *p.parents)]
    return [(str(p), "ro-bind", str(p)) for p in paths if not any(q in p.parents for q in paths)]


def as_user(uid: int, gid: int, groups: list[int] | None = None) -> list[str]:
    """What systemd's User= (and a pod's runAsUser) does once the sandbox is set: the uid and
    groups, no capability left (CapabilityBoundingSet=), no way back (NoNewPrivileges=)."""
    if os.getuid() != 0:
        return []  # bwrap as an unprivileged user: already that user, and no capability
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={gid}",
        *([f"--groups={','.join(map(str, groups))}"] if groups else ["--init-groups"]),
        "--bounding-set=-all",
        "--inh-caps=-all",
        "--no-new-privs",
        "--",
    ]


def system_user(name: str, home: str, shell: str = "/usr/sbin/nologin") -> pwd.struct_passwd:
    """The user a unit or a crontab runs as: made as the unit's install comment says when the
    suite runs as root (CI), else the user running it."""
    if os.getuid() != 0:
        return pwd.getpwuid(os.getuid())
    for _ in range(50):  # xdist workers may race on /etc/passwd's lock: the user is made once
        try:
            return pwd.getpwnam(name)
        except KeyError:
            subprocess.run(
                [
                    *("useradd", "--system", "--user-group", "--no-create-home"),
                    *("--home-dir", home, "--shell", shell, name),
                ],
                capture_output=True,
            )
            time.sleep(0.1)
    return pwd.getpwnam(name)


def environment(unit: Unit, etc: Path | None = None) -> dict[str, str]:
    """Environment=, then EnvironmentFile= (``-``: optional) read where /etc/provisioner is."""
    env: dict[str, str] = {}
    for value in unit.all("Environment"):
        env.update(item.split("=", 1) for item in shlex.split(value))
    for value in unit.all("EnvironmentFile"):
        path = Path(value.removeprefix("-"))
        if etc is not None and path.parent == Path("/etc/provisioner"):
            path = etc / path.name
        if not path.exists() and value.startswith("-"):
            continue
        for line in path.read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                env.update([line.strip().split("=", 1)])
    return env
