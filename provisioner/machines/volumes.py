"""Volumes: network disks kept per project and name, outliving the machines that mount them.

A volume is created once, in the zone of the first machine that names it (``prepare``, just
before that machine's launch; removed again, still empty, if the launch fails there), attached
after every launch, adoption and start (``attach``), mounted by the startup data (``mounts``),
and deleted only by ``provisioner volume rm`` (``remove``). ``down`` never touches it: the
clouds leave a volume attached after launch, detached, when its machine is terminated.

Crash safety as for machines: the row is written first (``creating``, with a token), then the
cloud is asked to create by that token, so a rerun finds the same disk. The ledger bills it
from creation to deletion at the rate fixed at creation (see :class:`provisioner.models.Volume`
for how its usage joins the ledger). "Attached to" is the last machine it was attached to, and
counts only while that machine is live: however a machine ends, its volumes are free.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from providers import disks
from providers.base import (
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    TAG_OWNER,
    TAG_PROJECT,
    InstanceRef,
    NotFound,
    ProviderError,
    VolumeRef,
    VolumeRequest,
    VolumeService,
    VolumeState,
)
from providers.base import Volume as CloudVolume
from provisioner import permits, team_sql
from provisioner.app import App
from provisioner.crashpoints import crashpoint
from provisioner.errors import OperationFailed, UserError
from provisioner.ledger.record import spend
from provisioner.machines.record import disk_rate, record_event, ref
from provisioner.models import (
    VOLUME_MARKET,
    Machine,
    UsageInterval,
    Volume,
    new_id,
)
from provisioner.money import Money
from provisioner.planner import Candidate
from provisioner.schema import EventKind, MachineStatus, UsageKind, VolumeStatus
from provisioner.spec import Experiment, VolumeSpec

S = MachineStatus
TAG_VOLUME = "provisioner-volume"  # the state's id of a volume, on the cloud's disk
KIND = UsageKind.VOLUME  # its usage intervals' kind


@dataclass(frozen=True)
class Ready:
    """One of an experiment's volumes, ready for a launch attempt."""

    spec: VolumeSpec
    index: int  # its place in the experiment's list: the attach index and the device
    row_id: str
    cloud: str
    disk: CloudVolume
    created: bool  # new (never attached, so empty): removed if the launch fails
    machine_type: str = ""  # the candidate's: where its guest sees the disk (AWS Xen/Nitro)


# --- reading ------------------------------------------------------------------------------------


def live(
    s: Session, project: str | None = None, names: Iterable[str] | None = None
) -> list[Volume]:
    """The volumes not deleted, of ``project`` (every project: None) and ``names``."""
    q = select(Volume).where(Volume.status != VolumeStatus.DELETED)
    if project is not None:
        q = q.where(Volume.project == project)
    if names is not None:
        q = q.where(Volume.name.in_(list(names)))
    return list(s.scalars(q.order_by(Volume.project, Volume.name)))


def holder(s: Session, v: Volume) -> Machine | None:
    """The live machine ``v`` is attached to, if any."""
    if v.attached_machine_id is None:
        return None
    m = s.get(Machine, v.attached_machine_id)
    return m if m is not None and m.is_live else None


def _service(app: App, cloud: str) -> VolumeService:
    """The cloud's volume service; a volume or an experiment naming one on a cloud without
    them (the planner offers no such cloud) is refused in one line."""
    service = app.provider(cloud).volumes
    if service is None:
        raise OperationFailed(f"{cloud} has no volumes")
    return service


def vref(v: Volume) -> VolumeRef:
    return VolumeRef(id=v.volume_id or "", region=v.region, zone=v.zone, name=cloud_name(v))


def cloud_name(v: Volume) -> str:
    return f"{v.name}-{v.id[:6]}"


def check_free(app: App, experiment: Experiment) -> None:
    """Before anything is launched: no volume the experiment names may be attached to a live
    machine of another name (the same name is the machine ``up`` replaces after a
    preemption; a preempted machine kept with its disk until its replacement runs goes by
    another name meanwhile, its experiment's name is the same)."""
    if not experiment.volumes:
        return
    with app.db.session() as s:
        for v in live(s, experiment.project, [x.name for x in experiment.volumes]):
            m = holder(s, v)
            if m is None or _replaced(m, experiment):
                continue
            if m.name != experiment.name:
                raise UserError(
                    f"volume {v.name} of project {v.project} is attached to {m.name} "
                    f"({m.status}); a volume is mounted by one machine at a time: "
                    f"`provisioner down {m.name}` first"
                )


