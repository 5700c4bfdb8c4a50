"""GCP adapter: Compute Engine v1 through google-cloud-compute's REST transport.

Credentials are Application Default Credentials only (``google.auth.default``); tests pass
``anonymous: true`` and an ``api_endpoint`` on loopback. Operations are awaited with our own
ZoneOperationsClient built with the same client options, because ``ExtendedOperation.result()``
would call the real googleapis host, and an operation's ``error`` is checked by hand (it can be
set without ``httpErrorStatusCode``). The SDK is imported inside methods only.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

from providers.base import (
    PARALLEL_OPERATIONS,
    TAG_MACHINE,
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    AuthError,
    CapacityError,
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
)
from providers.gcp import DEFAULT_IMAGE, LIMITS, SPEC, GCPOptions, disktypes, errors, prices
from providers.gcp.network import SSH_TAG, Firewall, last
from providers.gcp.values import label_value, labels, timestamp, utc
from providers.gcp.volumes import PersistentDisks
from providers.limits import startup_payload
from providers.retry import wait_until

T = TypeVar("T")

SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]
PREEMPTED = "compute.instances.preempted"
NO_CREDENTIALS = (
    "gcp: no credentials found (run `gcloud auth application-default login` "
    "or set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file)"
)
# requestId = uuid5(namespace, token/zone/name): the same intent in the same place is one request.
_REQUEST_NAMESPACE = uuid.UUID("5d0b7a52-54c4-4a9c-9a55-0c2f5bd6d8a1")
_STATES = {
    "PROVISIONING": MachineState.PENDING,
    "STAGING": MachineState.PENDING,
    "REPAIRING": MachineState.PENDING,
    "RUNNING": MachineState.RUNNING,
    "STOPPING": MachineState.STOPPING,
    "SUSPENDING": MachineState.STOPPING,
    "STOPPED": MachineState.STOPPED,
    "SUSPENDED": MachineState.STOPPED,
    "TERMINATED": MachineState.STOPPED,
}


class GCPProvider(Provider):
    """Options: :class:`providers.gcp.GCPOptions`.

    GCP Spot VMs have no price cap, so ``request.max_price`` is not sent; the planner's price
    ceiling is what bounds a spot launch here."""

    spec = SPEC
    parallel_operations = PARALLEL_OPERATIONS  # long-running operations: waited on together
    options: GCPOptions

    def __init__(self, options: Any = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self._auth: tuple[Any, str | None] | None = None
        self._clients: dict[str, Any] | None = None
        self._firewall = Firewall(self)

    @cached_property
    def volumes(self) -> PersistentDisks:
        return PersistentDisks(self)

    # --- contract --------------------------------------------------------------------------

    def probe(self) -> str:
        project = self._project()
        from google.cloud import compute_v1

        request = compute_v1.AggregatedListInstancesRequest(project=project, max_results=1)
        self.call(lambda: self._instances().aggregated_list(request=request, retry=None))
        note = ""
        with contextlib.suppress(ProviderError):  # only a hint: reading it may not be allowed
            if self._project_os_login(project):
                note = (
                    "; the project turns OS Login on: machines turn it off for themselves so "
                    "provisioner's key works, unless the organization enforces it "
                    "(constraints/compute.requireOsLogin: then ask for this project's exemption)"
                )
        image = self.image_status(self.options.image)
        return f"gcp: credentials accepted for project {project}{note}; {image}"

    def image_status(self, source: str, *, setting: bool = True) -> str:
        """``source`` resolved as a launch would (an image family to its newest image not
        deprecated, ``images.getFromFamily``; an image by name, ``images.get``), in words. Raises
        :class:`InvalidRequest` (code ``NoImage``) when it does not resolve or is OBSOLETE or
        DELETED ("Operations which use OBSOLETE or DELETED resources will be rejected", compute_v1
        DeprecationStatus.state); DEPRECATED still launches, and is said. The settings' image
        (``setting``) failing is a :class:`ConfigurationError`: every zone of the cloud is out,
        said once by `up`."""
        error = ConfigurationError if setting else InvalidRequest
        m = re.search(r"projects/([^/]+)/global/images/(family/)?([^/]+)$", source)
        if m is None:
            return f"image {source} (not checked: not a projects/…/global/images/… path)"
        project, family, name = m.group(1), bool(m.group(2)), m.group(3)
        image = self._image(project, family, name, error)
        state = image.deprecated.state if image.deprecated else ""
        if state in ("OBSOLETE", "DELETED"):
            raise error(
                f"gcp: image {image.name} is {state}: GCP refuses to launch from it; set "
                f"clouds.gcp.image to a current one, e.g. {DEFAULT_IMAGE}",
                code="NoImage",
            )
        if state == "DEPRECATED":
            instead = image.deprecated.replacement or DEFAULT_IMAGE
            return f"image {image.name} is DEPRECATED (use {instead})"
        return f"image {name} resolves to {image.name}"

    def _image(self, project: str, family: bool, name: str, error: type[ProviderError]) -> Any:
        """The image (a family's newest not deprecated); ``error`` when it does not resolve."""
        images = self._client("images")
        try:
            if family:
                return self.call(lambda: images.get_from_family(project=project, family=name))
            return self.call(lambda: images.get(project=project, image=name))
        except NotFound:
            what = "image family" if family else "image"
            raise error(
                f"gcp: {what} {name} of project {project} does not resolve"
                + (" (every image in it is deprecated, or it never existed)" if family else "")
                + f": set clouds.gcp.image to a current one, e.g. {DEFAULT_IMAGE}",
                code="NoImage",
            ) from None

    def refusal(self, exc: ProviderError) -> str:
        if isinstance(exc, InvalidRequest) and exc.code == "NoImage":
            return str(exc.args[0])
        if isinstance(exc, AuthError) and exc.code in ("noCredentials", "noProject"):
            return str(exc.args[0])
        return f"gcp: check failed: {str(exc).removeprefix('gcp: ')}"

    def _project_os_login(self, project: str) -> bool:
        """Does the project's metadata set enable-oslogin (as SkyPilot reads it)?"""
        found = self.call(lambda: self._client("projects").get(project=project, retry=None))
        items = found.common_instance_metadata.items
        value = next((i.value for i in items if i.key == "enable-oslogin"), "")
        return value.strip().lower() == "true"

    def launch(self, request: LaunchRequest) -> Instance:
        from google.cloud import compute_v1

        ref = InstanceRef(
            id=request.name, region=request.region, zone=request.zone, name=request.name
        )
        self.image_status(request.image or self.options.image, setting=not request.image)
        insert = compute_v1.InsertInstanceRequest(
            project=self._project(),
            zone=request.zone,
            instance_resource=self._instance_resource(request),
            request_id=request_id(request),
        )
        self._firewall.ensure()
        try:
            operation = self.call(
                lambda: self._instances().insert_unary(request=insert, retry=None)
            )
        except InvalidRequest as exc:
            if exc.code != "alreadyExists":
                raise
            return self._adopt(ref, request, exc)
        try:
            self._wait(operation, request.zone)
        except NotFound as exc:  # e.g. the image or network named in the request
            raise InvalidRequest(str(exc), code=exc.code) from exc
        except CapacityError as exc:
            if exc.code == "UNSUPPORTED_OPERATION":
                # Preempted while booting: GCP leaves the instance stopped under our name, and
                # its boot disk bills. Nothing of a failed launch may stay behind.
                with contextlib.suppress(ProviderError):
                    self.terminate(ref)
            raise
        return self.get(ref)

    def get(self, ref: InstanceRef) -> Instance:
        zone = _zone_of(ref)
        instance = self.call(
            lambda: self._instances().get(
                project=self._project(), zone=zone, instance=ref.name or ref.id, retry=None
            )
        )
        return self._to_instance(instance)

    def list_managed(
        self, regions: Sequence[str] | None = None, machine_id: str | None = None
    ) -> list[Instance]:
        from google.cloud import compute_v1

        wanted = set(regions) if regions is not None else self._regions()
        terms = [f'(labels.{TAG_MANAGED_BY} = "{TAG_MANAGED_BY_VALUE}")']
        if machine_id is not None:
            terms.append(f'(labels.{TAG_MACHINE} = "{label_value(machine_id)}")')
        request = compute_v1.AggregatedListInstancesRequest(
            project=self._project(), filter=" AND ".join(terms), max_results=500
        )

        def every_page() -> list[Any]:
            pager = self._instances().aggregated_list(request=request, retry=None)
            return [item for _, scoped in pager for item in scoped.instances]

        found = self.call(every_page)
        return [
            self._to_instance(item) for item in found if prices.region_of(last(item.zone)) in wanted
        ]

    def stop(self, ref: InstanceRef) -> None:
        self._mutate(ref, "stop_unary", discard_local_ssd=True)

    def start(self, ref: InstanceRef) -> None:
        self._mutate(ref, "start_unary")

    def terminate(self, ref: InstanceRef) -> None:
        try:
            self._mutate(ref, "delete_unary")
        except NotFound:
            return

    def unused_network(self, *, remove: bool = False) -> list[str]:
        return self._firewall.unused(remove)

    def fetch_offers(self) -> list[Offer]:
        return prices.fetch_offers(self.options)

    # --- launch helpers --------------------------------------------------------------------

    def _instance_resource(self, request: LaunchRequest) -> Any:
        from google.cloud import compute_v1

        zone = request.zone
        interface = compute_v1.NetworkInterface(network=self.options.network)
        if request.instance_type.startswith("a3-"):
            interface.nic_type = "GVNIC"  # A3 machines require gVNIC
        if self.options.subnetwork:
            interface.subnetwork = self.options.subnetwork
        if self.options.external_ip:
            interface.access_configs = [
                compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")
            ]
        return compute_v1.Instance(
            name=request.name,
            machine_type=f"zones/{zone}/machineTypes/{request.instance_type}",
            labels=labels(request.labels),
            tags=compute_v1.Tags(items=[SSH_TAG]),  # what our SSH firewall rule applies to
            scheduling=_scheduling(compute_v1, request),
            guest_accelerators=_accelerators(compute_v1, request),
            metadata=compute_v1.Metadata(items=_metadata(compute_v1, request)),
            network_interfaces=[interface],
            disks=[
                compute_v1.AttachedDisk(
                    boot=True,
                    auto_delete=True,
                    type_="PERSISTENT",
                    initialize_params=compute_v1.AttachedDiskInitializeParams(
                        source_image=request.image or self.options.image,
                        disk_size_gb=request.disk_gb,
                        disk_type=f"zones/{zone}/diskTypes/{boot_disk_type(request.instance_type)}",
                        # the disk is billed apart from the VM, under its own labels
                        # (AttachedDiskInitializeParams.labels: "Labels to apply to this disk")
                        labels=labels(request.labels),
                    ),
                )
            ],
        )

    def _adopt(self, ref: InstanceRef, request: LaunchRequest, exc: ProviderError) -> Instance:
        """A 409 on our name: ours if it carries the same machine label (a retry whose
        requestId the cloud no longer remembers), else someone else's instance."""
        existing = self.get(ref)
        ours = label_value(request.labels.get(TAG_MACHINE, ""))
        if ours and existing.labels.get(TAG_MACHINE) == ours:
            return existing
        raise InvalidRequest(
            f"gcp: an instance named {request.name} already exists in {request.zone} "
            "and is not this machine's",
            code="alreadyExists",
        ) from exc

    # --- operations ------------------------------------------------------------------------

    def _mutate(self, ref: InstanceRef, method: str, **fields: Any) -> None:
        zone = _zone_of(ref)
        # One requestId per call: a retry after a lost answer joins the first operation.
        call_id = str(uuid.uuid4())
        operation = self.call(
            lambda: getattr(self._instances(), method)(
                request={
                    "project": self._project(),
                    "zone": zone,
                    "instance": ref.name or ref.id,
                    "request_id": call_id,
                    **fields,
                },
                retry=None,
            )
        )
        self._wait(operation, zone)

    def _wait(self, operation: Any, zone: str) -> None:
        def wait() -> Any:  # the server holds the call until done or ~2 minutes
            return self._operations().wait(
                project=self._project(), zone=zone, operation=operation.name, retry=None
            )

        self._await(operation, wait, zone)

    def _wait_global(self, operation: Any, project: str) -> None:
        def wait() -> Any:
            return self._client("global_operations").wait(
                project=project, operation=operation.name, retry=None
            )

        self._await(operation, wait, "global")

    def _await(self, operation: Any, wait: Callable[[], Any], where: str) -> None:
        from google.cloud import compute_v1

        status_done = compute_v1.Operation.Status.DONE
        operation, finished = wait_until(
            lambda: self.call(wait),
            lambda op: op.status == status_done,
            timeout=self.options.operation_timeout_seconds,
            interval=0,
            current=operation,
        )
        if not finished:
            raise Throttled(
                f"gcp: operation {operation.name} still {operation.status.name} in {where}",
                code="operationTimeout",
            )
        if operation.error.errors:
            raise errors.operation_error(operation)

    def _was_preempted(self, instance: Any, zone: str) -> bool:
        """A preempted-operation for this instance since it last started."""
        from google.cloud import compute_v1

        request = compute_v1.ListZoneOperationsRequest(
            project=self._project(),
            zone=zone,
            filter=f'(operationType = "{PREEMPTED}") AND (targetId = {instance.id})',
        )
        operations = self.call(lambda: list(self._operations().list(request=request, retry=None)))
        started = timestamp(instance.last_start_timestamp)
        return any(
            started is None or (timestamp(op.insert_time) or started) >= started
            for op in operations
        )

    def _to_instance(self, item: Any) -> Instance:
        zone = last(item.zone)
        spot = item.scheduling.provisioning_model == "SPOT" or bool(item.scheduling.preemptible)
        state = _STATES.get(item.status, MachineState.PENDING)
        reason = item.status_message or None
        if item.status == "TERMINATED" and spot and self._was_preempted(item, zone):
            state, reason = MachineState.PREEMPTED, PREEMPTED
        public, private = _addresses(item)
        return Instance(
            id=str(item.id),
            name=item.name,
            region=prices.region_of(zone),
            zone=zone,
            instance_type=last(item.machine_type),
            state=state,
            spot=spot,
            labels=dict(item.labels),
            public_ip=public,
            private_ip=private,
            launched_at=timestamp(item.creation_timestamp),
            state_reason=reason,
            # lastStopTimestamp: "Last stop timestamp in RFC3339 text format" (compute v1
            # Instance; google-cloud-compute Instance.last_stop_timestamp), set on a stop and on
            # a preemption that stops (instanceTerminationAction STOP). A deleted VM has none.
            stopped_at=utc(timestamp(item.last_stop_timestamp)),
        )

    # --- plumbing --------------------------------------------------------------------------

    def map_error(self, exc: Exception, what: str) -> ProviderError | None:
        return errors.map_error(exc, what)

    def _credentials(self) -> tuple[Any, str | None]:
        if self._auth is None:
            if self.options.anonymous:
                from google.auth.credentials import AnonymousCredentials

                self._auth = (AnonymousCredentials(), None)
            else:
                if not adc_configured():
                    raise AuthError(NO_CREDENTIALS, code="noCredentials")
                import google.auth
                from google.auth.exceptions import DefaultCredentialsError

                try:
                    self._auth = google.auth.default(scopes=SCOPES)
                except DefaultCredentialsError as exc:
                    raise AuthError(f"gcp: {exc}", code="DefaultCredentialsError") from None
        return self._auth

    def _project(self) -> str:
        project = self.options.project or self._credentials()[1]
        if not project:
            raise AuthError(
                "gcp: no project set (give `project` in the gcp settings or GOOGLE_CLOUD_PROJECT)",
                code="noProject",
            )
        return str(project)

    def _instances(self) -> Any:
        return self._client("instances")

    def _operations(self) -> Any:
        return self._client("zone_operations")

    def _client(self, kind: str) -> Any:
        return self._sdk_clients()[kind]

    def _sdk_clients(self) -> dict[str, Any]:
        if self._clients is None:
            from google.api_core.client_options import ClientOptions
            from google.cloud import compute_v1

            endpoint = self.options.endpoint
            common = {
                "credentials": self._credentials()[0],
                "transport": "rest",
                "client_options": ClientOptions(api_endpoint=endpoint) if endpoint else None,
            }
            self._clients = {
                "instances": compute_v1.InstancesClient(**common),
                "disks": compute_v1.DisksClient(**common),
                "zone_operations": compute_v1.ZoneOperationsClient(**common),
                "firewalls": compute_v1.FirewallsClient(**common),
                "global_operations": compute_v1.GlobalOperationsClient(**common),
                "projects": compute_v1.ProjectsClient(**common),
                "images": compute_v1.ImagesClient(**common),
            }
        return self._clients

    def _regions(self) -> set[str]:
        if self.options.zones:
            return {prices.region_of(z) for z in self.options.zones}
        return set(self.options.regions)


# --- pure helpers (module level so tests and the emulator can share the rules) --------------


def request_id(request: LaunchRequest) -> str:
    return str(uuid.uuid5(_REQUEST_NAMESPACE, f"{request.token}/{request.zone}/{request.name}"))


def adc_configured() -> bool:
    """Would ``google.auth.default`` find something without a slow metadata-server probe?
    Off Google hardware the probe is skipped, so a bare machine answers at once."""
    if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS") or os.environ.get("GCE_METADATA_HOST"):
        return True
    config = os.environ.get("CLOUDSDK_CONFIG")
    if not config:
        base = os.environ.get("APPDATA", "") if os.name == "nt" else Path.home() / ".config"
        config = str(Path(base) / "gcloud")
    if (Path(config) / "application_default_credentials.json").is_file():
        return True
    if os.environ.get("NO_GCE_CHECK") == "True":
        return False
    try:
        return Path("/sys/class/dmi/id/product_name").read_text().startswith("Google")
    except OSError:
        return False


def boot_disk_type(instance_type: str) -> str:
    """The boot disk type a machine series takes: Hyperdisk Balanced on the Hyperdisk-only
    series (A3 Ultra, A4), else pd-balanced (:mod:`providers.gcp.disktypes`, sources there)."""
    return disktypes.volume_type(instance_type)


def _zone_of(ref: InstanceRef) -> str:
    if not ref.zone:
        raise InvalidRequest(f"gcp: instance {ref.name or ref.id} has no zone", code="noZone")
    return ref.zone


def _scheduling(compute_v1: Any, request: LaunchRequest) -> Any:
    """Spot (stopped or deleted on preemption) or standard; a GPU host cannot live-migrate."""
    if request.spot:
        return compute_v1.Scheduling(
            provisioning_model="SPOT",
            instance_termination_action=(
                "STOP" if request.preemption_action == "stop" else "DELETE"
            ),
            on_host_maintenance="TERMINATE",
            automatic_restart=False,
        )
    gpu_host = bool(request.gpu_count or request.accelerator)
    return compute_v1.Scheduling(
        provisioning_model="STANDARD",
        on_host_maintenance="TERMINATE" if gpu_host else "MIGRATE",
        automatic_restart=True,
    )


def _accelerators(compute_v1: Any, request: LaunchRequest) -> list[Any]:
    """The GPUs attached to the host: the request's accelerator, or on an N1 host the one its
    GPU model is sold as; none for a machine type that comes with its GPUs."""
    accelerator = request.accelerator
    if not accelerator and request.instance_type.startswith("n1-"):
        accelerator = prices.ACCELERATOR.get(request.gpu, "")
    if not accelerator:
        return []
    return [
        compute_v1.AcceleratorConfig(
            accelerator_count=request.gpu_count or 1,
            accelerator_type=f"zones/{request.zone}/acceleratorTypes/{accelerator}",
        )
    ]


def _metadata(compute_v1: Any, request: LaunchRequest) -> list[Any]:
    # DLVM images install the NVIDIA driver on first boot only when asked to. OS Login, when
    # a project turns it on, makes the guest ignore metadata ssh-keys (compute/docs/instances/
    # managing-instance-access); the instance's own value overrides the project's (compute/
    # docs/oslogin), so our key works in such projects too, as Datalab and Packer do it
    # (googledatalab/datalab#1930, hashicorp/packer-plugin-googlecompute#241). An organization
    # enforcing compute.requireOsLogin refuses this: see errors._OS_LOGIN_ENFORCED.
    items = [
        compute_v1.Items(key="install-nvidia-driver", value="True"),
        compute_v1.Items(key="enable-oslogin", value="FALSE"),
    ]
    if script := startup_payload(LIMITS, request.user_data, None, None):  # text, ≤ 256 KB
        items.append(compute_v1.Items(key="startup-script", value=str(script)))
    if request.ssh_public_key:
        items.append(
            compute_v1.Items(key="ssh-keys", value=f"provisioner:{request.ssh_public_key.strip()}")
        )
    return items


def _addresses(item: Any) -> tuple[str | None, str | None]:
    """An instance's external (first access config's NAT) and internal address, on its first
    network interface."""
    nic = item.network_interfaces[0] if item.network_interfaces else None
    public = nic.access_configs[0].nat_i_p if nic and nic.access_configs else ""
    return public or None, (nic.network_i_p if nic else "") or None
