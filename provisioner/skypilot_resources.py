"""A SkyPilot task's ``resources`` as an experiment's (provisioner.skypilot reads the rest):
each field mapped or refused with the reason. Field names and forms: SkyPilot's
sky/utils/schemas.py ``get_resources_schema`` (skypilot-org/skypilot at 00052dfe)."""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

SKYPILOT_RESOURCES = frozenset(
    {"accelerators", "use_spot", "disk_size", "disk_tier", "cloud", "infra", "region", "zone"}
    | {"cpus", "memory", "instance_type", "image_id", "ports", "any_of", "ordered", "labels"}
    | {"job_recovery", "spot_recovery", "autostop", "max_hourly_cost", "candidates"}
    | {"accelerator_args", "network_tier", "local_disk", "priority", "volumes", "ephemeral_storage"}
)

#: SkyPilot's default OS disk, in GB (sky/resources.py ``_DEFAULT_DISK_SIZE_GB = 256``)
DEFAULT_DISK_GB = 256
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:i?B)?\s*$", re.I)
_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(\+?)\s*$")
_GIB = {"": 1, "K": 1 / 1024**2, "M": 1 / 1024, "G": 1, "T": 1024, "P": 1024**2}
#: where alternatives (any_of, ordered) may differ: an experiment plans one GPU type, count
#: and market over several clouds, regions and zones
_WHERE = {"cloud", "infra", "region", "zone", "image_id"}
_DISK_TIERS_KEPT = {"best", "medium", "low"}

_REFUSED_RES = {
    "instance_type": "naming an instance type is not supported: provisioner picks the cheapest "
    "offer with the accelerators, cpus and memory asked",
    "ports": "opening ports is not supported: reach a port over SSH (provisioner ssh NAME -- "
    "-L PORT:localhost:PORT)",
    "candidates": "candidates (an old name for any_of) are not supported: keep one accelerator",
    "accelerator_args": "TPU arguments are not supported (provisioner rents GPUs)",
    "network_tier": "network tiers are not supported",
    "local_disk": "local disks are not supported",
    "priority": "job priorities are not supported",
    "volumes": "SkyPilot volumes are not supported here: write an experiment file with volumes:",
    "ephemeral_storage": "ephemeral storage is not supported",
}


class Sink(Protocol):
    """Where a translation goes (provisioner.skypilot's): refusals, the experiment's fields
    with where each was written, notes."""

    notes: list[str]
    refused: set[str]

    def refuse(self, loc: tuple[Any, ...], reason: str) -> None: ...

    def put(self, exp: tuple[str, ...], value: Any, sky: tuple[Any, ...]) -> None: ...