def _replaced(m: Machine, experiment: Experiment) -> bool:
    """``m`` is a preempted machine of ``experiment``, kept until its replacement runs."""
    return m.status == S.PREEMPTED and (m.spec or {}).get("name") == experiment.name


# --- before a launch: the volumes in the candidate's zone ---------------------------------------


def prepare(app: App, machine: Machine, experiment: Experiment, cand: Candidate) -> list[Ready]:
    """Each of the experiment's volumes in ``cand``'s zone: found, or created there now (the
    planner keeps only candidates where an existing one is). Raises the cloud's
    :class:`ProviderError` when one cannot be created; those created before it are removed."""
    out: list[Ready] = []
    try:
        for i, spec in enumerate(experiment.volumes):
            out.append(_ready(app, machine, experiment, cand, spec, i))
    except (ProviderError, OperationFailed):
        discard(app, out)
        raise
    return out


def _ready(
    app: App, machine: Machine, e: Experiment, cand: Candidate, spec: VolumeSpec, index: int
) -> Ready:
    o = cand.offer
    with app.db.session() as s:
        found = live(s, e.project, [spec.name])
    v = found[0] if found else _write_intent(app, machine, e, cand, spec)
    if (v.cloud, v.region) != (o.cloud, o.region) or (v.zone and o.zone and v.zone != o.zone):
        raise OperationFailed(  # the planner pins the plan: this is a race with another `up`
            f"volume {v.name} is in {v.cloud} {v.zone or v.region}, not {cand.where}: run "
            f"`provisioner up` again"
        )
    if why := disks.refusal(o.cloud, o.instance_type, disk_type(app, v)):
        raise OperationFailed(  # the planner turns such candidates down: a race, or an old plan
            f"volume {v.name} cannot attach to {o.instance_type}: {why}"
        )
    # never attached to a machine, it holds no data: removed again if this launch fails
    empty = v.attached_machine_id is None
    if v.status != VolumeStatus.CREATING:
        try:
            cv = _service(app, v.cloud).get(vref(v))
        except NotFound:
            raise OperationFailed(
                f"volume {v.name} ({v.volume_id}) is gone from {v.cloud}, deleted outside "
                f"provisioner: `provisioner volume rm {v.name} --project {v.project}` forgets "
                f"it (its billing ends), then `provisioner up` makes a new, empty one"
            ) from None
        return Ready(spec, index, v.id, v.cloud, cv, empty, o.instance_type)
    return Ready(spec, index, v.id, v.cloud, _create(app, v), empty, o.instance_type)


def _write_intent(
    app: App, machine: Machine, e: Experiment, cand: Candidate, spec: VolumeSpec
) -> Volume:
    """The volume's row (``creating``, with its token) and its ledger row, before the cloud
    is asked. Another `up` of the project that wrote it first wins: its row is used."""
    o = cand.offer
    now = app.clock.now()
    currency = cand.price.currency
    rate = disk_rate(app, o.cloud, currency, spec.size_gb)
    vid = new_id()
    try:
        with app.db.session() as s:
            s.add(
                Machine(
                    id=vid,
                    name=f"volume:{spec.name}",
                    project=e.project,
                    owner=e.owner,
                    status=S.TERMINATED,
                    spec={
                        "volume": spec.model_dump(mode="json"),
                        "machine": machine.name,
                        # made for the candidate's family (GCP: Hyperdisk on A3 Ultra/A4)
                        "disk_type": disks.volume_type(o.cloud, o.instance_type),
                    },
                    created_at=now,
                    cloud=o.cloud,
                    region=o.region,
                    zone=o.zone,
                    market=VOLUME_MARKET,
                    currency=currency,
                    disk_gb=spec.size_gb,
                    disk_rate=rate,
                )
            )
            s.flush()
            v = Volume(
                id=vid,
                project=e.project,
                name=spec.name,
                owner=e.owner,
                cloud=o.cloud,
                region=o.region,
                zone=o.zone,
                size_gb=spec.size_gb,
                token=f"pv-{vid}",
                status=VolumeStatus.CREATING,
                rate=rate,
                currency=currency,
                created_at=now,
            )
            s.add(v)
        return v
    except IntegrityError:
        with app.db.session() as s:
            found = live(s, e.project, [spec.name])
        if not found:
            raise OperationFailed(
                f"volume {spec.name} changed while this `up` wrote it; run `provisioner up` again"
            ) from None
        return found[0]


