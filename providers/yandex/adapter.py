"""The Yandex Cloud adapter over the ``yandexcloud`` SDK (gRPC). See the package docstring for
options, credentials, error heuristics and how a preemption is told from a user stop."""

from __future__ import annotations

import json
import os
import re
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from providers.base import (
    PARALLEL_OPERATIONS,
    TAG_MACHINE,
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    AuthError,
    ConfigurationError,
    Instance,
    InstanceRef,
    InvalidRequest,
    LaunchRequest,
    MachineState,
    NotFound,
    Offer,
    Provider,
    ProviderError,
    Throttled,
    paginate,
)
from providers.limits import startup_payload
from providers.retry import wait_until
from providers.yandex import LIMITS, SPEC, YandexOptions, errors
from providers.yandex.labels import idempotency_key, sanitise_label, sanitise_labels
from providers.yandex.network import Network
from providers.yandex.prices import (
    REGION,
    Shape,
    build_offers,
    current_rates,
    parse_instance_type,
)
from providers.yandex.volumes import Volumes

SSH_USER = "provisioner"
_IMAGE_ID = re.compile(r"[a-z0-9]{20}")
_NO_CREDENTIALS = (
    "yandex: no credentials found (set YC_IAM_TOKEN, YC_SERVICE_ACCOUNT_KEY_FILE or YC_TOKEN, "
    "or use_metadata_service: true on a Yandex VM)"
)

_STATES = {
    "PROVISIONING": MachineState.PENDING,
    "STARTING": MachineState.PENDING,
    "RESTARTING": MachineState.PENDING,
    "UPDATING": MachineState.PENDING,
    "RUNNING": MachineState.RUNNING,
    "STOPPING": MachineState.STOPPING,
    "STOPPED": MachineState.STOPPED,
    # ERROR/CRASHED machines still exist (and their disks bill): they read as stopped, with the
    # cloud's word in state_reason, so nobody relaunches them as if preempted.
    "ERROR": MachineState.STOPPED,
    "CRASHED": MachineState.STOPPED,
    "DELETING": MachineState.TERMINATED,
}

# Operation metadata types that change a machine's power state, by what they mean for a stop.
_OP_META = "type.googleapis.com/yandex.cloud.compute.v1."
_STOPPED_BY_CALL = {"StopInstanceMetadata", "GuestStopInstanceMetadata", "CrashInstanceMetadata"}
_PREEMPTED = {"PreemptInstanceMetadata"}
_STARTED = {"CreateInstanceMetadata", "StartInstanceMetadata", "RestartInstanceMetadata"}


# The GPU image family per platform, from Yandex's "Create a VM with a GPU" docs
# (compute/operations/vm-create/create-vm-with-gpu, recorded in shared/reference/clouds.md):
# the driver in `ubuntu-2004-lts-gpu` serves V100 and T4 only; A100 and T4i need the CUDA 12.2
# image (driver 535); Gen2 boots with secure boot. gpu-standard-v4 has no documented image.
GPU_IMAGE_FAMILIES = {
    "gpu-standard-v1": "ubuntu-2004-lts-gpu",
    "gpu-standard-v2": "ubuntu-2004-lts-gpu",
    "standard-v3-t4": "ubuntu-2004-lts-gpu",
    "gpu-standard-v3": "ubuntu-2204-lts-cuda-12-2",
    "standard-v3-t4i": "ubuntu-2204-lts-cuda-12-2",
    "gpu-standard-v3i": "ubuntu-2004-lts-secureboot-cuda-12-2",
}


