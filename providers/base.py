"""The adapter contract: one interface, one volume seam, one state vocabulary; the error taxonomy
(:mod:`providers.errors`) named here too.

Every cloud adapter (providers/<cloud>/) implements :class:`Provider`. Adapters import their SDK
lazily, inside methods, so ``import providers`` and ``provisioner --help`` stay fast.
Nothing here imports from ``provisioner`` or ``policies``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from providers.errors import (  # noqa: F401 (the taxonomy, named here as before)
    AuthError,
    CapacityError,
    ConfigurationError,
    InvalidRequest,
    NotFound,
    ProviderError,
    QuotaError,
    Throttled,
)
from providers.retry import call_with_retry

if TYPE_CHECKING:
    from providers.spec import CloudSpec, Options

T = TypeVar("T")
C = TypeVar("C")

# Tag/label keys that mark machines launched by provisioner. Lowercase, dash-separated: valid as
# AWS tags, GCP labels (``[a-z0-9_-]``, ≤63), Azure tags, Yandex labels and Huawei server tags.
TAG_MANAGED_BY = "managed-by"
TAG_MANAGED_BY_VALUE = "provisioner"
TAG_MACHINE = "provisioner-machine"
TAG_PROJECT = "provisioner-project"
TAG_OWNER = "provisioner-owner"


class MachineState(enum.StrEnum):
    """The one state vocabulary. ``preempted`` is a spot machine the cloud took back."""

    PENDING = "pending"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    TERMINATED = "terminated"
    PREEMPTED = "preempted"


def port_open(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to ``host:port`` is accepted within ``timeout`` seconds."""
    import socket

    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True


# --- data passed across the seam ------------------------------------------------------------


@dataclass(frozen=True)
class Offer:
    """One purchasable shape in one place. Prices are per hour in ``currency``; ``None`` means
    no public price is known (the planner skips it unless settings price it)."""

    cloud: str
    region: str
    zone: str  # "" where the cloud prices per region (Azure) or the zone is chosen at launch
    instance_type: str
    gpu: str  # normalised: A100, A100-80GB, H100, T4, L4, A10G, V100, …
    gpu_count: int
    gpu_memory_gb: int
    vcpus: int
    memory_gb: Decimal
    price: Decimal | None  # on-demand / reserved
    spot_price: Decimal | None  # spot / preemptible
    currency: str
    accelerator: str = ""  # GCP attachable GPU (nvidia-tesla-t4) on an n1 host, else ""
    source: str = ""  # where the price came from
    as_of: str = ""  # ISO date the price was read from its source; "" where not known


@dataclass(frozen=True)
class LaunchRequest:
    """Everything an adapter needs to create one machine."""

    name: str  # cloud resource name: lowercase, [a-z0-9-], ≤ 50 chars, starts with a letter
    token: str  # idempotency token of the intent (≤ 64 ASCII chars); same token → same machine
    region: str
    zone: str
    instance_type: str
    gpu: str
    gpu_count: int
    spot: bool
    disk_gb: int = 100
    accelerator: str = ""
    image: str | None = None  # None → the adapter's GPU-ready default
    user_data: str | None = None  # startup script (cloud-init / shell)
    ssh_public_key: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)  # includes the TAG_* keys
    max_price: Decimal | None = None  # spot cap per hour; None → pay up to on-demand
    preemption_action: Literal["stop", "terminate"] = "stop"  # what the cloud does on eviction
    # The machine's own guard (the agent's guard.json: autostop, on_finish, max lifetime), as
    # the startup data writes it on a cloud machine; the sandbox hands it to its agent process.
    guard: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class InstanceRef:
    """Enough to find one machine again in its cloud."""

    id: str
    region: str
    zone: str = ""
    name: str = ""


@dataclass(frozen=True)
class Instance:
    id: str
    name: str
    region: str
    zone: str
    instance_type: str
    state: MachineState
    spot: bool
    labels: Mapping[str, str] = field(default_factory=dict)
    public_ip: str | None = None
    private_ip: str | None = None
    launched_at: datetime | None = None
    state_reason: str | None = None  # the cloud's own words/code for the last transition
    # When the cloud stopped, took or deleted the machine (aware UTC), as its API says it; None
    # where the API gives no such time. Meaningful only for a machine in one of those states:
    # reconcile closes usage at this instant, not at the moment it noticed.
    stopped_at: datetime | None = None
    # Halted from inside (its OS shut down) but still allocated, so its compute still bills
    # (an Azure VM in PowerState/stopped): reported ``stopping`` until a stop through the API
    # (Azure's deallocate) ends the billing; reconcile makes that stop.
    halted_billing: bool = False

    @property
    def ref(self) -> InstanceRef:
        return InstanceRef(id=self.id, region=self.region, zone=self.zone, name=self.name)

    @property
    def machine_id(self) -> str | None:
        return self.labels.get(TAG_MACHINE)


