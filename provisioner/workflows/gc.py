"""``gc``: what bills unseen or lies unused — machines carrying our tag the state does not know,
network pieces of ours no machine uses, volumes of ours no experiment uses — found in each
cloud asked, and the machines and network pieces removed when asked (a volume never: it holds
data, ``volume rm`` removes it)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from providers.base import ProviderError
from provisioner import machines
from provisioner.app import App
from provisioner.machines.volumes import TAG_VOLUME, live
from provisioner.models import Machine, Volume
from provisioner.schema import MachineStatus


@dataclass(frozen=True)
class GcRequest:
    clouds: list[str] | None = None  # None: every enabled cloud
    remove: bool = False  # terminate the orphans (after ``confirm``), remove network pieces


@dataclass(frozen=True)
class Stray:
    """A volume of ours nobody uses: in the cloud but unknown to the state, or in the state
    but named by no live machine's experiment."""

    cloud: str
    id: str
    name: str
    zone: str
    size_gb: int
    why: str

    def __str__(self) -> str:
        where = f"{self.cloud}/{self.zone} {self.id}"
        return f"volume {where} ({self.name}, {self.size_gb} GB): {self.why}"


@dataclass(frozen=True)
class Gc:
    orphans: list[machines.Orphan]
    terminated: list[machines.Orphan]
    network: dict[str, list[str]]  # cloud → its unused pieces (removed when asked)
    removed: bool  # the network pieces were removed
    volumes: list[Stray]  # listed only
    not_asked: dict[str, str]  # cloud → why it could not be asked


def gc(app: App, request: GcRequest, confirm: Callable[[int], None] = lambda _: None) -> Gc:
    """Find (and with ``request.remove``, remove) what bills unseen or lies unused.
    ``confirm`` is asked (it raises to refuse) with how many orphans would be terminated."""
    found, errors = machines.orphans(app, request.clouds)
    done: list[machines.Orphan] = []
    if request.remove and found:
        doomed = [o for o in found if not o.adoptable_by]  # an interrupted `up` adopts the rest
        if doomed:
            confirm(len(doomed))
        done = machines.collect(app, found)
    network = machines.unused_network(app, request.clouds, errors, remove=request.remove)
    stray = strays(app, request.clouds, errors)
    return Gc(found, done, network, request.remove, stray, errors)


def strays(app: App, clouds: Iterable[str] | None, errors: dict[str, str]) -> list[Stray]:
    """Volumes of ours no state row knows (each asked cloud that can list volumes), and
    volumes in the state that no live machine's experiment names. Only listed: a volume holds
    data, so it is removed only by ``provisioner volume rm``."""
    asked = [c for c in (clouds or app.settings.enabled_clouds) if c not in errors]
    with app.db.session() as s:
        rows = live(s)
        named = _named(s)
    known = {v.volume_id for v in rows if v.volume_id} | {v.id for v in rows}
    out = [stray for cloud in asked for stray in _unknown(app, cloud, known, errors)]
    return out + _unnamed(rows, asked, named)


def _named(s: Session) -> set[tuple[str, str | None]]:
    """(project, volume name) of every volume a live machine's experiment names."""
    ended = (MachineStatus.TERMINATED, MachineStatus.FAILED)
    return {
        (m.project, v.get("name"))
        for m in s.scalars(select(Machine).where(Machine.status.not_in(ended)))
        for v in (m.spec or {}).get("volumes") or []
    }


def _unknown(app: App, cloud: str, known: set[str], errors: dict[str, str]) -> list[Stray]:
    """The volumes of ours in ``cloud`` that carry neither a known id nor a known row's id in
    our tag; a cloud that cannot be listed goes to ``errors``."""
    service = app.provider(cloud).volumes
    if service is None:  # a cloud without volumes has none to stray
        return []
    try:
        listed = service.ours()
    except ProviderError as e:
        errors[cloud] = str(e)
        return []
    return [
        Stray(cloud, cv.id, cv.name, cv.zone, cv.size_gb, "no state row knows it")
        for cv in listed
        if cv.id not in known and cv.labels.get(TAG_VOLUME) not in known
    ]


def _unnamed(
    rows: list[Volume], asked: list[str], named: set[tuple[str, str | None]]
) -> list[Stray]:
    """The state's rows in the asked clouds that no live machine names, with how to remove
    each."""
    return [
        Stray(
            v.cloud,
            v.volume_id or "-",
            f"{v.name} of {v.project}",
            v.zone,
            v.size_gb,
            f"no live machine names it; bills {v.rate} {v.currency}/h: "
            f"`provisioner volume rm {v.name} --project {v.project}`",
        )
        for v in rows
        if v.cloud in asked and (v.project, v.name) not in named
    ]
