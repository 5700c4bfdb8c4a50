"""experiment.yaml: what a user asks for. Every error names the file, the line and the field."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from policies import yamlfile
from policies.duration import autostop_duration, parse_duration
from policies.schema import MINUTES_MAX
from providers import gpus
from providers.gpus import GPUS
from provisioner import workdir
from provisioner.money import Money

GPU_TYPES = tuple(GPUS)
_GPU_RE = re.compile(r"^(?P<type>[A-Za-z0-9-]+?)(?::(?P<mem>\d+)GB)?(?::(?P<count>\d+))?$", re.I)
_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,38}[a-z0-9]$")


# C0 and C1 controls and DEL: a NUL (PostgreSQL refuses it in text), an ESC starting an ANSI
# sequence that would reach a teammate's terminal through `report`, a newline or a tab
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# in a script or an environment value: all of them but tab, newline and carriage return
_CONTROL_IN_TEXT = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _one_line(v: str) -> str:
    """A name or label as shown in tables: surrounding whitespace dropped (``"ana@x.org "``
    or a block scalar's final newline: ``ana@x.org``, not a second owner); no control
    character within."""
    line = v.strip()
    if m := _CONTROL.search(line):
        raise ValueError(f"control characters are not allowed here ({m[0]!r})")
    if v and not line:
        raise ValueError("only spaces: write a value or leave the field out")
    return line


def _text(v: str) -> str:
    """A script or an environment value: lines and tabs, but no other control characters."""
    if m := _CONTROL_IN_TEXT.search(v):
        raise ValueError(f"control characters are not allowed here ({m[0]!r})")
    return v


def _env_value(v: Any) -> Any:
    """A number or boolean as the string SkyPilot makes of it (``str(value)``: 1 → "1",
    0.5 → "0.5", true → "True"): sky/task.py ``Task.from_yaml_config`` converts every ``envs``
    value with ``str`` before validating; provisioner does the same for ``env``, so one file means
    the same in both. None (``KEY:`` with no value) stays an error here."""
    if isinstance(v, bool | int | float | Decimal):
        return str(v)
    return v


Line = Annotated[str, AfterValidator(_one_line)]
Text = Annotated[str, AfterValidator(_text)]
LabelKey = Annotated[Line, StringConstraints(min_length=1, max_length=128)]
LabelValue = Annotated[Line, StringConstraints(max_length=256)]
EnvKey = Annotated[str, StringConstraints(pattern=r"^[A-Z_][A-Z0-9_]*$", max_length=128)]
EnvValue = Annotated[Text, StringConstraints(max_length=32768), BeforeValidator(_env_value)]

# The signals the agent sends (provisioner.agent.SIGNALS, tested equal): importing the standalone
# agent costs `plan` its HTTP client.
SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGKILL")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


class GPU(_Strict):
    type: str
    count: int = Field(1, ge=1, le=16)
    memory_gb: int | None = Field(None, ge=1, le=10_000, description="minimum memory per GPU")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        """``A100:8``, ``A100:80GB:8``, ``T4`` — like dstack/SkyPilot."""
        if isinstance(v, str):
            m = _GPU_RE.match(v.strip())
            if not m:
                raise ValueError(
                    f"cannot read GPU {v!r}: write TYPE:COUNT (A100:8) or TYPE:MEMGB:COUNT"
                )
            out: dict[str, Any] = {"type": m["type"], "count": int(m["count"] or 1)}
            if m["mem"]:
                out["memory_gb"] = int(m["mem"])
            return out
        if isinstance(v, dict) and "memory" in v:  # "80GB" or 80
            v = dict(v)
            mem = str(v.pop("memory")).strip().upper().removesuffix("GB").strip()
            v["memory_gb"] = int(mem) if mem.isdigit() else mem
        return v

    @field_validator("type")
    @classmethod
    def _known(cls, v: str) -> str:
        up = v.upper()
        if up not in GPU_TYPES:
            raise ValueError(f"unknown GPU type {v!r}; {did_you_mean(up, GPU_TYPES)}")
        return up

    @property
    def family(self) -> str:
        """``A100-80GB`` is an A100 with at least 80 GB."""
        return gpus.family(self.type)

    @property
    def min_memory_gb(self) -> int:
        return max(self.memory_gb or 0, gpus.implied_memory_gb(self.type))

    def __str__(self) -> str:
        mem = f":{self.memory_gb}GB" if self.memory_gb else ""
        return f"{self.type}{mem}:{self.count}"


class Resources(_Strict):
    gpu: GPU
    market: Literal["spot", "reserved", "any"] = "any"
    clouds: list[str] | None = None  # None: every enabled real cloud
    regions: list[Line] = Field(default_factory=list)
    zones: list[Line] = Field(default_factory=list)
    max_price_per_hour: Money | None = None
    min_vcpus: int = Field(0, ge=0, le=100_000)
    min_memory_gb: Decimal = Field(Decimal(0), ge=0, le=1_000_000, allow_inf_nan=False)
    disk_gb: int = Field(100, ge=10, le=65536)
    image: dict[str, Line] = Field(default_factory=dict)  # cloud → image

    @field_validator("max_price_per_hour", mode="before")
    @classmethod
    def _money(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:
            return v
        m = Money.parse(v)
        if m.amount <= 0:
            raise ValueError("must be more than zero")
        known = info.context and info.context.get("currencies")
        if known and m.currency not in known:
            raise ValueError(
                f"no exchange rate for {m.currency}: write it in {', '.join(sorted(known))}, "
                f"or set rates.{m.currency} in settings"
            )
        return m

    @field_validator("clouds")
    @classmethod
    def _clouds(cls, v: list[str] | None) -> list[str] | None:
        from providers import ALL

        if v is not None:
            bad = [c for c in v if c not in ALL]
            if bad:
                raise ValueError(f"unknown cloud {bad[0]!r}; {did_you_mean(bad[0], ALL)}")
            if not v:
                raise ValueError("list at least one cloud, or leave the field out for all")
        return v


class IdleRule(_Strict):
    gpu_util_below: float = Field(5.0, ge=0, le=100, description="percent, every GPU")
    for_minutes: int = Field(30, ge=1, le=MINUTES_MAX)


class PreemptionNotice(_Strict):
    """What the agent does to the job when the cloud announces a preemption (once per notice):
    send ``signal`` (default SIGTERM) to every process whose command line matches ``to`` (a
    regular expression, searched as ``pkill -f`` does), or ``run`` a shell command as root
    (not waited for; PROVISIONER_NOTICE_CLOUD, _ACTION and _NOT_BEFORE in its environment)."""

    signal: str | None = None
    to: Text | None = Field(None, min_length=1, max_length=512)
    run: Text | None = Field(None, min_length=1, max_length=4096)

    @field_validator("signal")
    @classmethod
    def _signal(cls, v: str | None) -> str | None:
        if v is None:
            return v
        name = v.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name not in SIGNALS:
            raise ValueError(f"unknown signal {v!r}; {did_you_mean(name, SIGNALS)}")
        return name

    @field_validator("to")
    @classmethod
    def _pattern(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a regular expression: {e}") from None
        return v

    @model_validator(mode="after")
    def _one_action(self) -> PreemptionNotice:
        if self.run is not None:
            if self.signal is not None or self.to is not None:
                raise ValueError("give either run, or signal with to; not both")
        elif self.to is None:
            raise ValueError(
                "say what to do: {signal: SIGTERM, to: <pattern of the job's command line>} "
                "or {run: <command>}"
            )
        elif self.signal is None:
            object.__setattr__(self, "signal", "SIGTERM")
        return self

    def for_agent(self) -> dict[str, str]:
        """What the startup data hands the agent (``agent.load_action`` reads it)."""
        if self.run is not None:
            return {"run": self.run}
        return {"signal": str(self.signal), "to": str(self.to)}


class OnNoCapacity(_Strict):
    """``{wait: 6h}``: when every candidate lacks capacity, ``up`` keeps the intent queued as
    ``waiting`` and retries it this long (leave it out: ``up`` fails at once)."""

    wait: timedelta

    @field_validator("wait", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        d = parse_duration(v)
        if d <= timedelta(0):
            raise ValueError("must be longer than zero (leave on_no_capacity out to fail at once)")
        return d


class Lifecycle(_Strict):
    idle: IdleRule | None = None
    max_lifetime: timedelta | None = None
    on_preemption: Literal["relaunch", "terminate", "leave"] = "relaunch"
    #: on a relaunch, what becomes of the preempted machine its cloud kept stopped with its
    #: boot disk: ``keep`` it (billed for that disk only) until its replacement runs, and start
    #: it in place if room comes back first; or ``release`` it, terminated with its disk's
    #: files before the relaunch (nothing bills while the relaunch waits)
    on_preemption_disk: Literal["keep", "release"] = "keep"
    on_preemption_notice: PreemptionNotice | None = None
    on_no_capacity: OnNoCapacity | None = None
    #: what is done to the machine when its ``run`` exits (None: ``stop`` when the experiment
    #: has a ``run``, so billing ends with the job; else ``keep``) — see Experiment.on_finish
    on_finish: Literal["stop", "terminate", "keep"] | None = None
    # stop when idle (GPUs, jobs, SSH) this long, at any hour: provisioner.jobs.autostop
    autostop: timedelta | None = None

    @field_validator("max_lifetime", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        if v is None:
            return None
        d = parse_duration(v)
        if d <= timedelta(0):
            raise ValueError("must be longer than zero (leave it out for no limit)")
        return d

    @field_validator("autostop", mode="before")
    @classmethod
    def _autostop(cls, v: Any) -> Any:
        return None if v is None else autostop_duration(v)


#: Where a volume may not be mounted: the system's own directories (and / itself).
SYSTEM_DIRS = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib64",
    "/proc",
    "/run",
    "/sbin",
    "/sys",
    "/usr",
    "/var",
)
# per experiment: well inside every cloud's disks per machine, and one device each to wait for
MAX_VOLUMES = 8
_VOLUME_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,22}[a-z0-9]$")
_PATH_RE = re.compile(r"^(/[A-Za-z0-9._-]+)+/?$")


class VolumeSpec(_Strict):
    """A network disk kept per project and name: created once, in the machine's zone, mounted
    at ``path`` on every machine of the experiment, removed only by ``volume rm``."""

    name: str
    size_gb: int = Field(ge=1, le=65536)
    path: str

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _VOLUME_NAME_RE.fullmatch(v):
            raise ValueError(
                "use 2–24 lowercase letters, digits and dashes, starting with a letter "
                "(it becomes part of the cloud disk name)"
            )
        return v

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not _PATH_RE.fullmatch(v) or any(p in (".", "..") for p in v.split("/")):
            raise ValueError(
                "an absolute path of letters, digits, dots, dashes and underscores (/data)"
            )
        v = v.rstrip("/")
        if any(v == d or v.startswith(d + "/") for d in SYSTEM_DIRS):
            raise ValueError(f"{v} is a system directory; mount volumes elsewhere (/data)")
        return v


class Experiment(_Strict):
    name: str
    project: Line = Field(min_length=1, max_length=63)
    owner: Line = Field(min_length=1, max_length=128)
    resources: Resources
    startup_script: Text | None = None
    ssh_public_key: Line | None = None
    # AWS allows 50 tags of 128/256 characters (we add four):
    # https://docs.aws.amazon.com/tag-editor/latest/userguide/tagging.html
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=40)
    lifecycle: Lifecycle = Field(default_factory=Lifecycle)
    volumes: list[VolumeSpec] = Field(default_factory=list, max_length=MAX_VOLUMES)
    # the job: ``workdir`` (relative to the experiment file) is copied to the machine at `up`,
    # ``setup`` runs once per machine, then ``run`` (both shell, in the copy, with ``env``)
    workdir: str | None = None
    setup: Text | None = Field(None, min_length=1, max_length=65536)
    run: Text | None = Field(None, min_length=1, max_length=65536)
    env: dict[EnvKey, EnvValue] = Field(default_factory=dict, max_length=200)

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None, info: ValidationInfo) -> str | None:
        """Resolved against the experiment file's folder (stored absolute); it must exist."""
        base = (info.context or {}).get("base_dir")
        if v is None or base is None:  # read back from the state: as it was stored
            return v
        path = (Path(base) / Path(v).expanduser()).resolve()
        if not path.is_dir():
            raise ValueError(f"no directory {path} (a workdir is relative to the experiment file)")
        limits = (info.context or {}).get("workdir_limits") or ()
        workdir.files(str(path), *limits)  # before anything is launched: BadWorkdir is a ValueError
        return str(path)

    @model_validator(mode="before")
    @classmethod
    def _owner(cls, v: Any, info: ValidationInfo) -> Any:
        """No ``owner`` in the file: whoever runs provisioner (``actor`` in the context, a
        callable: on PostgreSQL it asks the database)."""
        actor = (info.context or {}).get("actor")
        if isinstance(v, dict) and v.get("owner") is None and actor is not None:
            return {**v, "owner": actor()}
        return v

    @property
    def on_finish(self) -> str:
        """What ends the machine when ``run`` exits: ``stop`` by default when there is a
        ``run`` (billing ends with the job), ``keep`` when there is none."""
        return self.lifecycle.on_finish or ("stop" if self.run else "keep")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.fullmatch(v):  # match() let "name\\n" through: a second machine
            raise ValueError(
                "use 2–40 lowercase letters, digits and dashes, starting with a letter "
                "(it becomes part of the cloud machine name)"
            )
        return v

    @field_validator("ssh_public_key")
    @classmethod
    def _ssh(cls, v: str | None) -> str | None:
        if v is not None and not re.match(
            r"^(ssh-(rsa|ed25519|dss)|ecdsa-sha2-\S+|sk-\S+) \S+", v.strip()
        ):
            raise ValueError("not an OpenSSH public key (expected 'ssh-ed25519 AAAA…')")
        return v.strip() if v else v

    @field_validator("volumes")
    @classmethod
    def _volumes(cls, v: list[VolumeSpec]) -> list[VolumeSpec]:
        for field in ("name", "path"):
            seen: set[str] = set()
            for vol in v:
                value = getattr(vol, field)
                if value in seen:
                    raise ValueError(f"two volumes with the {field} {value}")
                seen.add(value)
        return v

    def to_json(self) -> dict[str, Any]:
        # a spec without volumes or a job is stored as before (`up` compares the stored spec)
        out = self.model_dump(mode="json", exclude={"volumes", *_JOB_FIELDS})
        if self.lifecycle.on_finish is None:
            out["lifecycle"].pop("on_finish", None)
        job = {k: getattr(self, k) for k in _JOB_FIELDS if getattr(self, k)}
        return (
            out
            | (
                {"volumes": [v.model_dump(mode="json") for v in self.volumes]}
                if self.volumes
                else {}
            )
            | job
        )


_JOB_FIELDS = ("workdir", "setup", "run", "env")


_LOOKALIKE = str.maketrans("OIL", "011")


def did_you_mean(word: str, known: Collection[str]) -> str:
    """``did you mean 'A100'?`` for a near miss, else the list of what is known."""
    import difflib

    # a letter typed for the digit it looks like (A10O, A1OO: A100) before the nearest spelling
    folded = word.upper().translate(_LOOKALIKE)
    look = [k for k in known if k.upper().translate(_LOOKALIKE) == folded]
    near = look or difflib.get_close_matches(word, known, n=1, cutoff=0.5)
    return f"did you mean {near[0]!r}?" if near else f"known: {', '.join(known)}"


def load_experiment(
    path: str | Path,
    currencies: Collection[str] | None = None,
    actor: Callable[[], str] | None = None,
    workdir_limits: tuple[int, int] | None = None,
) -> Experiment:
    """``currencies``: those settings have rates for; an amount in another is an error here,
    with its line, rather than when the plan converts it. ``actor``: who runs provisioner,
    the owner when the file names none. ``workdir_limits``: settings' (files, bytes) a workdir
    may hold (:mod:`provisioner.workdir`'s defaults when None)."""
    data, lines = yamlfile.load_document(path)
    context = experiment_context(path, currencies, actor, workdir_limits)
    return validate_experiment(data, lines, path, context)


def experiment_context(
    path: str | Path,
    currencies: Collection[str] | None = None,
    actor: Callable[[], str] | None = None,
    workdir_limits: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """What validating an experiment read from ``path`` needs besides its data."""
    context: dict[str, Any] = {
        "base_dir": str(Path(path).parent),
        "actor": actor,
        "workdir_limits": workdir_limits,
    }
    if currencies:
        context["currencies"] = set(currencies)
    return context


def validate_experiment(
    data: Any, lines: yamlfile.Lines, path: str | Path, context: dict[str, Any]
) -> Experiment:
    """An experiment file's data, already read, validated (errors with file, line, field)."""
    return yamlfile.validate(
        Experiment, data, lines, str(path), what="experiment file", context=context
    )