@dataclass(frozen=True)
class JobState:
    """A job on a machine: running, or ended with ``exit_code`` (None: it ended without one —
    killed with its machine, or its output lost)."""

    running: bool
    exit_code: int | None = None
    stage: str = "run"  # "setup": the job ended in its setup (the run never started)


class VolumeState(enum.StrEnum):
    """A network disk's state, in every cloud's words mapped to these."""

    CREATING = "creating"
    AVAILABLE = "available"  # attached to nothing
    IN_USE = "in-use"  # attached to a machine
    DELETING = "deleting"
    ERROR = "error"


@dataclass(frozen=True)
class VolumeRequest:
    """A network disk to create: zonal on every cloud (Azure: in the region, pinned to ``zone``
    when one is given), so it attaches only to machines in its zone."""

    name: str  # cloud resource name: lowercase, [a-z0-9-], ≤ 50 chars, starts with a letter
    token: str  # idempotency token (≤ 64 ASCII chars); same token → same volume
    region: str
    zone: str
    size_gb: int
    labels: Mapping[str, str] = field(default_factory=dict)  # includes the TAG_* keys
    # the cloud's disk type, chosen for the machine family it is made for
    # (:func:`providers.disks.volume_type`); "" is the adapter's default
    disk_type: str = ""


@dataclass(frozen=True)
class VolumeRef:
    """Enough to find one volume again in its cloud."""

    id: str
    region: str
    zone: str = ""
    name: str = ""


@dataclass(frozen=True)
class Volume:
    id: str
    name: str
    region: str
    zone: str
    size_gb: int
    state: VolumeState
    labels: Mapping[str, str] = field(default_factory=dict)
    attached_to: str | None = None  # the instance id it is attached to
    created_at: datetime | None = None

    @property
    def ref(self) -> VolumeRef:
        return VolumeRef(id=self.id, region=self.region, zone=self.zone, name=self.name)


class VolumeService(ABC):
    """A cloud's network disks, under the same method names on every cloud. An adapter that
    has them gives one as :attr:`Provider.volumes`; each cloud's is in its folder
    (``providers/<cloud>/volumes.py``), built with the adapter and calling only down into it."""

    @abstractmethod
    def create(self, request: VolumeRequest) -> Volume:
        """Create the disk (unformatted), idempotently by ``request.token``."""

    @abstractmethod
    def get(self, ref: VolumeRef) -> Volume:
        """Raises NotFound when the volume is gone."""

    @abstractmethod
    def ours(self, regions: Sequence[str] | None = None) -> list[Volume]:
        """Our volumes (tag ``managed-by=provisioner``) in ``regions`` (None: the configured
        ones). Paginates fully."""

    @abstractmethod
    def attach(self, volume: VolumeRef, instance: InstanceRef, index: int) -> None:
        """Attach to the machine (running or stopped, as the cloud allows) as its ``index``-th
        volume (0, 1, …). Idempotent when already attached there. The cloud's refusal (another
        zone, attached elsewhere) is raised as InvalidRequest."""

    @abstractmethod
    def detach(self, volume: VolumeRef, instance: InstanceRef) -> None:
        """Idempotent: a volume not attached there is not an error."""

    @abstractmethod
    def delete(self, ref: VolumeRef) -> None:
        """Idempotent: a volume already gone is not an error. An attached volume is refused by
        the cloud (InvalidRequest)."""

    @abstractmethod
    def device(self, volume: Volume, index: int, machine_type: str = "") -> str:
        """The stable path a machine of ``machine_type`` sees the ``index``-th attached volume
        at (a ``/dev/disk/by-id/…`` link named from the volume's id or the device name the
        adapter gave it; on AWS Xen types ``/dev/xvd?``), known before the attach so the
        startup script can wait for it."""


@dataclass(frozen=True)
class CheckResult:
    cloud: str
    ok: bool
    message: str  # one sentence: what works, or what is missing


#: Long-running operations a batch form runs at once (GCP, Azure, Yandex stop/delete).
PARALLEL_OPERATIONS = 16