def _create(app: App, v: Volume) -> CloudVolume:
    """Create ``v`` in its cloud by its token (a rerun after a crash gets the same disk), then
    record it and open its usage."""
    request = VolumeRequest(
        disk_type=disk_type(app, v),
        name=cloud_name(v),
        token=v.token,
        region=v.region,
        zone=v.zone,
        size_gb=v.size_gb,
        labels={
            TAG_MANAGED_BY: TAG_MANAGED_BY_VALUE,
            TAG_VOLUME: v.id,
            TAG_PROJECT: v.project,
            TAG_OWNER: v.owner,
        },
    )
    crashpoint("before-volume-create")
    cv = _service(app, v.cloud).create(request)
    crashpoint("after-volume-create")
    now = app.clock.now()
    with app.db.session() as s:
        row = s.get(Volume, v.id)
        assert row is not None
        row.volume_id, row.region, row.zone = cv.id, cv.region, cv.zone or row.zone
        row.status = VolumeStatus.AVAILABLE
        if row.rate is not None:
            s.add(
                UsageInterval(
                    machine_id=row.id,
                    kind=KIND,
                    started_at=now,
                    rate=row.rate,
                    currency=row.currency,
                )
            )
    return cv


def disk_type(app: App, v: Volume) -> str:
    """The disk type ``v`` was made of (or is being made of): chosen for the family of its
    first machine; "" for a volume recorded before types were kept (the cloud's default)."""
    with app.db.session() as s:
        row = s.get(Machine, v.id)
        return str(((row.spec if row else None) or {}).get("disk_type") or "")


def discard(app: App, ready: Sequence[Ready]) -> list[str]:
    """Remove the volumes made for a launch attempt that failed (they are empty), so none is
    stranded in a zone the machine did not go to. Returns what could not be removed."""
    left = []
    for r in ready:
        if not r.created:
            continue
        try:
            _service(app, r.cloud).delete(r.disk.ref)
        except ProviderError as e:
            left.append(f"volume {r.spec.name} ({r.disk.id} in {r.disk.zone}): {e}")
            continue
        _deleted(app, r.row_id)
    return left


def _deleted(app: App, row_id: str) -> None:
    """The volume is gone: its row deleted, its usage closed now."""
    now = app.clock.now()
    with app.db.session() as s:
        v = s.get(Volume, row_id)
        assert v is not None
        v.status, v.deleted_at = VolumeStatus.DELETED, now
        m = s.get(Machine, row_id)
        if m is not None:
            m.terminated_at = now
        for iv in s.scalars(
            select(UsageInterval).where(
                UsageInterval.machine_id == row_id, UsageInterval.ended_at.is_(None)
            )
        ):
            iv.ended_at = max(now, iv.started_at)


def mounts(app: App, ready: Sequence[Ready]) -> list[tuple[str, str]]:
    """(device the machine will see, mount path) of each volume, for the startup data: the
    device as the candidate's machine family shows it (AWS: NVMe link on Nitro, /dev/xvdf on
    Xen)."""
    return [
        (_service(app, r.cloud).device(r.disk, r.index, r.machine_type), r.spec.path) for r in ready
    ]


# --- after a launch, an adoption or a start ---------------------------------------------------


def attach(app: App, machine_id: str, experiment: Experiment) -> list[str]:
    """Attach each of the experiment's volumes to the machine (idempotent: one attached there
    already is left). A volume the cloud still shows attached to a machine of ours that is
    terminated (a cloud detaches after the terminate, not at once), or to the preempted
    machine this one replaces (kept, stopped with its boot disk, until this one runs), is
    detached from it first; one attached to any other instance is refused. Returns the
    volumes attached.

    The cloud's answers keep their kind: the machine gone from its cloud (deleted outside, or
    taken back for good) is :class:`NotFound` — so recovery launches a new machine with the
    volumes rather than counting a failed try —, no room is :class:`CapacityError`; only a
    volume the state cannot attach (gone, held elsewhere) is :class:`OperationFailed`."""
    if not experiment.volumes:
        return []
    with app.db.session() as s:
        m = s.get(Machine, machine_id)
        assert m is not None
        by_name = _by_name(s, m, experiment)
        owners = _owners(s, m)
    service = _service(app, m.cloud or "")
    done = []
    for i, spec in enumerate(experiment.volumes):
        v = _created(m, by_name, spec.name)
        cv = _read(service, m, v)
        if cv.attached_to and cv.attached_to != m.instance_id:
            _release(app, service, m, v, cv, owners.get(cv.attached_to), experiment.name)
        if cv.attached_to != m.instance_id or cv.state is not VolumeState.IN_USE:
            _attach_one(service, m, v, cv, i)
        _mark_attached(app, m, v)
        done.append(v.name)
    return done


