"""Azure: virtual machines through azure-mgmt-compute, their NICs, public IPs and SSH network
security group through azure-mgmt-network, credentials through azure-identity's
DefaultAzureCredential. All three are imported lazily."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property, partial
from typing import Any, TypeVar
from urllib.parse import urlsplit

from providers.azure import LIMITS, SPEC, AzureOptions, arm_tags, errors, prices
from providers.azure.instances import to_instance
from providers.azure.network import Network, ip_name, nic_name
from providers.azure.volumes import ManagedDisks
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
    NotFound,
    Offer,
    Provider,
    ProviderError,
    QuotaError,
    Throttled,
)
from providers.limits import startup_payload

T = TypeVar("T")

# Ubuntu 22.04 HPC image from the Data Science VM team: NVIDIA driver, CUDA, InfiniBand stack.
ARM_SCOPE = "https://management.azure.com/.default"
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_NO_ANSWER = "NoAnswer"  # check's probe got no answer in time

_VM_ID = re.compile(
    r"/resourceGroups/([^/]+)/providers/Microsoft\.Compute/virtualMachines/([^/]+)$", re.I
)


class AzureProvider(Provider):
    """Options: :class:`providers.azure.AzureOptions`.

    ``credential`` (keyword) is any azure-core ``TokenCredential`` to use instead of
    DefaultAzureCredential, for an embedding application that already holds one, or a static one
    against a local ARM endpoint.
    """

    spec = SPEC
    parallel_operations = PARALLEL_OPERATIONS  # long-running operations: waited on together
    options: AzureOptions

    def __init__(self, options: Any = None, *, credential: Any = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self._supplied_credential = credential
        self._sdk: tuple[Any, Any] | None = None
        self._lock = threading.Lock()
        self._network = Network(self)

    @cached_property
    def volumes(self) -> ManagedDisks:
        return ManagedDisks(self)

    # --- configuration

    @property
    def ssh_user(self) -> str:
        """Azure makes the admin user itself, named by the option (and its key path)."""
        return self.options.admin_username

    @property
    def regions(self) -> list[str]:
        return list(self.options.regions)

    @property
    def resource_group(self) -> str:
        return self.options.resource_group

    def _subscription_id(self) -> str | None:
        return self.options.subscription_id or os.environ.get("AZURE_SUBSCRIPTION_ID")

    def _credential_source(self) -> str | None:
        """Which credential DefaultAzureCredential will find, judged without any network call."""
        env = os.environ
        if self._supplied_credential is not None:
            return "supplied credential"
        if found := _environment_credential(env):
            return found
        if env.get("IDENTITY_ENDPOINT") or env.get("MSI_ENDPOINT") or self.options.managed_identity:
            return "managed identity"
        if shutil.which("az"):
            return "Azure CLI login"
        if shutil.which("azd"):
            return "Azure Developer CLI login"
        return None

    def _credential(self) -> Any:
        if self._supplied_credential is not None:
            return self._supplied_credential
        from azure.identity import DefaultAzureCredential

        # The SDK's environment decides the rest (AZURE_AUTHORITY_HOST for a sovereign cloud,
        # AZURE_TOKEN_CREDENTIALS, REQUESTS_CA_BUNDLE…).
        if self.options.disable_instance_discovery:
            return DefaultAzureCredential(disable_instance_discovery=True)
        return DefaultAzureCredential()

    def _clients(self) -> tuple[Any, Any]:
        """(ComputeManagementClient, NetworkManagementClient), built on first use."""
        with self._lock:
            if self._sdk is None:
                from azure.mgmt.compute import ComputeManagementClient
                from azure.mgmt.network import NetworkManagementClient

                subscription = self._subscription_id()
                if not subscription:
                    raise AuthError(
                        "azure: no subscription (set AZURE_SUBSCRIPTION_ID or "
                        "subscription_id in settings)",
                        code="NoSubscription",
                    )
                credential = self._credential()
                # Provider.call is the one retry bound, so the SDK's own retries are off.
                kwargs: dict[str, Any] = {"retry_total": 0}
                if self.options.poll_seconds is not None:
                    kwargs["polling_interval"] = self.options.poll_seconds
                base_url = self.options.endpoint
                if base_url:
                    kwargs["base_url"] = base_url
                    split = urlsplit(base_url)
                    if split.scheme == "http" and split.hostname in _LOOPBACK:
                        kwargs["authentication_policy"] = _plain_http_bearer(credential)
                self._sdk = (
                    ComputeManagementClient(credential, subscription, **kwargs),
                    NetworkManagementClient(credential, subscription, **kwargs),
                )
            return self._sdk

    # --- calls: error mapping, retry, long-running operations

    def map_error(self, exc: Exception, what: str) -> ProviderError | None:
        return errors.map_error(exc, what)

    def _wait(self, begin: Callable[..., Any]) -> Any:
        """Start a long-running operation and wait for its end. A throttled poll resumes the same
        operation from its continuation token rather than starting it again."""
        poller = self.call(begin)
        if poller is None:
            return None
        token = poller.continuation_token()
        pollers = [poller]

        def result() -> Any:
            current = pollers.pop() if pollers else begin(continuation_token=token)
            return current.result()

        return self.call(result)

    # --- the contract

    def missing_setup(self) -> str | None:
        if self._credential_source() is None:
            return (
                "azure: no credentials found (set AZURE_CLIENT_ID, AZURE_TENANT_ID and "
                "AZURE_CLIENT_SECRET, run `az login`, or set managed_identity: true on an "
                "Azure VM)"
            )
        if not self._subscription_id():
            return (
                "azure: no subscription (set AZURE_SUBSCRIPTION_ID or subscription_id in settings)"
            )
        return None

    def probe(self) -> str:
        """The first page of the resource group's VMs, given ``timeout_seconds`` (a thread: an
        unreachable ARM endpoint must not hang ``check``)."""
        timeout = self.options.timeout_seconds
        outcome: list[BaseException | None] = []

        def first_page() -> None:
            try:
                compute, _ = self._clients()
                pages = compute.virtual_machines.list(self.resource_group).by_page()
                next(pages, None)
                outcome.append(None)
            except BaseException as err:
                outcome.append(errors.map_error(err) or err)

        worker = threading.Thread(target=first_page, daemon=True)
        worker.start()
        worker.join(timeout)
        if not outcome:
            raise Throttled(f"azure: no answer within {timeout:g}s", code=_NO_ANSWER)
        err = outcome[0]
        if isinstance(err, ProviderError):
            raise err
        if err is not None:
            raise ProviderError(str(err).strip() or type(err).__name__)
        return (
            f"azure: OK, {self._credential_source()} reaches {self._where()}; "
            + self.image_status(self.regions[0])
        )

    def _check_image(self, region: str, image: str) -> None:
        """Once per region and image in this process: a gone image fails the launch before a
        public IP or NIC is made for it."""
        key = (region, image)
        checked: set[tuple[str, str]] = self.__dict__.setdefault("_images_checked", set())
        if key not in checked:
            self.image_status(region, image)
            checked.add(key)

    def image_status(self, region: str, image: str | None = None) -> str:
        """The marketplace image resolved as a launch would (``VirtualMachineImages_List``,
        newest version first, or ``_Get`` of a pinned version), in words. A marketplace image
        that is gone answers 404 NotFound "Artifact: VMImage was not found." (as recorded in
        Get-AzVMImageSku's and the Go SDK tests' answers): a :class:`ConfigurationError`, every
        region of the cloud is out. An image resource id (custom, gallery) is not checked."""
        source = image or self.options.image
        ref = _image_reference(source)
        if "id" in ref:
            return f"image {source} (not checked: an image resource id)"
        compute, _ = self._clients()
        images = compute.virtual_machine_images
        pub, offer, sku, version = ref["publisher"], ref["offer"], ref["sku"], ref["version"]
        gone = ConfigurationError(
            f"azure: marketplace image {source} is not offered in {region} (Artifact: VMImage "
            "was not found): set clouds.azure.image to a current publisher:offer:sku:version",
            code="NoImage",
        )
        try:
            if version == "latest":
                found = self.call(
                    lambda: images.list(region, pub, offer, sku, top=1, orderby="name desc"),
                    f"image {source}",
                )
                if not found:
                    raise gone
                return f"image {source} resolves to version {found[0].name} in {region}"
            self.call(lambda: images.get(region, pub, offer, sku, version), f"image {source}")
        except NotFound:
            raise gone from None
        return f"image {source} exists in {region}"

    def refusal(self, exc: ProviderError) -> str:
        source, where = self._credential_source(), self._where()
        if exc.code == _NO_ANSWER:
            return f"{exc.args[0]} using {source} ({where})"
        if isinstance(exc, NotFound):
            return (
                f"azure: {source} works but resource group {self.resource_group} was not found "
                f"in subscription {self._subscription_id()} (create it, with a VNet and subnet "
                "per region)"
            )
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, AuthError):
            return f"azure: {source} refused: {first_line}"
        return f"azure: {first_line} ({where})"

    def _where(self) -> str:
        return f"subscription {self._subscription_id()}, resource group {self.resource_group}"

    def launch(self, request: LaunchRequest) -> Instance:
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceExistsError

        compute, network = self._clients()
        rg, name = self.resource_group, request.name
        vm_body = self._vm_body(request)  # validates before anything is created
        self._check_image(request.region, request.image or self.options.image)
        create_ip = partial(
            network.public_ip_addresses.begin_create_or_update,
            rg,
            ip_name(name),
            self._network.ip_body(request),
        )

        def begin_create(**kwargs: Any) -> Any:
            # PUT by name is Azure's idempotency; IfMissing (If-None-Match: *) makes it create-only.
            try:
                return compute.virtual_machines.begin_create_or_update(
                    rg, name, vm_body, match_condition=MatchConditions.IfMissing, **kwargs
                )
            except ResourceExistsError as err:
                if err.status_code == 412:
                    return None
                raise

        foreign = False
        try:
            group = self._network.ssh_group(request.region)
            for _ in range(2):
                # A public IP (Standard, static) on the NIC: without one nobody can reach the VM,
                # and on a subnet without default outbound access it cannot reach the internet.
                # Inside the loop: clearing a failed attempt below deletes it with the NIC.
                public_ip = self._wait(create_ip)
                nic_body = self._network.nic_body(request, public_ip.id, group)
                nic = self._wait(
                    partial(
                        network.network_interfaces.begin_create_or_update,
                        rg,
                        nic_name(name),
                        nic_body,
                    )
                )
                vm = self._wait(begin_create)
                if vm is not None:
                    break
                vm = self.call(lambda: compute.virtual_machines.get(rg, name))
                foreign = (vm.tags or {}).get(TAG_MACHINE) != request.labels.get(TAG_MACHINE)
                if foreign or vm.provisioning_state != "Failed":
                    break  # someone else's VM, or the earlier attempt of this same intent
                self._remove_vm(name)  # a failed earlier attempt: clear it and create again
        except (AuthError, CapacityError, QuotaError, InvalidRequest, NotFound) as err:
            self._cleanup_failed(request)
            if isinstance(err, NotFound):  # e.g. the resource group or VNet is missing
                raise InvalidRequest(str(err), code=err.code) from err
            raise
        if foreign:
            for begin in (  # our NIC and public IP, unless that VM uses them
                partial(network.network_interfaces.begin_delete, rg, nic_name(name)),
                partial(network.public_ip_addresses.begin_delete, rg, ip_name(name)),
            ):
                with contextlib.suppress(ProviderError):
                    self._wait(begin)
            raise InvalidRequest(
                f"azure: a VM named {name} already exists in {rg} and is not this machine",
                code="Conflict",
            )
        view = self.call(lambda: compute.virtual_machines.instance_view(rg, name))
        private_ip = nic.ip_configurations[0].private_ip_address if nic.ip_configurations else None
        return to_instance(self, vm, view.statuses, private_ip, public_ip.ip_address)

    def get(self, ref: InstanceRef) -> Instance:
        compute, network = self._clients()
        rg, name = self._locate(ref)
        vm = self.call(lambda: compute.virtual_machines.get(rg, name, expand="instanceView"))
        private_ip = public_ip = None
        try:
            nic = self.call(lambda: network.network_interfaces.get(rg, nic_name(name)))
            config = nic.ip_configurations[0]
            private_ip = config.private_ip_address
            ip_id = config.public_ip_address.id if config.public_ip_address else None
            if ip_id:  # the address is held by the public IP resource, not the NIC
                ip_rg, ip_name = _network_name(ip_id)
                ip = self.call(lambda: network.public_ip_addresses.get(ip_rg or rg, ip_name))
                public_ip = ip.ip_address
        except (NotFound, IndexError, TypeError):
            pass  # no NIC (or public IP) any more: the VM's own state still answers
        statuses = vm.instance_view.statuses if vm.instance_view else []
        return to_instance(self, vm, statuses, private_ip, public_ip)

    def list_managed(
        self, regions: Sequence[str] | None = None, machine_id: str | None = None
    ) -> list[Instance]:
        compute, network = self._clients()
        rg, wanted = self.resource_group, set(regions or self.regions)
        try:
            # ARM cannot filter VMs by tag: list the resource group (all pages), filter here.
            vms = self.call(lambda: list(compute.virtual_machines.list(rg)))
        except NotFound:
            return []
        addresses: dict[str, str | None] | None = None
        found = []
        for vm in vms:
            if not _listed(vm, wanted, machine_id):
                continue
            try:
                view = self.call(partial(compute.virtual_machines.instance_view, rg, vm.name))
            except NotFound:
                continue  # deleted while we listed
            if addresses is None:  # one listing of the group's public IPs serves every VM
                ips = self.call(lambda: list(network.public_ip_addresses.list(rg)))
                addresses = {(ip.name or "").lower(): ip.ip_address for ip in ips}
            public_ip = addresses.get(ip_name(vm.name).lower())
            found.append(to_instance(self, vm, view.statuses, public_ip=public_ip))
        return found

    def stop(self, ref: InstanceRef) -> None:
        # Deallocate: a mere power-off keeps the compute allocated and billed.
        compute, _ = self._clients()
        self._wait(partial(compute.virtual_machines.begin_deallocate, *self._locate(ref)))

    def start(self, ref: InstanceRef) -> None:
        compute, _ = self._clients()
        self._wait(partial(compute.virtual_machines.begin_start, *self._locate(ref)))

    def terminate(self, ref: InstanceRef) -> None:
        self._remove_vm(self._locate(ref)[1])

    def unused_network(self, *, remove: bool = False) -> list[str]:
        return self._network.unused(remove)

    def fetch_offers(self) -> list[Offer]:
        return prices.fetch_offers(self.regions, self.options)

    # --- helpers

    def _locate(self, ref: InstanceRef) -> tuple[str, str]:
        m = _VM_ID.search(ref.id)
        return (m[1], m[2]) if m else (self.resource_group, ref.name or ref.id)

    def _remove_vm(self, name: str) -> None:
        """Delete the VM, then its NIC, public IP and OS disk. They carry deleteOption=Delete and
        normally go with it; deleting them by name catches leftovers (a launch refused before the
        VM existed, or a public IP the cascade left: Azure/azure-rest-api-specs#25475). The NIC
        goes before the public IP, which cannot be deleted while a NIC holds it. Each step is a
        no-op when gone."""
        compute, network = self._clients()
        rg = self.resource_group
        for begin in (
            partial(compute.virtual_machines.begin_delete, rg, name),
            partial(network.network_interfaces.begin_delete, rg, nic_name(name)),
            partial(network.public_ip_addresses.begin_delete, rg, ip_name(name)),
            partial(compute.disks.begin_delete, rg, _disk_name(name)),
        ):
            with contextlib.suppress(NotFound):
                self._wait(begin)

    def _cleanup_failed(self, request: LaunchRequest) -> None:
        """After a refused create, remove what this attempt left (a Failed VM, the NIC), so the
        next candidate can reuse the name. Best effort: the original error is what matters."""
        compute, _ = self._clients()
        rg, name = self.resource_group, request.name
        with contextlib.suppress(ProviderError):
            try:
                vm = self.call(lambda: compute.virtual_machines.get(rg, name))
                if (vm.tags or {}).get(TAG_MACHINE) != request.labels.get(TAG_MACHINE):
                    return  # not ours: never delete it
            except NotFound:
                pass
            self._remove_vm(name)

    def _vm_body(self, request: LaunchRequest) -> Any:
        from azure.mgmt.compute import models

        if not request.ssh_public_key:
            raise InvalidRequest(
                "azure: an SSH public key is required (Linux VMs are created without a password)",
                code="MissingSshKey",
            )
        admin = self.options.admin_username
        image = _image_reference(request.image or self.options.image)
        zone = request.zone.removeprefix(f"{request.region}-")
        market: dict[str, Any] = {"priority": "Regular"}
        if request.spot:
            market = {
                "priority": "Spot",
                "eviction_policy": "Deallocate"
                if request.preemption_action == "stop"
                else "Delete",
                # -1: pay up to the pay-as-you-go price, evicted only for capacity.
                "billing_profile": models.BillingProfile(
                    max_price=float(request.max_price) if request.max_price is not None else -1
                ),
            }
        os_profile = models.OSProfile(
            computer_name=request.name,
            admin_username=admin,
            linux_configuration=models.LinuxConfiguration(
                disable_password_authentication=True,
                ssh=models.SshConfiguration(
                    public_keys=[
                        models.SshPublicKey(
                            path=f"/home/{admin}/.ssh/authorized_keys",
                            key_data=request.ssh_public_key,
                        )
                    ]
                ),
            ),
        )
        # gzip-compressed (providers/azure LIMITS: 65,535 bytes decoded); the key is above
        custom = startup_payload(LIMITS, request.user_data, None, admin)
        if isinstance(custom, bytes):
            os_profile.custom_data = base64.b64encode(custom).decode()
        # Flattened keywords as in network.nic_body: accepted at run time by every supported
        # azure-mgmt-compute, missing from the newer SDK's overloads (only ``properties=``).
        return models.VirtualMachine(  # type: ignore[call-overload]
            location=request.region,
            zones=[zone] if zone else None,
            tags=arm_tags(request.labels),
            hardware_profile=models.HardwareProfile(vm_size=request.instance_type),
            storage_profile=models.StorageProfile(
                image_reference=models.ImageReference(**image),
                os_disk=models.OSDisk(
                    name=_disk_name(request.name),
                    create_option="FromImage",
                    disk_size_gb=request.disk_gb,
                    delete_option="Delete",
                    managed_disk=models.ManagedDiskParameters(
                        storage_account_type=self.options.os_disk_type
                    ),
                ),
            ),
            os_profile=os_profile,
            network_profile=models.NetworkProfile(
                network_interfaces=[
                    models.NetworkInterfaceReference(  # type: ignore[call-overload]
                        id=self._network.nic_id(request.name), primary=True, delete_option="Delete"
                    )
                ]
            ),
            **market,
        )


def _network_name(resource_id: str) -> tuple[str | None, str]:
    """(resource group, name) of a Microsoft.Network resource id."""
    m = re.search(r"/resourceGroups/([^/]+)/providers/[^/]+/[^/]+/([^/]+)$", resource_id, re.I)
    return (m[1], m[2]) if m else (None, resource_id.rsplit("/", 1)[-1])


def _disk_name(vm_name: str) -> str:
    return f"{vm_name}-osdisk"


def _image_reference(image: str) -> dict[str, str]:
    if image.startswith("/subscriptions/"):  # a custom or gallery image
        return {"id": image}
    parts = image.split(":")
    if len(parts) != 4 or not all(parts):
        raise InvalidRequest(
            f"azure: image {image!r} is not publisher:offer:sku:version or an image resource id",
            code="InvalidImage",
        )
    return dict(zip(("publisher", "offer", "sku", "version"), parts, strict=True))


def _plain_http_bearer(credential: Any) -> Any:
    """A bearer-token policy that also sends the token over plain http. Used only for a
    loopback ``base_url`` (a local ARM emulator); azure-core refuses non-TLS URLs otherwise."""
    from azure.mgmt.core.policies import ARMChallengeAuthenticationPolicy

    class PlainHttpBearer(ARMChallengeAuthenticationPolicy):
        def on_request(self, request: Any) -> None:
            request.context["enforce_https"] = False
            super().on_request(request)

    return PlainHttpBearer(credential, ARM_SCOPE)


def _listed(vm: Any, regions: set[str], machine_id: str | None) -> bool:
    """A VM of ours in one of ``regions`` (and of that machine, when one is given)."""
    tags = vm.tags or {}
    if tags.get(TAG_MANAGED_BY) != TAG_MANAGED_BY_VALUE or vm.location not in regions:
        return False
    return machine_id is None or tags.get(TAG_MACHINE) == machine_id


def _environment_credential(env: Mapping[str, str]) -> str | None:
    """The credential the AZURE_* environment variables name, if they name one."""
    if not (env.get("AZURE_CLIENT_ID") and env.get("AZURE_TENANT_ID")):
        return None
    if env.get("AZURE_CLIENT_SECRET") or env.get("AZURE_CLIENT_CERTIFICATE_PATH"):
        return "service principal (environment)"
    if env.get("AZURE_FEDERATED_TOKEN_FILE"):
        return "workload identity"
    return None