class Provider(ABC):
    """One cloud. Constructed with the cloud's non-secret options from settings (its
    :class:`~providers.spec.Options` model, or a mapping validated against it); secrets come from
    the environment or the SDK's own configuration and are never passed through here. ``clock``
    is the application's, so simulated time reaches the adapter too."""

    # stops and terminates of many machines in flight at once: 1 for clouds whose calls are
    # quick, PARALLEL_OPERATIONS where each is a long-running operation to wait on (GCP, Azure,
    # Yandex): started together, waited on together
    parallel_operations: int = 1

    spec: ClassVar[CloudSpec]
    name: ClassVar[str]
    currency: ClassVar[str]
    options: Options  # each adapter narrows it to its own model

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "spec" in cls.__dict__:
            cls.name = cls.spec.name
            cls.currency = cls.spec.currency

    def __init__(
        self,
        options: Options | Mapping[str, Any] | None = None,
        *,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        model = self.spec.options
        self.options = (
            options if isinstance(options, model) else model.model_validate(dict(options or {}))
        )
        self.clock: Callable[[], datetime] = clock or (lambda: datetime.now(UTC))

    @property
    def ssh_user(self) -> str:
        """Who logs in on this cloud's machines."""
        return self.spec.ssh_user

    # --- the one call helper and its error hook ---------------------------------------------

    def map_error(self, exc: Exception, what: str) -> ProviderError | None:
        """The taxonomy error for one of this cloud's SDK exceptions, or None when ``exc`` is
        not one (it is then raised as it is). ``what`` names the call, for the message. Each
        cloud's classification lives in its folder (``providers/<cloud>/errors.py``)."""
        return None

    def call(
        self, fn: Callable[[], T], what: str = "", *, attempts: int | None = None, **context: Any
    ) -> T:
        """Run one cloud call: an exception :meth:`map_error` (given ``what`` and ``context``)
        recognises is raised as its taxonomy error; Throttled is retried within the options'
        bound (or ``attempts``)."""

        def mapped(exc: Exception) -> ProviderError | None:
            return self.map_error(exc, what, **context)

        return call_with_retry(fn, self.options, mapped, attempts=attempts)

    def close(self) -> None:
        """Release what the adapter holds open (the sandbox's database file); idempotent.
        Clouds that hold nothing open between calls have nothing to do."""
        return None

    @property
    def ssh_port(self) -> int:
        """The port its machines answer SSH on."""
        return 22

    def accepts_ssh(self, instance: Instance, timeout: float = 3) -> bool:
        """Whether the machine's SSH port answers at its public address (a TCP connect)."""
        return bool(instance.public_ip) and port_open(
            instance.public_ip or "", self.ssh_port, timeout
        )

    def check(self) -> CheckResult:
        """Are credentials present and valid? The one skeleton: :meth:`missing_setup` (nothing
        asked over the network), then :meth:`probe` (one cheap call), its error said in one
        sentence by :meth:`refusal`. Must not hang when nothing is configured."""
        try:
            missing = self.missing_setup()
            if missing:
                return CheckResult(self.name, False, missing)
            return CheckResult(self.name, True, self.probe())
        except ProviderError as exc:
            return CheckResult(self.name, False, self.refusal(exc))

    def missing_setup(self) -> str | None:
        """One sentence naming what is not set up (credentials, a project, a folder…) and where
        to set it, judged without a network call; None when nothing is missing."""
        return None

    @abstractmethod
    def probe(self) -> str:
        """One cheap authenticated call; the sentence saying what works (the account,
        project…). Raises the taxonomy."""

    def refusal(self, exc: ProviderError) -> str:
        """The one sentence :meth:`check` gives when :meth:`probe` failed."""
        return f"{self.name}: {str(exc).removeprefix(f'{self.name}: ')}"

    @abstractmethod
    def launch(self, request: LaunchRequest) -> Instance:
        """Create the machine, idempotently by ``request.token``. Raises the taxonomy."""

    @abstractmethod
    def get(self, ref: InstanceRef) -> Instance:
        """Raises NotFound when the machine is gone."""

    @abstractmethod
    def list_managed(
        self, regions: Sequence[str] | None = None, machine_id: str | None = None
    ) -> list[Instance]:
        """Our machines (tag ``managed-by=provisioner``), optionally only one machine id's.
        ``regions=None`` means the regions configured for this cloud. Paginates fully."""

    @abstractmethod
    def stop(self, ref: InstanceRef) -> None:
        """Stop so that compute billing ends (Azure: deallocate). Idempotent."""

    @abstractmethod
    def start(self, ref: InstanceRef) -> None:
        """Idempotent."""

    @abstractmethod
    def terminate(self, ref: InstanceRef) -> None:
        """Idempotent: a machine already gone is not an error."""

    # --- batch forms: the sweep and `stop`/`down` of many names act through these ---------

    def stop_many(self, refs: Sequence[InstanceRef]) -> dict[InstanceRef, ProviderError | None]:
        """Stop every ref: ``{ref: None}`` when it is stopped (or already was), else its error.
        One machine's failure never fails the others. The default loops over :meth:`stop`,
        ``parallel_operations`` at a time; clouds with a batch call do better."""
        return each(refs, self.stop, workers=self.parallel_operations)

    def terminate_many(
        self, refs: Sequence[InstanceRef]
    ) -> dict[InstanceRef, ProviderError | None]:
        """Terminate every ref (gone already is no error), per ref as :meth:`stop_many`."""
        return each(refs, self.terminate, workers=self.parallel_operations)

    # --- volumes: network disks that outlive machines ---------------------------------------

    @property
    def volumes(self) -> VolumeService | None:
        """The cloud's network disks, or None: it has none. An adapter with them overrides this
        (a ``cached_property`` building its helper), so :func:`providers.has_volumes` tells it
        from the class, before any adapter is built."""
        return None

    # --- jobs: the experiment's setup/run and `exec`, detached on the machine ------------------
    # Only the sandbox runs them so far (as local processes); a real cloud's will run over SSH
    # under a supervisor, which is not built yet: they raise NotImplementedError, and `up`
    # refuses an experiment with `run:` for such a cloud before launching anything.

    @property
    def runs_jobs(self) -> bool:
        """Whether this adapter implements the job calls below."""
        return type(self).start_job is not Provider.start_job

    def put_files(self, ref: InstanceRef, source: str, paths: Sequence[str]) -> None:
        """Copy ``paths`` (relative to the local folder ``source``) into the machine's workdir."""
        raise NotImplementedError(f"{self.name}: jobs are not supported yet")

    def start_job(
        self,
        ref: InstanceRef,
        job_id: str,
        command: str,
        *,
        env: Mapping[str, str],
        setup: str | None = None,
    ) -> None:
        """Start ``command`` (shell) detached in the machine's workdir with ``env``; its output
        and exit code are kept on the machine under ``job_id``. ``setup`` (shell) runs first,
        once per machine: a failing setup ends the job with its exit code."""
        raise NotImplementedError(f"{self.name}: jobs are not supported yet")

    def job_state(self, ref: InstanceRef, job_id: str) -> JobState:
        raise NotImplementedError(f"{self.name}: jobs are not supported yet")

    def job_output(self, ref: InstanceRef, job_id: str, offset: int = 0) -> bytes:
        """The job's output (stdout and stderr) from byte ``offset``."""
        raise NotImplementedError(f"{self.name}: jobs are not supported yet")

    def cancel_job(self, ref: InstanceRef, job_id: str, grace: float) -> JobState:
        """End the job: TERM to its process group, KILL after ``grace`` seconds if it still
        runs. Its state after (an exit code when it exited by itself meanwhile)."""
        raise NotImplementedError(f"{self.name}: jobs are not supported yet")

    def machine_report(self, ref: InstanceRef) -> bytes | None:
        """The machine's own record as its agent prints it (``provisioner-agent --report``: its
        samples, jobs, guard and the guard's stop), read where the cloud keeps it. None: this
        cloud has no such way, the report is read over SSH."""
        return None

    def unused_network(self, *, remove: bool = False) -> list[str]:
        """Network pieces this adapter created (tagged as ours: a security group, a firewall
        rule, an address) that no machine uses any more, one line each; removed when
        ``remove``. Clouds whose adapter creates none have nothing to say."""
        return []

    def fetch_offers(self) -> list[Offer]:
        """Rebuild this cloud's offers from its public price source (``catalog refresh``)."""
        raise NotImplementedError(f"{self.name}: no price refresh")


def each(
    refs: Sequence[InstanceRef],
    op: Callable[[InstanceRef], None],
    *,
    workers: int = 1,
) -> dict[InstanceRef, ProviderError | None]:
    """``op`` on every ref, each failure kept with its ref. With ``workers`` > 1 the first ref
    runs alone (it builds the adapter's lazily made clients), then the rest run at most
    ``workers`` at a time: clouds whose stop/delete is a long-running operation start them all
    and wait on them together instead of one after another."""
    out: dict[InstanceRef, ProviderError | None] = {}

    def one(ref: InstanceRef) -> None:
        try:
            op(ref)
            out[ref] = None
        except ProviderError as e:
            out[ref] = e

    todo = list(dict.fromkeys(refs))
    if workers <= 1 or len(todo) <= 1:
        for ref in todo:
            one(ref)
        return out
    one(todo[0])
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(workers, len(todo) - 1)) as pool:
        list(pool.map(one, todo[1:]))
    return {ref: out[ref] for ref in todo}


def paginate(
    fetch: Callable[[C | None], tuple[Iterable[T], C | None]], start: C | None = None
) -> Iterator[T]:
    """Every item of every page. ``fetch(cursor)`` reads one page (``start`` first) and returns
    its items and the cursor of the next page: a token, a marker, a URL, an offset; None or ""
    after the last page. The one pager for clouds whose SDK has none."""
    cursor = start
    while True:
        items, cursor = fetch(cursor)
        yield from items
        if not cursor:
            return