def _mark_attached(app: App, m: Machine, v: Volume) -> None:
    """Record ``v`` in use on ``m``: its row and the machine's event."""
    with app.db.session() as s:
        row = s.get(Volume, v.id)
        assert row is not None
        row.status, row.attached_machine_id = VolumeStatus.IN_USE, m.id
    record_event(app, m.id, EventKind.VOLUME_ATTACHED, detail={"volume": v.name, "id": v.volume_id})


def _by_name(s: Session, m: Machine, experiment: Experiment) -> dict[str, Volume]:
    """The live volumes of ``m``'s project that ``experiment`` names, by name."""
    return {v.name: v for v in live(s, m.project, [x.name for x in experiment.volumes])}


def _created(m: Machine, by_name: dict[str, Volume], name: str) -> Volume:
    """The volume ``name`` once the cloud has created it, else :class:`OperationFailed`."""
    v = by_name.get(name)
    if v is None or not v.volume_id:
        raise OperationFailed(f"{m.name}: volume {name} does not exist (yet)")
    return v


Owner = tuple[str, MachineStatus, str | None]  # a machine's name, status, experiment's name


def _owners(s: Session, m: Machine) -> dict[str, Owner]:
    """Every machine of ``m``'s cloud with an instance, by its instance id."""
    return {
        iid: (name, status, (spec or {}).get("name"))
        for iid, name, status, spec in s.execute(
            select(Machine.instance_id, Machine.name, Machine.status, Machine.spec).where(
                Machine.cloud == m.cloud, Machine.instance_id.is_not(None)
            )
        )
    }


def _read(service: VolumeService, m: Machine, v: Volume) -> CloudVolume:
    """The cloud's view of ``v``; gone or unreadable is :class:`OperationFailed`."""
    try:
        return service.get(vref(v))
    except NotFound as e:
        raise OperationFailed(
            f"{m.name}: volume {v.name} ({v.volume_id}) is gone from {v.cloud}: {e}"
        ) from e
    except ProviderError as e:
        raise OperationFailed(f"{m.name}: volume {v.name} could not be read: {e}") from e


def _release(
    app: App,
    service: VolumeService,
    m: Machine,
    v: Volume,
    cv: CloudVolume,
    owner: Owner | None,
    experiment: str,
) -> None:
    """Detach ``cv`` from the other instance holding it, when that one is a machine of ours
    that ended or the preempted machine of ``experiment`` that ``m`` replaces (recorded as a
    move); refuse (:class:`OperationFailed`) any other holder."""
    if owner is None:  # not ours to detach
        raise OperationFailed(
            f"{m.name}: volume {v.name} is attached to {cv.attached_to}, which no "
            f"machine of provisioner is: detach it in the cloud's console"
        )
    name, status, spec_name = owner
    replaced = status == S.PREEMPTED and spec_name == experiment
    if status not in (S.TERMINATED, S.FAILED) and not replaced:
        raise OperationFailed(f"{m.name}: volume {v.name} is attached to {name} ({status})")
    assert cv.attached_to is not None
    stale = InstanceRef(id=cv.attached_to, region=v.region, zone=v.zone)
    try:  # from a stopped or ended instance: one gone already has let it go
        service.detach(cv.ref, stale)
    except NotFound:
        pass
    except ProviderError as e:
        raise OperationFailed(
            f"{m.name}: volume {v.name} could not be detached from {name}: {e}"
        ) from e
    if replaced:
        record_event(
            app,
            m.id,
            EventKind.VOLUME_MOVED,
            detail={
                "volume": v.name,
                "from": name,
                "why": f"detached from the preempted {name} this machine replaces "
                f"(the same zone, {v.zone})",
            },
        )


