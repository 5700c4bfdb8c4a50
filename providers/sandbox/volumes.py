"""The sandbox's volumes: rows of its SQLite file, under the strictest cloud's rules.

The sandbox keeps EBS's rules (the default, single-attach volume types), so what passes
here passes on the strictest cloud: AttachVolume, "The volume and instance must be within
the same Availability Zone"; DeleteVolume, "The volume must be in the available state
(not attached to an instance)"
(https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_AttachVolume.html,
.../API_DeleteVolume.html); a volume not in the available state cannot be attached again
(Multi-Attach is an io1/io2 feature only). Terminating a machine leaves its volumes,
detached (DeleteOnTermination is false for a volume attached after launch).
"""

from __future__ import annotations

import json
import secrets
import sqlite3
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from providers.base import (
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    InstanceRef,
    InvalidRequest,
    NotFound,
    Volume,
    VolumeRef,
    VolumeRequest,
    VolumeService,
    VolumeState,
)

if TYPE_CHECKING:
    from providers.sandbox.adapter import SandboxProvider


class SandboxVolumes(VolumeService):
    """The volume half of :class:`~providers.sandbox.adapter.SandboxProvider`."""

    def __init__(self, provider: SandboxProvider) -> None:
        self.p = provider

    def create(self, request: VolumeRequest) -> Volume:
        def create(db: sqlite3.Connection) -> Volume:
            row = db.execute("SELECT * FROM volumes WHERE token = ?", (request.token,)).fetchone()
            if row is None:  # the same token again: the same volume
                vid = "sbv-" + secrets.token_hex(6)
                db.execute(
                    "INSERT INTO volumes VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        vid,
                        request.name,
                        request.token,
                        request.region,
                        request.zone,
                        request.size_gb,
                        "available",
                        json.dumps(dict(request.labels)),
                        None,
                        None,
                        self.p._now().isoformat(),
                    ),
                )
                row = db.execute("SELECT * FROM volumes WHERE id = ?", (vid,)).fetchone()
            return to_volume(row)

        return self.p._call(create)

    def _row(self, db: sqlite3.Connection, ref: VolumeRef) -> sqlite3.Row:
        row = db.execute("SELECT * FROM volumes WHERE id = ?", (ref.id,)).fetchone()
        if row is None:
            raise NotFound(f"sandbox: no volume {ref.id}", code="SandboxVolumeNotFound")
        return row

    def get(self, ref: VolumeRef) -> Volume:
        return self.p._call(lambda db: to_volume(self._row(db, ref)))

    def ours(self, regions: Sequence[str] | None = None) -> list[Volume]:
        def query(db: sqlite3.Connection) -> list[Volume]:
            out = []
            for row in db.execute("SELECT * FROM volumes ORDER BY created_at, id"):
                if json.loads(row["labels"]).get(TAG_MANAGED_BY) != TAG_MANAGED_BY_VALUE:
                    continue
                if regions and row["region"] not in regions:
                    continue
                out.append(to_volume(row))
            return out

        return self.p._call(query)

    def attach(self, volume: VolumeRef, instance: InstanceRef, index: int) -> None:
        def attach(db: sqlite3.Connection) -> None:
            vol = self._row(db, volume)
            machine = self.p._row(db, instance)
            if vol["attached_to"] == machine["id"]:
                return
            if machine["state"] == "terminated":
                raise NotFound(
                    f"sandbox: machine {instance.id} is terminated", code="SandboxNotFound"
                )
            if vol["zone"] != machine["zone"]:
                raise InvalidRequest(
                    f"sandbox: volume {vol['id']} is in {vol['zone']}, machine "
                    f"{machine['id']} in {machine['zone']}: they must be in the same zone",
                    code="SandboxVolumeZoneMismatch",
                )
            if vol["attached_to"] is not None:
                raise InvalidRequest(
                    f"sandbox: volume {vol['id']} is attached to {vol['attached_to']}",
                    code="SandboxVolumeInUse",
                )
            db.execute(
                "UPDATE volumes SET state = 'in-use', attached_to = ?, device_index = ?"
                " WHERE id = ?",
                (machine["id"], index, vol["id"]),
            )

        self.p._call(attach)

    def detach(self, volume: VolumeRef, instance: InstanceRef) -> None:
        def detach(db: sqlite3.Connection) -> None:
            vol = self._row(db, volume)
            if vol["attached_to"] == instance.id:
                db.execute(
                    "UPDATE volumes SET state = 'available', attached_to = NULL,"
                    " device_index = NULL WHERE id = ?",
                    (vol["id"],),
                )

        self.p._call(detach)

    def delete(self, ref: VolumeRef) -> None:
        def delete(db: sqlite3.Connection) -> None:
            row = db.execute("SELECT * FROM volumes WHERE id = ?", (ref.id,)).fetchone()
            if row is None:  # gone already: delete is idempotent
                return
            if row["attached_to"] is not None:
                raise InvalidRequest(
                    f"sandbox: volume {ref.id} is attached to {row['attached_to']}",
                    code="SandboxVolumeInUse",
                )
            db.execute("DELETE FROM volumes WHERE id = ?", (ref.id,))

        self.p._call(delete)

    def device(self, volume: Volume, index: int, machine_type: str = "") -> str:
        """As a virtio disk shows its serial (the volume's id) under /dev/disk/by-id."""
        return f"/dev/disk/by-id/virtio-{volume.id}"


def to_volume(row: sqlite3.Row) -> Volume:
    return Volume(
        id=row["id"],
        name=row["name"],
        region=row["region"],
        zone=row["zone"],
        size_gb=row["size_gb"],
        state=VolumeState(row["state"]),
        labels=json.loads(row["labels"]),
        attached_to=row["attached_to"],
        created_at=datetime.fromisoformat(row["created_at"]),
    )


def release(db: sqlite3.Connection, machine_id: str) -> None:
    """A terminated machine's volumes stay, detached."""
    db.execute(
        "UPDATE volumes SET state = 'available', attached_to = NULL, device_index = NULL"
        " WHERE attached_to = ?",
        (machine_id,),
    )