@dataclass
class Resources:
    """A task's ``resources`` (``gpus``, ``cloud``: the command line's instead)."""

    t: Sink
    res: dict[str, Any]
    gpus: str | None = None
    cloud: str | None = None
    clouds: list[str] = field(default_factory=list)

    def translate(self) -> int:
        """Every key of ``resources``; the GPU count (0: none)."""
        t, res = self.t, self.res
        for key in res:
            if key in _REFUSED_RES:
                t.refuse(("resources", key), _REFUSED_RES[key])
            elif key not in SKYPILOT_RESOURCES:
                t.refuse(("resources", key), "unknown SkyPilot resources field")
        count = self._accelerators()
        self._market()
        self._where()
        self._disk()
        self._cpus_memory()
        self._rest()
        return count

    def _accelerators(self) -> int:
        t = self.t
        value = self.gpus if self.gpus is not None else self.res.get("accelerators")
        loc = ("resources", "accelerators")
        t.refused.add("resources.gpu")  # until one is put
        if value is None:
            t.refuse(
                ("resources",),
                "no accelerators: provisioner rents GPU machines; add accelerators: (T4:1, "
                "A100:8) or give --gpus",
            )
            return 0
        alternatives, error = accelerator_alternatives(value)
        if error:
            t.refuse(loc, error)
            return 0
        if len(alternatives) > 1:
            listed = ", ".join(f"{n}:{c}" for n, c in alternatives)
            t.refuse(
                loc,
                f"{len(alternatives)} alternatives ({listed}): provisioner plans one GPU type "
                "and count per task; keep one",
            )
            return 0
        name, count = alternatives[0]
        t.put(("resources", "gpu"), {"type": name, "count": count}, loc)
        t.refused.discard("resources.gpu")
        return count

    def _market(self) -> None:
        spot = self.res.get("use_spot", False)
        # YAML 1.1's words, as SkyPilot's loader reads them (provisioner reads YAML 1.2)
        spot = {"yes": True, "on": True, "no": False, "off": False}.get(str(spot).lower(), spot)
        if not isinstance(spot, bool):
            self.t.refuse(("resources", "use_spot"), "should be true or false")
            return
        # SkyPilot's default is on-demand ("use_spot: If unspecified, defaults to False")
        market = "spot" if spot else "reserved"
        self.t.put(("resources", "market"), market, ("resources", "use_spot"))

    def _where(self) -> None:
        """cloud, region, zone, infra, and the alternatives of any_of / ordered."""
        res, t = self.res, self.t
        places = [self._place(res, ("resources",))]
        for key in ("any_of", "ordered"):
            items = res.get(key)
            if items is None:
                continue
            if not isinstance(items, list) or not items:
                t.refuse(("resources", key), "should be a list of resources")
                continue
            if key == "ordered":
                t.notes.append("ordered: provisioner ranks the places by price, not this order")
            alts = []
            base = {k: res[k] for k in _WHERE if k in res}
            for i, item in enumerate(items):
                if not isinstance(item, dict):
                    t.refuse(("resources", key, i), "should be a mapping of keys (key: value)")
                    continue
                for k in sorted(set(item) - _WHERE):
                    t.refuse(
                        ("resources", key, i, k),
                        f"alternatives that differ in {k} are not supported: provisioner plans "
                        "one GPU type, count and market over several clouds, regions and zones; "
                        "set it once, outside any_of",
                    )
                alts.append(self._place({**base, **item}, ("resources", key, i)))
            places = self._known(alts, ("resources", key)) if alts else places
        if self.cloud:
            places = [(self.cloud, None, None, places[0][3] if places else None)]
        self._put_places(places)

    def _place(self, r: dict[str, Any], loc: tuple[Any, ...]) -> tuple[Any, Any, Any, Any]:
        """(cloud, region, zone, image) of one resources mapping."""
        cloud, region, zone = r.get("cloud"), r.get("region"), r.get("zone")
        infra = r.get("infra")
        if isinstance(infra, str):
            parts = [None if p in ("*", "") else p for p in infra.split("/", 2)]
            parts += [None] * (3 - len(parts))
            if parts[0] in ("k8s",):
                parts[0] = "kubernetes"
            cloud, region, zone = cloud or parts[0], region or parts[1], zone or parts[2]
        elif infra is not None:
            self.t.refuse((*loc, "infra"), "should be cloud[/region[/zone]]")
        cloud = cloud.lower() if isinstance(cloud, str) else cloud
        return cloud, region, zone, r.get("image_id")

    def _known(self, alts: list[Any], loc: tuple[Any, ...]) -> list[Any]:
        """The alternatives on clouds provisioner rents; the others dropped with a note (all
        kept when none is, so the error names them)."""
        from providers import ALL

        known = [a for a in alts if a[0] is None or a[0] in ALL]
        dropped = sorted({a[0] for a in alts} - {a[0] for a in known})
        if known and dropped:
            self.t.notes.append(
                f"{'.'.join(map(str, loc))}: {', '.join(dropped)} left out (clouds provisioner "
                "does not rent)"
            )
        return known or alts

    def _put_places(self, places: list[Any]) -> None:
        t, loc = self.t, ("resources",)
        clouds = [c for c, *_ in places]
        if all(c is not None for c in clouds):
            self.clouds = list(dict.fromkeys(clouds))
            t.put(("resources", "clouds"), self.clouds, self._at("cloud", "infra", "any_of"))
        for i, name in ((1, "regions"), (2, "zones")):
            got = list(dict.fromkeys(p[i] for p in places if p[i] is not None))
            if got:
                key = "region" if i == 1 else "zone"
                t.put(("resources", name), got, self._at(key, "infra", "any_of", "ordered"))
        images = {p[0]: p[3] for p in places if p[3] is not None}
        for cloud, image in images.items():
            if sum(1 for i in images.values() if i == image) > 1:
                t.refuse((*loc, "image_id"), "an image belongs to one cloud: one per cloud")
            elif not isinstance(image, str):
                t.refuse((*loc, "image_id"), "per-region images are not supported: one image")
            elif image.startswith("docker:"):
                t.refuse(
                    (*loc, "image_id"),
                    "container images (docker:) are not supported: setup and run run on the "
                    "machine's own image",
                )
            elif cloud is None:
                t.refuse((*loc, "image_id"), "an image belongs to one cloud: name the cloud too")
            else:
                t.put(("resources", "image", cloud), image, self._at("image_id", "any_of"))

    def _at(self, *keys: str) -> tuple[Any, ...]:
        """The first of ``keys`` the resources have, as a location."""
        return next((("resources", k) for k in keys if k in self.res), ("resources",))

    def _disk(self) -> None:
        t, res = self.t, self.res
        size = res.get("disk_size", DEFAULT_DISK_GB)
        gb = size_gb(size)
        if gb is None:
            t.refuse(("resources", "disk_size"), "should be a size in GB (256, 512GB, 1TB)")
        else:
            t.put(("resources", "disk_gb"), gb, self._at("disk_size"))
        tier = res.get("disk_tier")
        if tier is None:
            return
        if str(tier).lower() in _DISK_TIERS_KEPT:
            t.notes.append(f"disk_tier {tier}: the cloud's usual boot disk type")
        else:
            t.refuse(
                ("resources", "disk_tier"),
                f"disk tier {tier} is not supported: provisioner uses each cloud's usual boot "
                "disk type (leave it out, or best)",
            )

    def _cpus_memory(self) -> None:
        t = self.t
        for key, exp in (("cpus", "min_vcpus"), ("memory", "min_memory_gb")):
            value = self.res.get(key)
            if value is None:
                continue
            text = str(value).strip()
            text = re.sub(r"(?i)\s*gb?(\+?)$", r"\1", text) if key == "memory" else text
            m = _COUNT.match(text)
            if not m:
                t.refuse(("resources", key), "should be a number, or at least one (4+)")
                continue
            amount = float(m[1])
            if not m[2]:
                t.notes.append(f"{key}: {value} taken as at least {value}")
            got = math.ceil(amount) if key == "cpus" else m[1]
            t.put(("resources", exp), got, ("resources", key))

    def _rest(self) -> None:
        t, res = self.t, self.res
        labels = res.get("labels")
        if isinstance(labels, dict):
            for k, v in labels.items():
                t.put(("labels", str(k)), str(v), ("resources", "labels", k))
        elif labels is not None:
            t.refuse(("resources", "labels"), "should be a mapping of keys (key: value)")
        cost = res.get("max_hourly_cost")
        if cost is not None:
            t.put(
                ("resources", "max_price_per_hour"), f"{cost} USD", ("resources", "max_hourly_cost")
            )
        for key in ("job_recovery", "spot_recovery"):
            if key in res:
                t.notes.append(
                    f"{key}: a preempted machine is relaunched (lifecycle.on_preemption: relaunch)"
                )
        self._autostop(res.get("autostop"))

    def _autostop(self, value: Any) -> None:
        t, loc = self.t, ("resources", "autostop")
        if value is None or value is False:
            return
        if isinstance(value, dict):
            if value.get("down"):
                t.refuse((*loc, "down"), "autostop down is not supported: it stops the machine")
            value = value.get("idle_minutes", 5)
        if value is True:
            value = 5  # SkyPilot's default idle minutes
        minutes = f"{value}m" if isinstance(value, int) else str(value)
        t.put(("lifecycle", "autostop"), minutes, loc)


