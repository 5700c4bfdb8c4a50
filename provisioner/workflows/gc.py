"""``gc``: what bills unseen or lies unused — machines carrying our tag the state does not know,
network pieces of ours no machine uses, volumes of ours no experiment uses — found in each
cloud asked, and the machines and network pieces removed when asked (a volume never: it holds
data, ``volume rm`` removes it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from provisioner import machines
from provisioner.app import App
from provisioner.machines import volumes


@dataclass(frozen=True)
class GcRequest:
    clouds: list[str] | None = None  # None: every enabled cloud
    remove: bool = False  # terminate the orphans (after ``confirm``), remove network pieces


@dataclass(frozen=True)
class Gc:
    orphans: list[machines.Orphan]
    terminated: list[machines.Orphan]
    network: dict[str, list[str]]  # cloud → its unused pieces (removed when asked)
    removed: bool  # the network pieces were removed
    volumes: list[volumes.Stray]  # listed only
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
    stray = volumes.strays(app, request.clouds, errors)
    return Gc(found, done, network, request.remove, stray, errors)