def _attach_one(service: VolumeService, m: Machine, v: Volume, cv: CloudVolume, i: int) -> None:
    """Attach ``cv`` to ``m`` as its ``i``-th volume: the machine gone is :class:`NotFound`,
    any other refusal :class:`OperationFailed`."""
    try:
        service.attach(cv.ref, ref(m), i)
    except NotFound as e:  # the volume was just read: the machine is what is gone
        raise NotFound(
            f"{m.name}: volume {v.name} could not be attached, the machine is gone "
            f"from {m.cloud}: {e}",
            code=e.code,
        ) from e
    except ProviderError as e:
        raise OperationFailed(f"{m.name}: volume {v.name} could not be attached: {e}") from e


# --- `provisioner volume ls` and `rm` ---------------------------------------------------------


@dataclass
class Listed:
    """One volume as ``volume ls`` shows it."""

    volume: Volume
    attached_to: str | None  # the live machine's name
    spent: list[Money]

    @property
    def status(self) -> VolumeStatus:
        if self.volume.status == VolumeStatus.CREATING:
            return VolumeStatus.CREATING
        return VolumeStatus.IN_USE if self.attached_to else VolumeStatus.AVAILABLE

    def as_json(self) -> dict[str, Any]:
        v = self.volume
        return {
            "name": v.name,
            "project": v.project,
            "owner": v.owner,
            "cloud": v.cloud,
            "region": v.region,
            "zone": v.zone,
            "size_gb": v.size_gb,
            "status": self.status,
            "volume_id": v.volume_id,
            "attached_to": self.attached_to,
            "rate_per_hour": None if v.rate is None else Money(v.rate, v.currency).as_json(),
            "spent": [m.as_json() for m in self.spent],
            "created_at": v.created_at.isoformat(),
        }


def listing(app: App, project: str | None = None, now: datetime | None = None) -> list[Listed]:
    now = now or app.clock.now()
    with app.db.session() as s:
        out = []
        for v in live(s, project):
            m = holder(s, v)
            ivs = s.scalars(select(UsageInterval).where(UsageInterval.machine_id == v.id))
            spent = spend(ivs, v.created_at, now)
            out.append(Listed(v, m.name if m else None, sorted(spent.values(), key=str)))
        return out


def find(app: App, name: str, project: str | None) -> Volume:
    with app.db.session() as s:
        found = live(s, project, [name])
    if not found:
        where = f" in project {project}" if project else ""
        raise UserError(f"no volume named {name!r}{where} (see `provisioner volume ls`)")
    if len(found) > 1:
        projects = ", ".join(v.project for v in found)
        raise UserError(f"volume {name!r} exists in projects {projects}: add --project")
    return found[0]


def check_remove(app: App, v: Volume) -> None:
    """Refuse (exit 2) unless who acts may remove ``v``: its owner (who launched the
    experiment that created it), or whom a policy lets act as them (:mod:`provisioner.permits`)."""
    permits.check(app, v, f"volume {v.name}", permits.VOLUME)


def remove(app: App, v: Volume) -> Volume:
    """Delete ``v`` in its cloud, then in the state (its usage ends now). Refused to whom may
    not act for its owner, and while it is attached to a live machine; a disk already gone in
    the cloud is no error."""
    check_remove(app, v)
    with app.db.session() as s:
        m = holder(s, v)
    if m is not None:
        raise UserError(
            f"volume {v.name} is attached to {m.name} ({m.status}): "
            f"`provisioner down {m.name}` first (a stopped machine keeps it attached)"
        )
    team_sql.require_may_act(app.db, [v.id])  # its ledger row: the database's answer first
    service = _service(app, v.cloud)
    try:
        for target in _cloud_volumes(app, v):
            service.delete(target)
    except ProviderError as e:
        raise OperationFailed(f"volume {v.name}: delete failed: {e}") from None
    crashpoint("after-volume-delete")
    _deleted(app, v.id)
    with app.db.session() as s:
        row = s.get(Volume, v.id)
        assert row is not None
        return row


def _cloud_volumes(app: App, v: Volume) -> list[VolumeRef]:
    """The cloud's disk of ``v``: by its id, or for a row a crash left ``creating``, any disk
    carrying its id in our tag."""
    if v.volume_id:
        return [vref(v)]
    found = _service(app, v.cloud).ours([v.region])
    return [cv.ref for cv in found if cv.labels.get(TAG_VOLUME) == v.id]


def rate_text(v: Volume) -> str:
    return "price unknown" if v.rate is None else f"{Money(Decimal(v.rate), v.currency)}/h"
