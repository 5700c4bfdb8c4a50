"""The workdir as ``up`` took it, kept with the state (table ``workdirs``, 0016): a gzipped tar of
the files chosen (:mod:`provisioner.workdir`, within settings' ``workdir`` limits), so every
later copy to the machine — its first start once a cloud machine answers SSH, a start again in
place, a relaunch after a preemption, by whichever scheduler on whichever host — restores the
same files, not the laptop's folder as it is by then. ``sync`` takes it again (the user asks for
the folder as it is now).

A replacement machine uses the copy of the machine it replaces: :func:`relaunching` marks the
``up`` of a relaunch, so the copy follows before the replacement's job starts.
"""

from __future__ import annotations

import contextlib
import io
import tarfile
import tempfile
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

from sqlalchemy import select

from provisioner.app import App
from provisioner.errors import UserError
from provisioner.machines import joblogs
from provisioner.models import Machine, WorkdirCopy

_REPLACING: ContextVar[str | None] = ContextVar("replacing", default=None)


@contextlib.contextmanager
def relaunching(machine_id: str) -> Iterator[None]:
    """Within: an ``up`` that replaces ``machine_id`` (its workdir copy is the new one's)."""
    token = _REPLACING.set(machine_id)
    try:
        yield
    finally:
        _REPLACING.reset(token)


def replacing() -> str | None:
    """The machine the ``up`` under way replaces (:func:`relaunching`), if any."""
    return _REPLACING.get()


def pack(source: str, files: list[str]) -> bytes:
    """``files`` of the folder ``source`` as a gzipped tar (an unreadable one: UserError)."""
    buf = io.BytesIO()
    try:
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for rel in files:
                tar.add(str(Path(source) / rel), arcname=rel, recursive=False)
    except OSError as e:
        raise UserError(f"workdir: cannot read {e.filename}: {e.strerror}") from None
    return buf.getvalue()


def take(app: App, m: Machine, source: str, files: list[str]) -> int:
    """``files`` of the folder ``source`` kept as ``m``'s workdir (replacing any); its bytes."""
    return keep(app, m, source, len(files), pack(source, files))


def keep(app: App, m: Machine, source: str, files: int, archive: bytes) -> int:
    with app.db.session() as s:
        row = s.get(WorkdirCopy, m.id) or WorkdirCopy(machine_id=m.id)
        row.taken_at, row.source, row.files, row.archive = app.clock.now(), source, files, archive
        s.add(row)
    return len(archive)


def at_up(app: App, m: Machine, taken: tuple[str, int, bytes] | None) -> None:
    """At ``up`` of the new machine ``m``: the workdir ``taken`` (folder, files, archive) kept —
    or, for a relaunch (:func:`relaunching`), the replaced machine's copy kept as ``m``'s."""
    replaced = _REPLACING.get()
    if replaced is not None:
        with app.db.session() as s:
            old = s.get(WorkdirCopy, replaced)
            if old is not None:
                s.merge(
                    WorkdirCopy(
                        machine_id=m.id,
                        taken_at=old.taken_at,
                        source=old.source,
                        files=old.files,
                        archive=old.archive,
                    )
                )
                return
    if taken is not None:
        keep(app, m, *taken)


def kept(app: App, m: Machine) -> WorkdirCopy | None:
    """``m``'s workdir copy, else the newest of the machines it replaced."""
    with app.db.session() as s:
        rows = {
            r.machine_id: r
            for r in s.scalars(
                select(WorkdirCopy).where(WorkdirCopy.machine_id.in_(joblogs.lineage(app, m)))
            )
        }
        for r in rows.values():
            s.expunge(r)
    for mid in reversed(joblogs.lineage(app, m)):
        if mid in rows:
            return rows[mid]
    return None


@contextlib.contextmanager
def restored(row: WorkdirCopy) -> Iterator[tuple[str, list[str]]]:
    """The kept workdir unpacked in a temporary folder: (folder, its files)."""
    with tempfile.TemporaryDirectory(prefix="pv-workdir-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(row.archive), mode="r:gz") as tar:
            names = [t.name for t in tar.getmembers() if t.isfile()]
            tar.extractall(tmp, filter="data")  # no path outside the folder, no devices
        yield tmp, sorted(names)