class YandexProvider(Provider):
    spec = SPEC
    parallel_operations = PARALLEL_OPERATIONS  # long-running operations: waited on together
    options: YandexOptions

    def __init__(self, options: Any = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self._sdk_obj: Any = None
        self._network = Network(self)
        self._image_cache: dict[str, str] = {}

    @cached_property
    def volumes(self) -> Volumes:
        return Volumes(self)

    # --- configuration -----------------------------------------------------------------------

    @property
    def folder_id(self) -> str | None:
        return self.options.folder_id or os.environ.get("YC_FOLDER_ID") or None

    def _credentials(self) -> tuple[str, dict[str, Any]] | None:
        """(what, SDK keyword arguments) from the environment, or None. Never logged."""
        if token := os.environ.get("YC_IAM_TOKEN"):
            return "IAM token from YC_IAM_TOKEN", {"iam_token": token}
        if key_file := os.environ.get("YC_SERVICE_ACCOUNT_KEY_FILE"):
            try:
                key = json.loads(Path(key_file).read_text())
            except (OSError, ValueError) as exc:
                raise AuthError(
                    f"yandex: cannot read the service account key file named by "
                    f"YC_SERVICE_ACCOUNT_KEY_FILE ({type(exc).__name__})",
                    code="BAD_KEY_FILE",
                ) from None
            return "service account key from YC_SERVICE_ACCOUNT_KEY_FILE", {
                "service_account_key": key
            }
        if token := os.environ.get("YC_TOKEN"):
            return "OAuth token from YC_TOKEN", {"token": token}
        if self.options.use_metadata_service:
            return "the VM metadata service", {}
        return None

    def _sdk(self) -> Any:
        if self._sdk_obj is None:
            creds = self._credentials()
            if creds is None:
                raise AuthError(_NO_CREDENTIALS, code="NO_CREDENTIALS")
            import yandexcloud

            kwargs = dict(creds[1])
            if cert := self.options.root_certificates_file:
                try:
                    kwargs["root_certificates"] = Path(cert).read_bytes()
                except OSError as exc:
                    raise InvalidRequest(
                        f"yandex: root_certificates_file {cert}: {exc.strerror}", code="BAD_CERT"
                    ) from None
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)  # OAuth: said in check()
                    self._sdk_obj = yandexcloud.SDK(endpoint=self.options.endpoint, **kwargs)
            except RuntimeError as exc:  # the SDK's own validation of the key, no secret in it
                raise AuthError(f"yandex: {exc}", code="BAD_CREDENTIALS") from None
        return self._sdk_obj

    # --- calls ---------------------------------------------------------------------------------

    def _rpc(
        self,
        stub: Any,
        method: str,
        request: Any,
        what: str,
        *,
        zone: str | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
        retry: bool = True,
    ) -> Any:
        """One unary call with a deadline, errors mapped, Throttled retried (bounded)."""

        def once() -> Any:
            client = self._sdk().client(stub)  # first use discovers endpoints: may fail
            return getattr(client, method)(
                request, timeout=self.options.timeout_seconds, metadata=metadata
            )

        return self.call(once, what, attempts=None if retry else 1, zone=zone)

    def map_error(self, exc: Exception, what: str, zone: str | None = None) -> ProviderError | None:
        return errors.map_error(exc, what, zone)

    def _wait(self, operation: Any, what: str, zone: str | None = None) -> Any:
        """Poll OperationService.Get until done; a failed operation raises the taxonomy."""
        from yandex.cloud.operation.operation_service_pb2 import GetOperationRequest
        from yandex.cloud.operation.operation_service_pb2_grpc import OperationServiceStub

        operation_id = operation.id
        operation, finished = wait_until(
            lambda: self._rpc(
                OperationServiceStub,
                "Get",
                GetOperationRequest(operation_id=operation_id),
                f"{what} (operation {operation_id})",
                zone=zone,
            ),
            lambda op: bool(op.done),
            timeout=self.options.operation_timeout_seconds,
            interval=self.options.poll_seconds,
            current=operation,
        )
        if not finished:
            raise Throttled(
                f"yandex: {what}: operation {operation_id} still running", code="TIMEOUT"
            )
        if operation.HasField("error") and operation.error.code:
            import grpc

            code = grpc.StatusCode
            name = next((c.name for c in code if c.value[0] == operation.error.code), "UNKNOWN")
            raise errors.by_code(
                name, operation.error.message, what, zone, errors.detail_types(operation.error)
            )
        return operation

    def _pages(self, call: Callable[[str], Any], field: str) -> Iterator[Any]:
        """Every ``field`` item of a List call, ``call(page_token)`` reading one page."""

        def page(token: str | None) -> tuple[Iterable[Any], str]:
            got = call(token or "")
            return getattr(got, field), got.next_page_token

        return paginate(page)

    # --- Provider ------------------------------------------------------------------------------

    def missing_setup(self) -> str | None:
        try:
            creds = self._credentials()
        except AuthError as exc:
            return str(exc)
        if creds is None:
            return _NO_CREDENTIALS
        if not self.folder_id:
            return "yandex: no folder set (folder_id in settings or YC_FOLDER_ID)"
        return None

    def probe(self) -> str:
        from yandex.cloud.compute.v1.instance_service_pb2 import ListInstancesRequest
        from yandex.cloud.compute.v1.instance_service_pb2_grpc import InstanceServiceStub

        folder_id = self._require_folder()
        self._rpc(
            InstanceServiceStub,
            "List",
            ListInstancesRequest(folder_id=folder_id, page_size=1),
            f"list instances in folder {folder_id}",
            retry=False,
        )
        source = self._credential_source()
        note = " (Yandex deprecates OAuth tokens: prefer a key)" if "OAuth" in source else ""
        return f"yandex: {source} accepted for folder {folder_id}{note}; {self.image_status()}"

    def image_status(self) -> str:
        """The images launches would boot, resolved as they resolve them
        (``ImageService.GetLatestByFamily`` in ``image_folder_id``): the ``image`` setting, else
        each GPU family Yandex documents per platform. Raises :class:`InvalidRequest` (code
        ``NoImage``) naming one that does not resolve."""
        images = [self.options.image] if self.options.image else GPU_IMAGE_FAMILIES.values()
        found = []
        for image in dict.fromkeys(images):
            try:
                found.append(f"{image} → {self._image_id(image, '')}")
            except NotFound as exc:
                raise InvalidRequest(
                    f"yandex: image family {image} not found in {self.options.image_folder_id}"
                    f" ({exc.code}): set clouds.yandex.image to a family or image id that exists",
                    code="NoImage",
                ) from exc
        return "images " + ", ".join(found)

    def refusal(self, exc: ProviderError) -> str:
        if exc.code == "NoImage":
            return str(exc.args[0])
        return f"{exc} (credentials: {self._credential_source()})"

    def _credential_source(self) -> str:
        creds = self._credentials()
        return creds[0] if creds else "none"

    def launch(self, request: LaunchRequest) -> Instance:
        from yandex.cloud.compute.v1 import instance_pb2
        from yandex.cloud.compute.v1 import instance_service_pb2 as svc
        from yandex.cloud.compute.v1.instance_service_pb2_grpc import InstanceServiceStub

        shape = parse_instance_type(request.instance_type)
        folder_id = self._require_folder()
        metadata = {}
        # cloud-init text: a metadata value is a string (providers/yandex LIMITS)
        key = request.ssh_public_key
        if user_data := startup_payload(LIMITS, request.user_data, key, SSH_USER):
            metadata["user-data"] = str(user_data)
        if request.ssh_public_key:
            metadata["ssh-keys"] = f"{SSH_USER}:{request.ssh_public_key.strip()}"
        create = svc.CreateInstanceRequest(
            folder_id=folder_id,
            name=request.name,
            labels=sanitise_labels(request.labels),
            zone_id=request.zone,
            platform_id=shape.platform_id,
            resources_spec=svc.ResourcesSpec(
                memory=shape.memory_bytes, cores=shape.vcpus, core_fraction=100, gpus=shape.gpus
            ),
            # Yandex preemptible VMs are always stopped, never deleted, and have a fixed price:
            # preemption_action and max_price have nothing to map to.
            scheduling_policy=instance_pb2.SchedulingPolicy(preemptible=request.spot),
            boot_disk_spec=svc.AttachedDiskSpec(
                auto_delete=True,
                disk_spec=svc.AttachedDiskSpec.DiskSpec(
                    type_id=self.options.disk_type,
                    size=request.disk_gb << 30,
                    image_id=self._image_id(request.image, shape.platform_id),
                ),
            ),
            network_interface_specs=[
                svc.NetworkInterfaceSpec(
                    subnet_id=(subnet := self._network.subnet_id(folder_id, request.zone)),
                    primary_v4_address_spec=svc.PrimaryAddressSpec(
                        one_to_one_nat_spec=svc.OneToOneNatSpec(ip_version=instance_pb2.IPV4)
                    ),
                    security_group_ids=self._network.security_groups(folder_id, subnet),
                )
            ],
            metadata=metadata,
        )
        what = f"create {request.instance_type} in {request.zone}"
        operation = self._rpc(
            InstanceServiceStub,
            "Create",
            create,
            what,
            zone=request.zone,
            metadata=[("idempotency-key", idempotency_key(request.token))],
        )
        done = self._wait(operation, what, request.zone)
        created = instance_pb2.Instance()
        done.response.Unpack(created)
        return self._to_instance(created)

    def get(self, ref: InstanceRef) -> Instance:
        return self._to_instance(self._get_raw(ref.id))

    def list_managed(
        self, regions: Sequence[str] | None = None, machine_id: str | None = None
    ) -> list[Instance]:
        """InstanceService.List cannot filter by label: every page of the folder is read and the
        labels are filtered here."""

        if regions is not None and REGION not in regions:
            return []
        folder_id = self._require_folder()
        wanted = {TAG_MANAGED_BY: TAG_MANAGED_BY_VALUE}
        if machine_id is not None:
            wanted[TAG_MACHINE] = sanitise_label(machine_id, key=False)
        return [
            self._to_instance(i)
            for i in self._instances_raw(folder_id)
            if all(i.labels.get(k) == v for k, v in wanted.items())
        ]

    def _instances_raw(self, folder_id: str) -> Iterator[Any]:
        from yandex.cloud.compute.v1.instance_service_pb2 import ListInstancesRequest
        from yandex.cloud.compute.v1.instance_service_pb2_grpc import InstanceServiceStub

        return self._pages(
            lambda token: self._rpc(
                InstanceServiceStub,
                "List",
                ListInstancesRequest(folder_id=folder_id, page_size=1000, page_token=token),
                f"list instances in folder {folder_id}",
            ),
            "instances",
        )

    def unused_network(self, *, remove: bool = False) -> list[str]:
        return self._network.unused(remove)

    def stop(self, ref: InstanceRef) -> None:
        self._power(
            ref, "Stop", done={MachineState.STOPPED, MachineState.STOPPING, MachineState.PREEMPTED}
        )

    def start(self, ref: InstanceRef) -> None:
        self._power(ref, "Start", done={MachineState.RUNNING, MachineState.PENDING})

    def terminate(self, ref: InstanceRef) -> None:
        from yandex.cloud.compute.v1.instance_service_pb2 import DeleteInstanceRequest
        from yandex.cloud.compute.v1.instance_service_pb2_grpc import InstanceServiceStub

        what = f"delete instance {ref.id}"
        try:
            operation = self._rpc(
                InstanceServiceStub,
                "Delete",
                DeleteInstanceRequest(instance_id=ref.id),
                what,
                metadata=[("idempotency-key", str(uuid.uuid4()))],
            )
            self._wait(operation, what)
        except NotFound:
            return
        except InvalidRequest:  # e.g. already DELETING
            try:
                state = self.get(ref).state
            except NotFound:
                return
            if state is not MachineState.TERMINATED:
                raise

    def fetch_offers(self) -> list[Offer]:
        """Billing SkuService.List (all pages, RUB incl. VAT) → the street price in force now
        of each GPU platform's GPU, vCPU and RAM meters → one offer per shape and zone where the
        platform is sold (option ``zones`` narrows it)."""
        from yandex.cloud.billing.v1.sku_service_pb2 import ListSkusRequest
        from yandex.cloud.billing.v1.sku_service_pb2_grpc import SkuServiceStub

        skus = self._pages(
            lambda token: self._rpc(
                SkuServiceStub,
                "List",
                ListSkusRequest(currency="RUB", page_size=1000, page_token=token),
                "list billing SKUs",
            ),
            "skus",
        )
        rates = current_rates(skus, "RUB", datetime.now(UTC))
        source = "Yandex billing API SkuService.List (RUB incl. VAT); GPUs×GPU + vCPU×vCPU + GB×RAM"
        return build_offers(rates, source, self.options.zones)

    # --- helpers -------------------------------------------------------------------------------

    def _require_folder(self) -> str:
        if not self.folder_id:
            raise ConfigurationError(
                "yandex: no folder set (folder_id in settings or YC_FOLDER_ID)", code="NO_FOLDER"
            )
        return self.folder_id

    def _get_raw(self, instance_id: str) -> Any:
        from yandex.cloud.compute.v1.instance_service_pb2 import GetInstanceRequest
        from yandex.cloud.compute.v1.instance_service_pb2_grpc import InstanceServiceStub

        return self._rpc(
            InstanceServiceStub,
            "Get",
            GetInstanceRequest(instance_id=instance_id),
            f"get instance {instance_id}",
        )

    def _power(self, ref: InstanceRef, method: str, done: set[MachineState]) -> None:
        """Stop/Start, idempotent: nothing to do if the machine is there already; a call that
        races with another transition is judged by the state it leaves."""
        from yandex.cloud.compute.v1 import instance_service_pb2 as svc
        from yandex.cloud.compute.v1.instance_service_pb2_grpc import InstanceServiceStub

        if self.get(ref).state in done:
            return
        what = f"{method.lower()} instance {ref.id}"
        request = getattr(svc, f"{method}InstanceRequest")(instance_id=ref.id)
        try:
            operation = self._rpc(
                InstanceServiceStub,
                method,
                request,
                what,
                metadata=[("idempotency-key", str(uuid.uuid4()))],  # same key on every retry
                zone=ref.zone,
            )
            # a preemptible VM's Start is checked for capacity: "Not enough resources" there
            # names the zone like a failed launch does
            self._wait(operation, what, ref.zone)
        except InvalidRequest:
            if self.get(ref).state not in done:
                raise

    def _image_id(self, image: str | None, platform_id: str) -> str:
        """``request.image`` or option ``image``, else the family Yandex documents for the
        platform: an image id (20 chars) is used as it is, anything else is a family in
        ``image_folder_id`` (default standard-images)."""
        from yandex.cloud.compute.v1.image_service_pb2 import GetImageLatestByFamilyRequest
        from yandex.cloud.compute.v1.image_service_pb2_grpc import ImageServiceStub

        image = image or self.options.image or GPU_IMAGE_FAMILIES.get(platform_id)
        if image is None:
            raise InvalidRequest(
                f"yandex: Yandex documents no GPU image for {platform_id}: set "
                "clouds.yandex.image, or the experiment's image, to one with its driver",
                code="NoImage",
            )
        if _IMAGE_ID.fullmatch(image):
            return image
        if image not in self._image_cache:
            folder = self.options.image_folder_id
            found = self._rpc(
                ImageServiceStub,
                "GetLatestByFamily",
                GetImageLatestByFamilyRequest(folder_id=folder, family=image),
                f"find the latest image of family {image} in {folder}",
            )
            self._image_cache[image] = found.id
        return self._image_cache[image]

    def _stop_reason(self, instance_id: str) -> tuple[MachineState, str, datetime | None]:
        """Why a preemptible machine is STOPPED, from its own operation history: the latest
        operation that changed its power state. A Stop (ours, the console's, the guest's) means
        STOPPED; PreemptInstance means PREEMPTED; a start with no stop after it means it went
        down without anyone asking: PREEMPTED too. No history at all: STOPPED (a relaunch is
        the costlier mistake). And when: the Instance message has no stop time (compute/v1
        instance.proto: only ``created_at``), so the deciding stop or preempt operation's
        ``modified_at`` ("the time when the Operation resource was last modified",
        operation.proto; done, so when it finished) dates it; None without such an operation."""
        from yandex.cloud.compute.v1.instance_service_pb2 import ListInstanceOperationsRequest
        from yandex.cloud.compute.v1.instance_service_pb2_grpc import InstanceServiceStub

        operations = self._pages(
            lambda token: self._rpc(
                InstanceServiceStub,
                "ListOperations",
                ListInstanceOperationsRequest(
                    instance_id=instance_id, page_size=1000, page_token=token
                ),
                f"list operations of instance {instance_id}",
            ),
            "operations",
        )
        power = [
            (op.created_at.ToDatetime(UTC), kind, op.id, op.modified_at.ToDatetime(UTC))
            for op in operations
            if (kind := op.metadata.type_url.removeprefix(_OP_META))
            in _STOPPED_BY_CALL | _PREEMPTED | _STARTED
            and op.done
            and not op.error.code
        ]
        if not power:
            return MachineState.STOPPED, "STOPPED (no operation history)", None
        _at, kind, op_id, done_at = max(power)
        if kind in _STOPPED_BY_CALL:
            why = f"STOPPED by {kind.removesuffix('Metadata')} {op_id}"
            return MachineState.STOPPED, why, done_at
        if kind in _PREEMPTED:
            return MachineState.PREEMPTED, f"PreemptInstance {op_id}", done_at
        return MachineState.PREEMPTED, f"STOPPED with no stop operation after {op_id}", None

    def _to_instance(self, raw: Any) -> Instance:
        status = raw.Status.Name(raw.status)
        state = _STATES.get(status, MachineState.PENDING)
        reason = status
        preemptible = raw.scheduling_policy.preemptible
        # A regular machine's history is not read (a call per stopped machine): no time then.
        stopped_at = None
        if status == "STOPPED" and preemptible:
            state, reason, stopped_at = self._stop_reason(raw.id)
        nic = raw.network_interfaces[0] if raw.network_interfaces else None
        address = nic.primary_v4_address if nic else None
        return Instance(
            id=raw.id,
            name=raw.name,
            region=raw.zone_id.rsplit("-", 1)[0],
            zone=raw.zone_id,
            instance_type=Shape(
                raw.platform_id,
                raw.resources.gpus,
                raw.resources.cores,
                raw.resources.memory >> 30,
            ).instance_type,
            state=state,
            spot=preemptible,
            labels=dict(raw.labels),
            public_ip=(address.one_to_one_nat.address or None) if address else None,
            private_ip=(address.address or None) if address else None,
            launched_at=raw.created_at.ToDatetime(UTC) if raw.HasField("created_at") else None,
            state_reason=reason,
            stopped_at=stopped_at,
        )