def size_gb(value: Any) -> int | None:
    """A SkyPilot disk size (a number of GB, or ``512GB``, ``1TB``) in whole GB."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return math.ceil(value)
    m = _SIZE.match(str(value))
    if not m:
        return None
    return math.ceil(float(m[1]) * _GIB[m[2].upper()])


def accelerator_alternatives(value: Any) -> tuple[list[tuple[str, int]], str | None]:
    """SkyPilot's ``accelerators`` as (type, count) alternatives: ``A100:8``, ``A100``,
    ``{A100: 8}``, a set ``{A100:8, H100:8}`` (YAML reads it as keys without values), a list
    ``[A100:8, H100:8]``, or such a set or list in a string (SkyPilot reads it with
    ``ast.literal_eval``, sky/resources.py). The error, if any, as a reason."""
    items, error = _accelerator_items(value)
    out: list[tuple[str, int]] = []
    for name, count in items:
        one, error = _accelerator(str(name).strip(), count)
        if error or one is None:
            return [], error
        out.append(one)
    if not out:
        return [], error or "name one accelerator (A100:8)"
    return list(dict.fromkeys(out)), None


def _accelerator_items(value: Any) -> tuple[list[tuple[Any, Any]], str | None]:
    if isinstance(value, str) and value.strip()[:1] in ("{", "["):
        try:
            value = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            return [], f"cannot read {value!r}: write TYPE:COUNT (A100:8)"
    if isinstance(value, str):
        return [(value, None)], None
    if isinstance(value, dict):
        return list(value.items()), None
    if isinstance(value, list | set | tuple):
        return [(v, None) for v in value], None
    return [], "write TYPE:COUNT (A100:8)"


def _accelerator(name: str, count: Any) -> tuple[tuple[str, int] | None, str | None]:
    """One ``NAME[:COUNT]`` (or NAME with its count beside it) as (NAME, count)."""
    if count is None and ":" in name:
        name, _, count = name.rpartition(":")
    try:
        n = float(count if count is not None else 1)
    except (TypeError, ValueError):
        return None, f"cannot read the count of {name}: {count!r}"
    if not math.isfinite(n) or n != int(n) or n < 1:
        return None, f"{name}:{count}: fractional GPUs are not supported (a whole count)"
    return (name.upper(), int(n)), None
