"""A local Azure Resource Manager for the unmodified azure-mgmt-compute / azure-mgmt-network SDKs.

Speaks ARM's wire protocol on 127.0.0.1 (plain http, or TLS with a test certificate; ephemeral
port): virtual machines (PUT with
``If-None-Match: *``, GET, DELETE, list with ``nextLink`` paging, instanceView, deallocate, start,
powerOff, simulateEviction), network interfaces, public IP addresses, network security groups,
managed disks, long-running operations through
``Azure-AsyncOperation`` + ``Location`` headers (absolute loopback URLs, ``Retry-After: 0``), the
Activity Log (``Microsoft.Insights/eventtypes/management/values``) and the public Retail Prices API
(``/api/retail/prices``, served from fixture rows), and the two Microsoft identity platform
endpoints a service principal's sign-in uses (OpenID configuration, client-credentials token), so
azure-identity's own EnvironmentCredential can sign in with ``AZURE_AUTHORITY_HOST`` set to it.

Request bodies are checked against the SDK's own models (unknown or read-only properties, wrong
types, missing required fields, unknown enum values) plus the ARM rules the adapter relies on, so a
malformed request fails with 400 as ARM would. Faults are injected through the control methods;
every request is recorded in :attr:`AzureEmulator.requests`.
"""

from __future__ import annotations

import base64
import copy
import enum
import functools
import ipaddress
import itertools
import json
import re
import ssl
import tempfile
import threading
import types
import typing
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

SUBSCRIPTION = "00000000-0000-0000-0000-00000000a2e0"
TOKEN = "emulator-token"
TENANT = "00000000-0000-0000-0000-0000000e7a17"
CLIENT_ID = "00000000-0000-0000-0000-0000000c11e7"
CLIENT_SECRET = "emulator-client-secret"  # a test fixture, never a real secret
ARM_DEFAULT_SCOPE = "https://management.azure.com/.default"
API_VERSION_ACTIVITY = "2015-04-01"

_ARM = re.compile(r"^/subscriptions/(?P<sub>[^/]+)(?P<rest>/.*)?$", re.I)
_RG = re.compile(
    r"^/resourcegroups/(?P<rg>[^/]+)/providers/(?P<ns>[^/]+)/(?P<type>[^/]+)(?P<rest>/.*)?$", re.I
)
_OPERATION = re.compile(
    r"^/providers/(?P<ns>[^/]+)/locations/(?P<loc>[^/]+)/operations/(?P<op>[^/]+)$", re.I
)
_VM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}[A-Za-z0-9_]$")
_SUBNET_ID = re.compile(
    r"^/subscriptions/[^/]+/resourceGroups/[^/]+/providers/Microsoft\.Network/virtualNetworks/"
    r"[^/]+/subnets/[^/]+$",
    re.I,
)
# Enums whose SDK list is frozen while ARM keeps adding values (new VM sizes).
_OPEN_ENUMS = {"VirtualMachineSizeTypes"}
_VM_IMAGES = re.compile(
    r"^/providers/microsoft\.compute/locations/(?P<loc>[^/]+)/publishers/(?P<pub>[^/]+)"
    r"/artifacttypes/vmimage/offers/(?P<offer>[^/]+)/skus/(?P<sku>[^/]+)/versions"
    r"(?:/(?P<version>[^/]+))?$",
    re.I,
)
_FILTER_CLAUSE = re.compile(r"^\s*(\w+)\s+(eq|ge|le)\s+'([^']*)'\s*$")
_OPENID = re.compile(r"^/(?P<tenant>[^/]+)/v2\.0/\.well-known/openid-configuration$")
_TOKEN = re.compile(r"^/(?P<tenant>[^/]+)/oauth2/v2\.0/token$")


class IdentityError(Exception):
    """Becomes a Microsoft identity platform error ``{"error", "error_description"}``."""

    def __init__(self, status: int, error: str, description: str) -> None:
        super().__init__(description)
        self.status, self.error, self.description = status, error, description


class ArmError(Exception):
    """Becomes an ARM error response ``{"error": {"code", "message"}}``."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-cased names
    body: Any


@dataclass
class _Operation:
    polls_left: int
    complete: Callable[[], dict | None]  # returns an ARM error dict on failure
    status: str = "InProgress"
    error: dict | None = None

    def poll(self) -> str:
        if self.status == "InProgress":
            if self.polls_left > 0:
                self.polls_left -= 1
            else:
                self.error = self.complete()
                self.status = "Failed" if self.error else "Succeeded"
        return self.status


@dataclass
class _Fault:
    code: str
    message: str
    status: int = 409
    region: str | None = None
    zone: str | None = None  # None: the whole region
    synchronous: bool = False  # on the PUT itself, else in the operation
    remaining: int | None = None  # None: until cleared

    def matches(self, region: str, zone: str) -> bool:
        if self.remaining is not None and self.remaining <= 0:
            return False
        if self.region is not None and self.region != region:
            return False
        return self.zone is None or self.zone == zone


@dataclass
class _Throttle:
    remaining: int
    method: str | None
    path_contains: str | None
    retry_after: int


@dataclass
class _Vm:
    body: dict  # the ARM resource as GET returns it
    power: str  # PowerState/<power>
    # when the last user-initiated operation (create, deallocate, powerOff, start) completed:
    # the instance view's ProvisioningState/succeeded status carries it as "time"
    # (MicrosoftDocs/azure-docs, includes/virtual-machines-common-states-and-lifecycle.md:
    # "Succeeded – the user-initiated actions have completed", with "time"; a deallocate "is
    # considered an update"). An eviction is not user-initiated: it leaves the time alone.
    provisioned: str | None = None


# --- strict body checks against the SDK's models -------------------------------------------


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    cls()  # the SDK computes the rest-field table on first construction
    module = __import__(cls.__module__, fromlist=["_"])
    package = __import__(cls.__module__.rsplit(".", 1)[0], fromlist=["_"])
    return typing.get_type_hints(cls, vars(module), {"_models": package})


def check_model(cls: type, data: Any, where: str = "") -> None:
    """Raise ArmError(400) when ``data`` is not a valid create body for SDK model ``cls``."""
    if not isinstance(data, dict):
        raise _bad(f"{where or 'body'}: expected an object")
    hints = _hints(cls)
    fields = {rf._rest_name: (attr, rf) for attr, rf in cls._attr_to_rest_field.items()}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in fields:
            raise _bad(
                f"Could not find member '{key}' on object of type '{cls.__name__}'. Path '{path}'."
            )
        attr, rf = fields[key]
        if rf._visibility == ["read"]:
            raise _bad(f"'{path}' is read-only and cannot be set")
        _check_value(hints[attr], value, path)
    for attr, annotation in hints.items():
        rf = cls._attr_to_rest_field.get(attr)
        if rf is None or rf._visibility == ["read"] or _optional(annotation):
            continue
        if rf._rest_name not in data:
            raise _bad(
                f"Required property '{where + '.' if where else ''}{rf._rest_name}' is missing"
            )


def _optional(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def _check_value(annotation: Any, value: Any, path: str) -> None:
    if value is None:
        return
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        enums = [
            a
            for a in options
            if isinstance(a, type) and issubclass(a, enum.Enum) and a.__name__ not in _OPEN_ENUMS
        ]
        if enums:
            allowed = {m.value.lower() for e in enums for m in e}
            if not isinstance(value, str) or value.lower() not in allowed:
                raise _bad(f"'{path}': '{value}' is not one of {sorted(allowed)}")
            return
        if len(options) == 1:
            return _check_value(options[0], value, path)
        return
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _check_value(str | annotation, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise _bad(f"'{path}': expected an array")
        for i, item in enumerate(value):
            _check_value(args[0], item, f"{path}[{i}]")
        return
    if origin is dict:
        if not isinstance(value, dict):
            raise _bad(f"'{path}': expected an object")
        for k, item in value.items():
            _check_value(args[1], item, f"{path}.{k}")
        return
    if isinstance(annotation, type) and hasattr(annotation, "_attr_to_rest_field"):
        return check_model(annotation, value, path)
    expected = {str: str, bool: bool, int: int, float: (int, float)}.get(annotation)
    if expected is None:
        return
    if (isinstance(value, bool) and annotation is not bool) or not isinstance(value, expected):
        raise _bad(f"'{path}': expected {annotation.__name__}, got {type(value).__name__}")


def _bad(message: str, code: str = "InvalidParameter") -> ArmError:
    return ArmError(400, code, message)


# --- the emulator ---------------------------------------------------------------------------


class AzureEmulator:
    """One subscription, its resource groups, VMs, NICs and disks, in memory."""

    def __init__(
        self,
        *,
        resource_groups: Iterable[str] = ("provisioner",),
        page_size: int = 2,
        prices: Iterable[dict] = (),
        prices_page_size: int = 3,
        tls: tuple[bytes, bytes] | None = None,
    ) -> None:
        """``tls``: (certificate PEM, key PEM) to serve https, as ARM and the identity platform
        do (azure-identity accepts only an https authority)."""
        self.subscription_id = SUBSCRIPTION
        self.tenant_id = TENANT
        self.service_principals = {CLIENT_ID: CLIENT_SECRET}  # client id -> its secret
        self._tls = tls
        self.token = TOKEN
        self.page_size = page_size
        self.cost_records: list[dict] = []  # Cost Management's (tests/emulators/azure_cost.py)
        # marketplace images (publisher, offer, sku) -> versions, in every location: the
        # adapter's default, the Data Science VM team's Ubuntu 22.04 HPC image
        self.marketplace: dict[tuple[str, str, str], list[str]] = {
            ("microsoft-dsvm", "ubuntu-hpc", "2204"): ["22.04.2025090801", "22.04.2025111401"]
        }
        self.prices_page_size = prices_page_size
        self.prices: list[dict] = list(prices)
        self.resource_groups = {rg.lower() for rg in resource_groups}
        self.requests: list[Recorded] = []
        self.vms: dict[str, _Vm] = {}  # lower-cased resource id -> VM
        self.nics: dict[str, dict] = {}
        self.disks: dict[str, dict] = {}  # lower-cased resource id -> managed disk
        # one page of a disks listing; page_size pages VMs and network resources
        self.disk_page_size = 100
        # Public IPs and NSGs are billed / kept until deleted: whatever a test leaves here leaked.
        self.public_ips: dict[str, dict] = {}
        self.nsgs: dict[str, dict] = {}
        self.activity: list[dict] = []
        self._ops: dict[str, _Operation] = {}
        self._faults: list[_Fault] = []
        self._throttles: list[_Throttle] = []
        self._losses: list[_Throttle] = []
        self._slow_polls = 0
        self._ip = itertools.count(4)
        self._address = itertools.count(10)
        # Test infra, not ARM: every public IP address resource's address this emulator
        # assigns ("The IP address associated with the public IP address resource",
        # azure-mgmt-network PublicIPAddress.ip_address) is this one, e.g. 127.0.0.1 where a
        # test's sshd listens; None: its own 20.0.0.x addresses.
        self.public_address: str | None = None
        # A server's clock is the time of day, as ARM's is: a fixed date here would fall out
        # of the adapter's 90-day activity-log window as the calendar moves on (it did, at a
        # faked 2028-02-29). Strictly increasing from there (see _now).
        self._clock = datetime.now(UTC).replace(microsecond=0)
        self._lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None

    # --- lifecycle

    def start(self) -> AzureEmulator:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        if self._tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            with tempfile.TemporaryDirectory() as folder:  # load_cert_chain reads files only
                cert, key = Path(folder, "cert.pem"), Path(folder, "key.pem")
                cert.write_bytes(self._tls[0])
                key.write_bytes(self._tls[1])
                context.load_cert_chain(cert, key)
            # the handshake happens in the request's own thread, not in the accept loop
            self._server.socket = context.wrap_socket(
                self._server.socket, server_side=True, do_handshake_on_connect=False
            )
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> AzureEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        assert self._server, "start() first"
        scheme = "https" if self._tls else "http"
        return f"{scheme}://127.0.0.1:{self._server.server_address[1]}"

    # --- control surface for tests

    def fail_capacity(
        self,
        region: str,
        zone: str | None = None,
        *,
        code: str = "ZonalAllocationFailed",
        synchronous: bool = False,
        times: int | None = None,
    ) -> None:
        """Creates/starts in ``region`` (one ``zone``, or all) fail with ``code``: in the
        long-running operation (AllocationFailed, ZonalAllocationFailed) or, ``synchronous``, on
        the PUT itself (SkuNotAvailable)."""
        messages = {
            "SkuNotAvailable": "The requested VM size for resource 'Following SKUs have failed for "
            f"Capacity Restrictions' is currently not available in location '{region}'.",
            "OverconstrainedAllocationRequest": "Allocation failed. VM(s) with the following "
            "constraints cannot be allocated, because the condition is too restrictive.",
        }
        message = messages.get(
            code,
            "Allocation failed. We do not have sufficient capacity for "
            "the requested VM size in this zone. Read more about improving "
            "likelihood of allocation success at http://aka.ms/allocation-guidance",
        )
        with self._lock:
            self._faults.append(_Fault(code, message, 409, region, zone, synchronous, times))

    def fail_quota(
        self, region: str, *, family: str = "standardNCADSA100v4Family", spot: bool = False
    ) -> None:
        """Creates in ``region`` are refused on the PUT for exceeding a vCPU quota."""
        quota = "LowPriorityCores" if spot else f"{family} Cores"
        message = (
            f"Operation could not be completed as it results in exceeding approved {quota} "
            f"quota. Additional details - Deployment Model: Resource Manager, Location: "
            f"{region}, Current Limit: 0, Current Usage: 0, Additional Required: 24, "
            "(Minimum) New Limit Required: 24."
        )
        with self._lock:
            self._faults.append(_Fault("OperationNotAllowed", message, 409, region, None, True))

    def fail_next_create(self, code: str, message: str, *, status: int = 400) -> None:
        """The next VM PUT fails synchronously with this ARM error."""
        with self._lock:
            self._faults.append(_Fault(code, message, status, synchronous=True, remaining=1))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()
            self._throttles.clear()
            self._losses.clear()

    def throttle(
        self,
        count: int,
        *,
        method: str | None = None,
        path_contains: str | None = None,
        retry_after: int = 0,
    ) -> None:
        """The next ``count`` matching ARM requests get 429 TooManyRequests."""
        with self._lock:
            self._throttles.append(_Throttle(count, method, path_contains, retry_after))

    def lose_responses(
        self, count: int, *, method: str | None = None, path_contains: str | None = None
    ) -> None:
        """The next ``count`` matching ARM requests are carried out, then the connection is
        closed without an answer (a response lost on the way back)."""
        with self._lock:
            self._losses.append(_Throttle(count, method, path_contains, 0))

    def take_loss(self, method: str, path: str) -> bool:
        with self._lock:
            for loss in self._losses:
                if (
                    loss.remaining > 0
                    and loss.method in (None, method)
                    and (loss.path_contains is None or loss.path_contains.lower() in path.lower())
                ):
                    loss.remaining -= 1
                    return True
            return False

    def console_stop(self, name: str, resource_group: str = "provisioner") -> None:
        """A person deallocates the VM in the portal: deallocated, with the user's
        ``deallocate/action`` event in the Activity Log."""
        with self._lock:
            vm = self._get_vm(resource_group, name)
            vm.power = "deallocated"
            self._event(vm.body["id"], "Microsoft.Compute/virtualMachines/deallocate/action")

    def guest_shutdown(self, name: str, resource_group: str = "provisioner") -> None:
        """The VM's OS shuts itself down: PowerState/stopped, still allocated, and billed until
        it is deallocated through the API (learn.microsoft.com/azure/virtual-machines/
        states-billing, power states: "Stopped" is the VM shut down from within the guest OS or
        by the PowerOff API, its hardware still allocated and billed; only "Deallocated" stops
        compute billing — see :meth:`billed_vms`). No ARM operation made it: no Activity Log
        event, and the instance view's ProvisioningState time (the last user-initiated
        operation's) is left as it was."""
        with self._lock:
            self._get_vm(resource_group, name).power = "stopped"

    def console_delete(self, name: str, resource_group: str = "provisioner") -> None:
        """Someone deletes the VM outside provisioner (its NIC and disk go with it per their
        deleteOption): GET answers 404."""
        with self._lock:
            vm = self._get_vm(resource_group, name)
            self._delete_vm(vm)
            self._event(vm.body["id"], "Microsoft.Compute/virtualMachines/delete")

    def slow_operations(self, polls: int) -> None:
        """Long-running operations started from now report InProgress for ``polls`` polls."""
        self._slow_polls = polls

    def add_vm(
        self,
        name: str,
        *,
        location: str = "eastus",
        tags: dict[str, str] | None = None,
        resource_group: str = "provisioner",
        vm_size: str = "Standard_NC4as_T4_v3",
        priority: str = "Regular",
    ) -> str:
        """Create a running VM directly (as another tool or a person would). Returns its id."""
        vm_id = self._vm_id(resource_group, name)
        body = {
            "id": vm_id,
            "name": name,
            "type": "Microsoft.Compute/virtualMachines",
            "location": location,
            "tags": dict(tags or {}),
            "properties": {
                "hardwareProfile": {"vmSize": vm_size},
                "priority": priority,
                "provisioningState": "Succeeded",
                "vmId": str(uuid.uuid4()),
                "timeCreated": self._now(),
            },
        }
        with self._lock:
            self.vms[vm_id.lower()] = _Vm(body, "running")
        return vm_id

    def evict(self, name: str, resource_group: str = "provisioner") -> None:
        """Azure takes a Spot VM back: deallocated or deleted per its evictionPolicy, with the
        ``evictSpotVM`` Activity Log event ARM records for it."""
        with self._lock:
            vm = self._get_vm(resource_group, name)
            props = vm.body["properties"]
            assert props.get("priority") == "Spot", "only Spot VMs are evicted"
            self._event(vm.body["id"], "Microsoft.Compute/virtualMachines/evictSpotVM/action")
            if props.get("evictionPolicy", "Deallocate") == "Delete":
                self._delete_vm(vm)
            else:
                vm.power = "deallocated"

    def billed_vms(self) -> list[str]:
        """VMs whose compute bills: all but the deallocated. "Stopped" (powered off from the OS
        or by powerOff) keeps its hardware allocated and is billed; only "Deallocated" is not
        (learn.microsoft.com/azure/virtual-machines/states-billing, power states table)."""
        with self._lock:
            return [vm.body["name"] for vm in self.vms.values() if vm.power != "deallocated"]

    def power_state(self, name: str, resource_group: str = "provisioner") -> str:
        with self._lock:
            return self._get_vm(resource_group, name).power

    def vm(self, name: str, resource_group: str = "provisioner") -> dict:
        with self._lock:
            return json.loads(json.dumps(self._get_vm(resource_group, name).body))

    def public_ip_of(self, name: str, resource_group: str = "provisioner") -> str | None:
        """The public address on the VM's primary NIC, as the public IP resource holds it."""
        with self._lock:
            pip = self._vm_public_ip(self._get_vm(resource_group, name))
            return pip["properties"].get("ipAddress") if pip else None

    def reachable(
        self,
        name: str,
        port: int = 22,
        *,
        source: str = "203.0.113.7",
        resource_group: str = "provisioner",
    ) -> bool:
        """Can ``source`` (an internet address) open TCP ``port`` on the running VM?

        Only through a public IP on its NIC. A Standard-SKU public IP is "secure by default and
        closed to inbound traffic" until an NSG allows it; a Basic one is open without an NSG
        (learn.microsoft.com/azure/virtual-network/ip-services/public-ip-addresses, SKU table).
        NSG rules are evaluated by priority, lowest number first, the first match deciding;
        service tag ``Internet`` is any address outside the VNet (network-security-groups-
        overview). The subnet's own NSG is not modelled (the adapter does not set one)."""
        with self._lock:
            vm = self._get_vm(resource_group, name)
            if vm.power != "running":
                return False
            pip = self._vm_public_ip(vm)
            if pip is None or not pip["properties"].get("ipAddress"):
                return False
            nic = self._primary_nic(vm)
            nsg_id = ((nic or {}).get("properties", {}).get("networkSecurityGroup") or {}).get(
                "id", ""
            )
            nsg = self.nsgs.get(nsg_id.lower())
            if nsg is None:
                return not pip.get("sku", {}).get("name", "Basic").lower().startswith("standard")
            rules = nsg["properties"]["securityRules"] + nsg["properties"]["defaultSecurityRules"]
            inbound = [r["properties"] for r in rules if r["properties"]["direction"] == "Inbound"]
            for rule in sorted(inbound, key=lambda r: r["priority"]):
                if _rule_matches(rule, source, port):
                    return rule["access"] == "Allow"
            return False

    def outbound_internet(self, name: str, resource_group: str = "provisioner") -> bool:
        """Can the VM reach the internet? Only through a public IP here: subnets created on
        recent API versions have no default outbound access, and no NAT gateway is modelled
        (learn.microsoft.com/azure/virtual-network/ip-services/default-outbound-access)."""
        with self._lock:
            pip = self._vm_public_ip(self._get_vm(resource_group, name))
            return bool(pip and pip["properties"].get("ipAddress"))

    def _primary_nic(self, vm: _Vm) -> dict | None:
        refs = vm.body["properties"].get("networkProfile", {}).get("networkInterfaces", [])
        ref = next((r for r in refs if r.get("properties", {}).get("primary")), None)
        ref = ref or (refs[0] if refs else None)
        return self.nics.get(ref["id"].lower()) if ref else None

    def _vm_public_ip(self, vm: _Vm) -> dict | None:
        nic = self._primary_nic(vm)
        for config in (nic or {}).get("properties", {}).get("ipConfigurations", []):
            pip_id = ((config.get("properties") or {}).get("publicIPAddress") or {}).get("id")
            if pip_id and pip_id.lower() in self.public_ips:
                return self.public_ips[pip_id.lower()]
        return None

    def requests_to(self, method: str, path_contains: str) -> list[Recorded]:
        return [
            r
            for r in self.requests
            if r.method == method and path_contains.lower() in r.path.lower()
        ]

    # --- helpers

    def _now(self) -> str:
        self._clock += timedelta(seconds=1)  # strictly increasing event times
        return self._clock.isoformat().replace("+00:00", "Z")

    def _vm_id(self, rg: str, name: str) -> str:
        return (
            f"/subscriptions/{self.subscription_id}/resourceGroups/{rg}"
            f"/providers/Microsoft.Compute/virtualMachines/{name}"
        )

    def _get_vm(self, rg: str, name: str) -> _Vm:
        vm = self.vms.get(self._vm_id(rg, name).lower())
        if vm is None:
            raise ArmError(
                404,
                "ResourceNotFound",
                f"The Resource 'Microsoft.Compute/"
                f"virtualMachines/{name}' under resource group '{rg}' was not found.",
            )
        return vm

    def _event(self, resource_id: str, operation: str) -> str:
        """Log an Activity Log event; returns its time."""
        at = self._now()
        self.activity.append(
            {
                "eventTimestamp": at,
                "operationName": {"value": operation, "localizedValue": operation.split("/")[-2]},
                "status": {"value": "Succeeded", "localizedValue": "Succeeded"},
                "resourceId": resource_id,
                "level": "Informational",
                "caller": "Azure" if "evict" in operation.lower() else "user@example.com",
            }
        )
        return at

    def _operation(
        self,
        ns: str,
        location: str,
        complete: Callable[[], dict | None],
    ) -> dict[str, str]:
        op_id = str(uuid.uuid4())
        self._ops[op_id] = _Operation(self._slow_polls, complete)
        url = (
            f"{self.base_url}/subscriptions/{self.subscription_id}/providers/{ns}/locations/"
            f"{location}/operations/{op_id}?api-version=2026-04-01"
        )
        return {"Azure-AsyncOperation": url, "Location": url + "&monitor=true", "Retry-After": "0"}

    def _delete_vm(self, vm: _Vm) -> None:
        props = vm.body["properties"]
        self.vms.pop(vm.body["id"].lower(), None)
        for ref in props.get("networkProfile", {}).get("networkInterfaces", []):
            nic = self.nics.get(ref["id"].lower())
            if nic is None:
                continue
            nic["properties"].pop("virtualMachine", None)
            if ref.get("properties", {}).get("deleteOption") == "Delete":
                self._remove_nic(nic, vm_deleted=True)
        storage = props.get("storageProfile", {})
        for disk_ref in [storage.get("osDisk", {}), *storage.get("dataDisks", [])]:
            disk_id = disk_ref.get("managedDisk", {}).get("id", "").lower()
            if disk_id in self.disks:
                self._set_attached(self.disks[disk_id], None)
                # deleteOption Delete goes with the VM; Detach (a data disk's default) stays
                if disk_ref.get("deleteOption") == "Delete":
                    self.disks.pop(disk_id)

    def _fault(self, region: str, zone: str, *, synchronous: bool) -> _Fault | None:
        for fault in self._faults:
            if fault.synchronous == synchronous and fault.matches(region, zone):
                if fault.remaining is not None:
                    fault.remaining -= 1
                return fault
        return None

    # --- request handling

    def handle(
        self,
        method: str,
        raw_path: str,
        headers: dict[str, str],
        raw: bytes,
    ) -> tuple[int, dict[str, str], Any]:
        split = urlsplit(raw_path)
        path, query = split.path, dict(parse_qsl(split.query, keep_blank_values=True))
        if _OPENID.match(path) or _TOKEN.match(path):
            form = dict(parse_qsl(raw.decode(), keep_blank_values=True))
            with self._lock:
                # the form carries the client secret: it is recorded without it
                kept = {k: v for k, v in form.items() if k != "client_secret"}
                self.requests.append(Recorded(method, path, query, headers, kept))
                return self._identity(method, path, form)
        body = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                raise _bad(
                    "The request content was invalid and could not be deserialized.",
                    "InvalidRequestContent",
                ) from None
        with self._lock:
            self.requests.append(Recorded(method, path, query, headers, copy.deepcopy(body)))
            status, extra, result = self._serve(method, path, query, headers, body)
            return status, extra, copy.deepcopy(result)  # a snapshot, serialised after unlock

    def _serve(
        self,
        method: str,
        path: str,
        query: dict,
        headers: dict,
        body: Any,
    ) -> tuple[int, dict[str, str], Any]:
        if path == "/api/retail/prices":
            return self._prices(query)
        if headers.get("authorization") != f"Bearer {self.token}":
            raise ArmError(401, "InvalidAuthenticationToken", "The access token is invalid.")
        for t in self._throttles:
            if (
                t.remaining > 0
                and (t.method in (None, method))
                and (t.path_contains is None or t.path_contains.lower() in path.lower())
            ):
                t.remaining -= 1
                raise ArmError(
                    429,
                    "TooManyRequests",
                    "The request is being throttled.",
                    {"Retry-After": str(t.retry_after)},
                )
        if "api-version" not in query:
            raise _bad(
                "The api-version query parameter (?api-version=) is required for all requests.",
                "MissingApiVersionParameter",
            )
        m = _ARM.match(path)
        if not m or m["sub"] != self.subscription_id:
            raise ArmError(404, "SubscriptionNotFound", "The subscription was not found.")
        return self._route(method, m["rest"] or "", query, headers, body)

    def _vm_images(self, m: re.Match[str], query: dict) -> tuple[int, dict[str, str], Any]:
        """VirtualMachineImages_List / _Get (Request Path .../locations/{location}/publishers/
        {publisherName}/artifacttypes/vmimage/offers/{offer}/skus/{skus}/versions[/{version}],
        learn.microsoft.com Azure.ResourceManager.Compute GetVirtualMachineImages). The list is
        a bare JSON array of {location, name, id}, and an image that is not offered answers 404
        NotFound "Artifact: VMImage was not found." — both as recorded in public answers
        (Get-AzVMImageSku's error output; a Go SDK test's recorded responses). ``$top`` and
        ``$orderby=name desc`` as the list operation's parameters say. The version names are
        the emulator's own."""
        key = (m["pub"].lower(), m["offer"].lower(), m["sku"].lower())
        versions = sorted(self.marketplace.get(key, []))
        loc = m["loc"].lower()
        if not versions:
            raise ArmError(404, "NotFound", "Artifact: VMImage was not found.")
        base = (
            f"/Subscriptions/{self.subscription_id}/Providers/Microsoft.Compute/Locations/{loc}"
            f"/Publishers/{m['pub']}/ArtifactTypes/VMImage/Offers/{m['offer']}/Skus/{m['sku']}"
            "/Versions/"
        )
        if m["version"]:
            if m["version"] not in versions:
                raise ArmError(404, "NotFound", "Artifact: VMImage was not found.")
            body = {"location": loc, "name": m["version"], "id": base + m["version"]}
            return 200, {}, {**body, "properties": {"osImage": {"operatingSystem": "Linux"}}}
        if "name desc" in str(query.get("$orderby", "")).lower():
            versions.reverse()
        if "$top" in query:
            versions = versions[: int(query["$top"])]
        return 200, {}, [{"location": loc, "name": v, "id": base + v} for v in versions]

    def _route(
        self,
        method: str,
        rest: str,
        query: dict,
        headers: dict,
        body: Any,
    ) -> tuple[int, dict[str, str], Any]:
        if m := _OPERATION.match(rest):
            return self._poll(m["op"], monitor="monitor" in query)
        if rest.lower() == "/providers/microsoft.insights/eventtypes/management/values":
            return self._activity(query)
        if rest.lower() == "/providers/microsoft.costmanagement/query" and method == "POST":
            from tests.emulators import azure_cost  # Cost Management: `provisioner bill`

            try:
                return 200, {}, azure_cost.query(self.cost_records, query["api-version"], body)
            except azure_cost.QueryError as e:
                raise _bad(e.message, "BadRequest") from None
        if (m := _VM_IMAGES.match(rest)) and method == "GET":
            return self._vm_images(m, query)
        m = _RG.match(rest)
        if not m:
            raise ArmError(404, "InvalidResourceType", f"Unknown path {rest}")
        rg, ns, rtype, tail = m["rg"], m["ns"].lower(), m["type"].lower(), m["rest"] or ""
        if rg.lower() not in self.resource_groups:
            raise ArmError(
                404, "ResourceGroupNotFound", f"Resource group '{rg}' could not be found."
            )
        parts = [p for p in tail.split("/") if p]
        key = (ns, rtype, len(parts), method)
        if key == ("microsoft.compute", "virtualmachines", 0, "GET"):
            return self._list_vms(rg, query)
        if ns == "microsoft.compute" and rtype == "virtualmachines" and parts:
            name = parts[0]
            if len(parts) == 1 and method == "PUT":
                return self._put_vm(rg, name, headers, body)
            if len(parts) == 1 and method == "GET":
                vm = self._get_vm(rg, name)
                if query.get("$expand", "").lower() != "instanceview":
                    return 200, {}, vm.body
                expanded = copy.deepcopy(vm.body)
                expanded["properties"]["instanceView"] = self._instance_view(vm)
                return 200, {}, expanded
            if len(parts) == 1 and method == "DELETE":
                return self._delete_vm_request(rg, name)
            if len(parts) == 2 and method == "GET" and parts[1].lower() == "instanceview":
                return 200, {}, self._instance_view(self._get_vm(rg, name))
            if len(parts) == 2 and method == "POST":
                return self._action(rg, name, parts[1].lower())
        if ns == "microsoft.network" and rtype == "networkinterfaces":
            if not parts and method == "GET":
                return self._list(self.nics, rg, "networkInterfaces", query)
            if len(parts) == 1:
                return self._nic(method, rg, parts[0], body)
        if ns == "microsoft.network" and rtype == "publicipaddresses":
            if not parts and method == "GET":
                return self._list(self.public_ips, rg, "publicIPAddresses", query)
            if len(parts) == 1:
                return self._public_ip(method, rg, parts[0], body)
        if ns == "microsoft.network" and rtype == "networksecuritygroups":
            if not parts and method == "GET":
                return self._list(self.nsgs, rg, "networkSecurityGroups", query)
            if len(parts) == 1:
                return self._nsg(method, rg, parts[0], body)
        if (
            ns == "microsoft.network"
            and rtype == "networksecuritygroups"
            and len(parts) == 3
            and parts[1].lower() == "securityrules"
        ):
            return self._security_rule(method, rg, parts[0], parts[2], body)
        if ns == "microsoft.compute" and rtype == "disks" and not parts and method == "GET":
            return self._list_disks(rg, query)
        if ns == "microsoft.compute" and rtype == "disks" and len(parts) == 1:
            return self._disk(method, rg, parts[0], headers, body)
        raise ArmError(404, "InvalidResourceType", f"{method} {rest} is not emulated")

    # --- the Microsoft identity platform (a service principal's sign-in)

    def _identity(self, method: str, path: str, form: dict[str, str]):
        """The OpenID Connect metadata document and the OAuth 2.0 client-credentials grant, as
        learn.microsoft.com/entra/identity-platform/v2-protocols-oidc ("Find your app's OpenID
        configuration document URI": ``{authority}/{tenant}/v2.0/.well-known/openid-configuration``)
        and …/v2-oauth2-client-creds-grant-flow ("First case: Access token request with a shared
        secret": POST ``/{tenant}/oauth2/v2.0/token`` with ``client_id``, ``scope`` (the resource's
        ``/.default``), ``client_secret``, ``grant_type=client_credentials``; the answer
        ``token_type``, ``expires_in``, ``access_token``) describe them. Errors are the ones
        that page and the AADSTS error-code reference
        (learn.microsoft.com/entra/identity-platform/reference-error-codes) give."""
        m = _OPENID.match(path) or _TOKEN.match(path)
        assert m
        tenant = m["tenant"]
        if tenant.lower() != self.tenant_id:
            raise IdentityError(
                400, "invalid_request", f"AADSTS90002: Tenant '{tenant}' not found."
            )
        root = f"{self.base_url}/{self.tenant_id}"
        if _OPENID.match(path):
            if method != "GET":
                raise IdentityError(405, "invalid_request", "Method not allowed.")
            return (
                200,
                {},
                {
                    "issuer": f"{self.base_url}/{self.tenant_id}/v2.0",
                    "authorization_endpoint": f"{root}/oauth2/v2.0/authorize",
                    "token_endpoint": f"{root}/oauth2/v2.0/token",
                    "device_authorization_endpoint": f"{root}/oauth2/v2.0/devicecode",
                    "jwks_uri": f"{root}/discovery/v2.0/keys",
                    "response_types_supported": [
                        "code",
                        "id_token",
                        "code id_token",
                        "id_token token",
                    ],
                    "subject_types_supported": ["pairwise"],
                    "id_token_signing_alg_values_supported": ["RS256"],
                    "scopes_supported": ["openid", "profile", "email", "offline_access"],
                    "token_endpoint_auth_methods_supported": [
                        "client_secret_post",
                        "private_key_jwt",
                        "client_secret_basic",
                    ],
                    "tenant_region_scope": "NA",
                },
            )
        if method != "POST":
            raise IdentityError(405, "invalid_request", "Method not allowed.")
        if form.get("grant_type") != "client_credentials":
            raise IdentityError(
                400,
                "unsupported_grant_type",
                "AADSTS70003: The app requested an unsupported grant type.",
            )
        client = form.get("client_id", "")
        if client not in self.service_principals:
            raise IdentityError(
                400,
                "unauthorized_client",
                f"AADSTS700016: Application with identifier '{client}' was not found in the "
                f"directory '{self.tenant_id}'.",
            )
        if form.get("client_secret") != self.service_principals[client]:
            raise IdentityError(
                401,
                "invalid_client",
                "AADSTS7000215: Invalid client secret provided. Ensure the secret being sent in "
                "the request is the client secret value, not the client secret ID, for a secret "
                f"added to app '{client}'.",
            )
        scopes = form.get("scope", "").split()
        # "The value passed for the scope parameter in this request should be the resource
        # identifier (application ID URI) of the resource you want, affixed with the .default
        # suffix" (client-credentials page): one resource, ARM here.
        if scopes != [ARM_DEFAULT_SCOPE]:
            raise IdentityError(
                400,
                "invalid_scope",
                f"AADSTS1002012: The provided value for scope {' '.join(scopes)} is not valid. "
                "Client credential flows must have a scope value with /.default suffixed to "
                "the resource identifier (application ID URI).",
            )
        return (
            200,
            {},
            {
                "token_type": "Bearer",
                "expires_in": 3599,
                "ext_expires_in": 3599,
                "access_token": self.token,
            },
        )

    # --- virtual machines

    def _put_vm(self, rg: str, name: str, headers: dict, body: Any):
        from azure.mgmt.compute import models

        vm_id = self._vm_id(rg, name)
        existing = self.vms.get(vm_id.lower())
        if headers.get("if-none-match") == "*" and existing:
            raise ArmError(
                412,
                "PreconditionFailed",
                f"The resource '{name}' already exists and "
                "the precondition If-None-Match: * failed.",
            )
        if not _VM_NAME.match(name):
            raise _bad(f"Virtual machine name '{name}' is invalid.", "InvalidResourceName")
        check_model(models.VirtualMachine, body)
        if existing:  # an update: tags and data disks are emulated
            return self._update_vm(existing, body)
        props = body.get("properties", {})
        self._check_vm_semantics(name, body, props)
        region, zone = body["location"], (body.get("zones") or [""])[0]
        fault = self._fault(region, zone, synchronous=True)
        if fault:
            raise ArmError(fault.status, fault.code, fault.message)
        nic_ids = [ref["id"].lower() for ref in props["networkProfile"]["networkInterfaces"]]
        os_disk = props["storageProfile"]["osDisk"]
        disk_name = os_disk.get("name") or f"{name}_OsDisk_1_{uuid.uuid4().hex}"
        disk_id = (
            f"/subscriptions/{self.subscription_id}/resourceGroups/{rg}/providers/"
            f"Microsoft.Compute/disks/{disk_name}"
        )
        os_disk["name"] = disk_name
        os_disk.setdefault("managedDisk", {})["id"] = disk_id
        props.update(provisioningState="Creating", vmId=str(uuid.uuid4()), timeCreated=self._now())
        props.setdefault("osProfile", {}).pop("customData", None)  # ARM never echoes it
        stored = {"id": vm_id, "name": name, "type": "Microsoft.Compute/virtualMachines", **body}
        vm = _Vm(stored, "starting")
        self.vms[vm_id.lower()] = vm
        for nic_id in nic_ids:
            self.nics[nic_id]["properties"]["virtualMachine"] = {"id": vm_id}
        self.disks[disk_id.lower()] = {
            "id": disk_id,
            "name": disk_name,
            "managedBy": vm_id,
            "location": region,
        }
        self._event(vm_id, "Microsoft.Compute/virtualMachines/write")

        def complete() -> dict | None:
            failure = self._fault(region, zone, synchronous=False)
            if failure:
                props["provisioningState"] = "Failed"
                vm.power = "deallocated"
                return {"code": failure.code, "message": failure.message}
            props["provisioningState"] = "Succeeded"
            vm.power = "running"
            vm.provisioned = self._now()
            return None

        return 201, self._operation("Microsoft.Compute", region, complete), stored

    def _check_vm_semantics(self, name: str, body: dict, props: dict) -> None:
        """The ARM rules beyond the schema that a create relies on."""
        if not re.fullmatch(r"[a-z0-9]+", body["location"]):
            raise _bad(
                f"Location '{body['location']}' is not valid.",
                "LocationNotAvailableForResourceType",
            )
        zones = body.get("zones") or []
        if len(zones) > 1 or any(z not in ("1", "2", "3") for z in zones):
            raise _bad(f"Zones {zones} are invalid for a single VM.")
        tags = body.get("tags") or {}
        if len(tags) > 50 or any(len(k) > 512 or len(v) > 256 for k, v in tags.items()):
            raise _bad("Tags exceed ARM limits.", "InvalidTag")
        # ARM "Limitations": tag names can't contain < > % & \ ? / and can't begin with
        # microsoft, azure or windows (the wording of the refusal is not documented)
        for name in tags:
            if re.search(r"[<>%&\\?/]", name) or name.lower().startswith(
                ("microsoft", "azure", "windows")
            ):
                raise _bad(f"The tag name '{name}' is invalid.", "InvalidTag")
        size = props.get("hardwareProfile", {}).get("vmSize", "")
        if not size.startswith("Standard_"):
            raise _bad(f"The value {size!r} of parameter 'vmSize' is not allowed.")
        storage = props.get("storageProfile") or {}
        image = storage.get("imageReference") or {}
        if not (
            image.get("id") or all(image.get(k) for k in ("publisher", "offer", "sku", "version"))
        ):
            raise _bad("storageProfile.imageReference needs publisher, offer, sku and version.")
        os_disk = storage.get("osDisk") or {}
        if os_disk.get("createOption") != "FromImage":
            raise _bad("storageProfile.osDisk.createOption must be FromImage here.")
        size_gb = os_disk.get("diskSizeGB")
        if not isinstance(size_gb, int) or not 30 <= size_gb <= 4095:
            raise _bad("storageProfile.osDisk.diskSizeGB must be between 30 and 4095.")
        os_profile = props.get("osProfile") or {}
        computer, admin = os_profile.get("computerName", ""), os_profile.get("adminUsername", "")
        if not computer or len(computer) > 64 or not admin:
            raise _bad("osProfile.computerName (≤64) and osProfile.adminUsername are required.")
        linux = os_profile.get("linuxConfiguration") or {}
        keys = (linux.get("ssh") or {}).get("publicKeys") or []
        for key in keys:
            if key.get("path") != f"/home/{admin}/.ssh/authorized_keys":
                raise _bad(
                    f"Destination path for SSH public keys is currently limited to its "
                    f"default value /home/{admin}/.ssh/authorized_keys."
                )
            if not str(key.get("keyData", "")).startswith(("ssh-", "ecdsa-")):
                raise _bad(
                    "The value of parameter linuxConfiguration.ssh.publicKeys.keyData is invalid.",
                    "InvalidParameter",
                )
        if linux.get("disablePasswordAuthentication") and not keys:
            raise _bad(
                "Authentication using either SSH or by user name and password must be "
                "enabled in Linux profile."
            )
        if "customData" in os_profile:
            # OSProfile.customData: "The base-64 encoded string is decoded to a binary array
            # ... The maximum length of the binary array is 65535 bytes" (Compute REST API);
            # ARM answers both a bad encoding and a longer one with InvalidParameter, target
            # customData, "Custom data in OSProfile must be in Base64 encoding and with a
            # maximum length of 87380 characters." (Azure/aks-engine#1663, Azure/acs-engine
            # #4149); 87380 is the base64 length of 65535 bytes.
            too_long = _bad(
                "Custom data in OSProfile must be in Base64 encoding and with a maximum length "
                "of 87380 characters."
            )
            try:
                decoded = base64.b64decode(os_profile["customData"], validate=True)
            except ValueError:
                raise too_long from None
            if len(os_profile["customData"]) > 87_380 or len(decoded) > 65_535:
                raise too_long
        priority = (props.get("priority") or "Regular").lower()
        if priority != "spot" and ("evictionPolicy" in props or "billingProfile" in props):
            raise _bad("Eviction policy and billing profile can be set only on Spot VMs.")
        if priority == "spot":
            max_price = (props.get("billingProfile") or {}).get("maxPrice", -1)
            if max_price != -1 and not max_price > 0:
                raise _bad(
                    "billingProfile.maxPrice must be -1 or greater than 0.", "InvalidMaxPrice"
                )
        refs = (props.get("networkProfile") or {}).get("networkInterfaces") or []
        if not refs:
            raise _bad("networkProfile.networkInterfaces is required.")
        for ref in refs:
            nic = self.nics.get(ref.get("id", "").lower())
            if nic is None:
                raise _bad(f"Resource {ref.get('id')} not found.", "InvalidResourceReference")
            if nic["location"] != body["location"]:
                raise _bad("The NIC must be in the VM's location.", "NicLocationMismatch")
            attached = nic["properties"].get("virtualMachine")
            if attached:
                raise _bad(f"Network interface is in use by {attached['id']}.", "NicInUse")

    def _list_vms(self, rg: str, query: dict):
        prefix = f"/subscriptions/{self.subscription_id}/resourcegroups/{rg.lower()}/"
        vms = [vm.body for key, vm in sorted(self.vms.items()) if key.startswith(prefix)]
        skip = int(query.get("$skiptoken", "0"))
        page = vms[skip : skip + self.page_size]
        result: dict[str, Any] = {"value": page}
        if skip + self.page_size < len(vms):
            result["nextLink"] = (
                f"{self.base_url}/subscriptions/{self.subscription_id}/"
                f"resourceGroups/{rg}/providers/Microsoft.Compute/"
                f"virtualMachines?api-version={query['api-version']}"
                f"&$skiptoken={skip + self.page_size}"
            )
        return 200, {}, result

    def _instance_view(self, vm: _Vm) -> dict:
        prov = vm.body["properties"].get("provisioningState", "Succeeded")
        statuses = [
            {
                "code": f"ProvisioningState/{prov.lower()}",
                "level": "Info",
                "displayStatus": f"Provisioning {prov.lower()}",
            }
        ]
        if prov == "Succeeded" and vm.provisioned:
            statuses[0]["time"] = vm.provisioned
        if prov == "Failed":
            statuses[0] = {
                "code": "ProvisioningState/failed/AllocationFailed",
                "level": "Error",
                "displayStatus": "Provisioning failed",
            }
        statuses.append(
            {"code": f"PowerState/{vm.power}", "level": "Info", "displayStatus": f"VM {vm.power}"}
        )
        return {"computerName": vm.body["name"], "osName": "ubuntu", "statuses": statuses}

    def _action(self, rg: str, name: str, action: str):
        vm = self._get_vm(rg, name)
        vm_id, region = vm.body["id"], vm.body["location"]
        zone = (vm.body.get("zones") or [""])[0]
        if action == "simulateeviction":
            self.evict(name, rg)
            return 204, {}, None
        transitions = {
            "deallocate": ("deallocating", "deallocated"),
            "poweroff": ("stopping", "stopped"),
            "start": ("starting", "running"),
        }
        if action not in transitions:
            raise ArmError(404, "InvalidResourceType", f"action {action} is not emulated")
        during, after = transitions[action]
        before = vm.power
        vm.power = during

        def complete() -> dict | None:
            # A start allocates the VM again and can fail for capacity as a create does: "When
            # you try to start a stopped Azure Virtual Machine (VM) ... the common error you
            # encounter is an allocation failure" (MicrosoftDocs/SupportArticles-docs,
            # support/azure/virtual-machines/windows/restart-resize-error-troubleshooting.md).
            # The VM stays deallocated, its disks kept.
            failure = self._fault(region, zone, synchronous=False) if action == "start" else None
            if failure:
                vm.power = before
                return {"code": failure.code, "message": failure.message}
            vm.power = after
            vm.provisioned = self._event(
                vm_id, f"Microsoft.Compute/virtualMachines/{action}/action"
            )
            return None

        return 202, self._operation("Microsoft.Compute", region, complete), None

    def _delete_vm_request(self, rg: str, name: str):
        vm = self.vms.get(self._vm_id(rg, name).lower())
        if vm is None:
            return 204, {}, None
        vm.body["properties"]["provisioningState"] = "Deleting"

        def complete() -> None:
            self._delete_vm(vm)
            self._event(vm.body["id"], "Microsoft.Compute/virtualMachines/delete")

        return 202, self._operation("Microsoft.Compute", vm.body["location"], complete), None

    # --- network interfaces and disks

    def _network_id(self, rg: str, rtype: str, name: str) -> str:
        return (
            f"/subscriptions/{self.subscription_id}/resourceGroups/{rg}/providers/"
            f"Microsoft.Network/{rtype}/{name}"
        )

    @staticmethod
    def _not_found(rtype: str, rg: str, name: str) -> ArmError:
        return ArmError(
            404,
            "ResourceNotFound",
            f"The Resource 'Microsoft.Network/{rtype}/{name}' under resource group '{rg}' "
            "was not found.",
        )

    @staticmethod
    def _bad_reference(ref_id: str, by: str) -> ArmError:
        # The shape ARM answers for a missing or other-region reference from a NIC (quoted in
        # MicrosoftDocs/azure-docs#114616 for a public IP, Azure/azure-cli#332 for an NSG).
        return _bad(
            f"Resource {ref_id} referenced by resource {by} was not found. Please make sure "
            "that the referenced resource exists, and that both resources are in the same region.",
            "InvalidResourceReference",
        )

    def _nic(self, method: str, rg: str, name: str, body: Any):
        nic_id = self._network_id(rg, "networkInterfaces", name)
        nic = self.nics.get(nic_id.lower())
        if method == "GET":
            if nic is None:
                raise ArmError(404, "NotFound", f"Resource {nic_id} not found.")
            return 200, {}, nic
        if method == "DELETE":
            if nic is None:
                return 204, {}, None
            if nic["properties"].get("virtualMachine"):
                raise _bad(f"Network interface {nic_id} is used by a virtual machine.", "NicInUse")
            self._remove_nic(nic, vm_deleted=False)
            return 200, {}, None
        if method != "PUT":
            raise ArmError(405, "MethodNotAllowed", method)
        from azure.mgmt.network import models

        check_model(models.NetworkInterface, body)
        props = body.get("properties") or {}
        configs = props.get("ipConfigurations") or []
        if not configs:
            raise _bad("A network interface needs at least one IP configuration.")
        location = body["location"]
        if nic is not None and nic["location"] != location:
            raise _bad(
                f"Resource {nic_id} exists in location {nic['location']}; a resource "
                "cannot change location.",
                "InvalidResourceLocation",
            )
        wanted: dict[str, str] = {}  # public IP key -> the ipConfiguration id that takes it
        for config in configs:
            subnet = ((config.get("properties") or {}).get("subnet") or {}).get("id", "")
            if not config.get("name") or not _SUBNET_ID.match(subnet):
                raise _bad(
                    f"Subnet id {subnet!r} is not a valid subnet reference.",
                    "InvalidResourceReference",
                )
            config_id = f"{nic_id}/ipConfigurations/{config['name']}"
            pip_ref = (config.get("properties") or {}).get("publicIPAddress")
            if pip_ref:
                pip = self.public_ips.get(pip_ref.get("id", "").lower())
                if pip is None or pip["location"] != location:
                    raise self._bad_reference(pip_ref.get("id", ""), nic_id)
                holder = (pip["properties"].get("ipConfiguration") or {}).get("id", "")
                if holder and not holder.lower().startswith(nic_id.lower() + "/"):
                    # One public IP, one ipConfiguration: recorded ARM answer in
                    # Azure/azure-sdk-for-node's network test recordings.
                    raise _bad("Public IP address is in use.", "PublicIPAddressInUse")
                wanted[pip_ref["id"].lower()] = config_id
        nsg_ref = props.get("networkSecurityGroup")
        nsg = None
        if nsg_ref:
            nsg = self.nsgs.get(nsg_ref.get("id", "").lower())
            if nsg is None or nsg["location"] != location:
                raise self._bad_reference(nsg_ref.get("id", ""), nic_id)
        status = 200
        if nic is None:
            nic = {
                "id": nic_id,
                "name": name,
                "type": "Microsoft.Network/networkInterfaces",
                "location": location,
                "properties": {},
            }
            self.nics[nic_id.lower()] = nic
            status = 201
        old_configs = {c["name"]: c for c in nic["properties"].get("ipConfigurations", [])}
        self._release_network(nic)  # the PUT replaces the whole configuration
        for config in configs:
            config["id"] = f"{nic_id}/ipConfigurations/{config['name']}"
            kept = old_configs.get(config["name"], {}).get("properties", {})
            config["properties"]["privateIPAddress"] = kept.get(
                "privateIPAddress", f"10.0.0.{next(self._ip)}"
            )
            config["properties"]["provisioningState"] = "Succeeded"
        for key, config_id in wanted.items():
            pip = self.public_ips[key]
            pip["properties"]["ipConfiguration"] = {"id": config_id}
            # deleteOption takes effect only as set through the NIC's ipConfiguration
            # (Azure/azure-sdk-for-java#38806, maintainers; #39096 sets it there). Per the SDK's
            # DeleteOptions: "what happens to the public IP address when the VM using it is
            # deleted".
            ref = next(
                c["properties"]["publicIPAddress"]
                for c in configs
                if (c["properties"].get("publicIPAddress") or {}).get("id", "").lower() == key
            )
            option = (ref.get("properties") or {}).get("deleteOption")
            if option:
                pip["properties"]["deleteOption"] = option
            else:
                pip["properties"].pop("deleteOption", None)
        if nsg is not None:
            nsg["properties"].setdefault("networkInterfaces", []).append({"id": nic_id})
        nic["properties"]["ipConfigurations"] = configs
        nic["properties"]["networkSecurityGroup"] = {"id": nsg["id"]} if nsg else None
        if nsg is None:
            nic["properties"].pop("networkSecurityGroup")
        nic["tags"] = body.get("tags", {})
        nic["properties"]["provisioningState"] = "Succeeded"
        headers = self._operation("Microsoft.Network", location, lambda: None)
        return status, headers, nic

    def _release_network(self, nic: dict) -> None:
        """Detach the NIC from its public IPs and NSG (they stay, and a public IP keeps billing)."""
        for config in nic["properties"].get("ipConfigurations", []):
            pip_id = ((config.get("properties") or {}).get("publicIPAddress") or {}).get("id", "")
            pip = self.public_ips.get(pip_id.lower())
            if pip is not None:
                pip["properties"].pop("ipConfiguration", None)
        nsg_id = (nic["properties"].get("networkSecurityGroup") or {}).get("id", "")
        nsg = self.nsgs.get(nsg_id.lower())
        if nsg is not None:
            nsg["properties"]["networkInterfaces"] = [
                r
                for r in nsg["properties"].get("networkInterfaces", [])
                if r["id"].lower() != nic["id"].lower()
            ]

    def _remove_nic(self, nic: dict, *, vm_deleted: bool) -> None:
        """A NIC goes. Its public IPs are detached and stay (and bill), unless the VM is being
        deleted and the NIC set their deleteOption to Delete (SDK DeleteOptions docstring)."""
        doomed = []
        if vm_deleted:
            for config in nic["properties"].get("ipConfigurations", []):
                pip_id = ((config.get("properties") or {}).get("publicIPAddress") or {}).get("id")
                pip = self.public_ips.get((pip_id or "").lower())
                if pip is not None and pip["properties"].get("deleteOption") == "Delete":
                    doomed.append(pip_id.lower())
        self._release_network(nic)
        self.nics.pop(nic["id"].lower(), None)
        for key in doomed:
            self.public_ips.pop(key, None)

    def _list(self, store: dict[str, dict], rg: str, rtype: str, query: dict):
        prefix = f"/subscriptions/{self.subscription_id}/resourcegroups/{rg.lower()}/"
        items = [item for key, item in sorted(store.items()) if key.startswith(prefix)]
        skip = int(query.get("$skiptoken", "0"))
        result: dict[str, Any] = {"value": items[skip : skip + self.page_size]}
        if skip + self.page_size < len(items):
            result["nextLink"] = (
                f"{self.base_url}/subscriptions/{self.subscription_id}/resourceGroups/{rg}/"
                f"providers/Microsoft.Network/{rtype}?api-version={query['api-version']}"
                f"&$skiptoken={skip + self.page_size}"
            )
        return 200, {}, result

    def _public_ip(self, method: str, rg: str, name: str, body: Any):
        pip_id = self._network_id(rg, "publicIPAddresses", name)
        pip = self.public_ips.get(pip_id.lower())
        if method == "GET":
            if pip is None:
                raise self._not_found("publicIPAddresses", rg, name)
            return 200, {}, pip
        if method == "DELETE":
            if pip is None:
                return 204, {}, None
            holder = (pip["properties"].get("ipConfiguration") or {}).get("id")
            if holder:
                # Refused while associated (message as ARM sends it, quoted in
                # hashicorp/terraform-provider-azurerm#2566 and oap-project/cloudtik#158).
                raise _bad(
                    f"Public IP address {pip_id} can not be deleted since it is still allocated "
                    f"to resource {holder}. In order to delete the public IP, "
                    "disassociate/detach the Public IP address from the resource.  To learn how "
                    "to do this, see aka.ms/deletepublicip.",
                    "PublicIPAddressCannotBeDeleted",
                )
            self.public_ips.pop(pip_id.lower())
            return 202, self._operation("Microsoft.Network", pip["location"], lambda: None), None
        if method != "PUT":
            raise ArmError(405, "MethodNotAllowed", method)
        from azure.mgmt.network import models

        check_model(models.PublicIPAddress, body)
        props = dict(body.get("properties") or {})
        sku = (body.get("sku") or {}).get("name", "Basic")
        method_ = props.get("publicIPAllocationMethod", "Dynamic")
        if sku.lower().startswith("standard") and method_.lower() != "static":
            # "Standard sku publicIp … must have AllocationMethod set to Static."
            # (MicrosoftDocs/azure-docs#42889; Standard SKU "always uses static allocation",
            # learn.microsoft.com/azure/virtual-network/ip-services/public-ip-addresses)
            raise _bad(
                f"Standard sku publicIp {pip_id} must have AllocationMethod set to Static.",
                "StandardSkuPublicIPAddressesMustBeStatic",
            )
        # A deleteOption in the public IP's own PUT is not kept: ARM drops it from the stored
        # resource (Azure/azure-rest-api-specs#25475, Azure/azure-cli#20592). Only the NIC's
        # ipConfiguration reference sets it (see _nic).
        props.pop("deleteOption", None)
        status = 200
        if pip is None:
            pip = {
                "id": pip_id,
                "name": name,
                "type": "Microsoft.Network/publicIPAddresses",
                "location": body["location"],
                "properties": {},
            }
            self.public_ips[pip_id.lower()] = pip
            status = 201
        elif pip["location"] != body["location"]:
            raise _bad(
                f"Resource {pip_id} exists in location {pip['location']}; a resource "
                "cannot change location.",
                "InvalidResourceLocation",
            )
        kept = {
            k: pip["properties"][k]
            for k in ("ipAddress", "ipConfiguration", "deleteOption")
            if k in pip["properties"]
        }
        pip["properties"] = {**props, **kept, "provisioningState": "Succeeded"}
        pip["properties"].setdefault("publicIPAllocationMethod", method_)
        if method_.lower() == "static" and "ipAddress" not in pip["properties"]:
            # A static address is assigned when the resource is created (public IP docs).
            pip["properties"]["ipAddress"] = self.public_address or f"20.0.0.{next(self._address)}"
        pip["sku"] = {"name": sku, "tier": (body.get("sku") or {}).get("tier", "Regional")}
        pip["tags"] = body.get("tags", {})
        if body.get("zones"):
            pip["zones"] = body["zones"]
        headers = self._operation("Microsoft.Network", body["location"], lambda: None)
        return status, headers, pip

    # The rules every NSG has (learn.microsoft.com/azure/virtual-network/
    # network-security-groups-overview, "Default security rules").
    _DEFAULT_RULES = (
        ("AllowVnetInBound", 65000, "Inbound", "Allow", "VirtualNetwork"),
        ("AllowAzureLoadBalancerInBound", 65001, "Inbound", "Allow", "AzureLoadBalancer"),
        ("DenyAllInBound", 65500, "Inbound", "Deny", "*"),
        ("AllowVnetOutBound", 65000, "Outbound", "Allow", "VirtualNetwork"),
        ("AllowInternetOutBound", 65001, "Outbound", "Allow", "*"),
        ("DenyAllOutBound", 65500, "Outbound", "Deny", "*"),
    )

    def _nsg(self, method: str, rg: str, name: str, body: Any):
        nsg_id = self._network_id(rg, "networkSecurityGroups", name)
        nsg = self.nsgs.get(nsg_id.lower())
        if method == "GET":
            if nsg is None:
                raise self._not_found("networkSecurityGroups", rg, name)
            return 200, {}, nsg
        if method == "DELETE":
            if nsg is None:
                return 204, {}, None
            users = [r["id"] for r in nsg["properties"].get("networkInterfaces", [])]
            if users:
                # pulumi/pulumi-azure-native#3051 quotes ARM's answer. The docs ("Delete a network
                # security group", quoted in MicrosoftDocs/azure-docs#18895): one associated with
                # a subnet or NIC cannot be deleted.
                raise _bad(
                    f"Network security group {nsg_id} cannot be deleted because it is in use by "
                    f"the following resources: {', '.join(users)}. In order to delete the "
                    "Network security group, remove the association with the resource(s).",
                    "InUseNetworkSecurityGroupCannotBeDeleted",
                )
            self.nsgs.pop(nsg_id.lower())
            return 202, self._operation("Microsoft.Network", nsg["location"], lambda: None), None
        if method != "PUT":
            raise ArmError(405, "MethodNotAllowed", method)
        from azure.mgmt.network import models

        check_model(models.NetworkSecurityGroup, body)
        rules = (body.get("properties") or {}).get("securityRules") or []
        _check_rules(rules)
        status = 200
        if nsg is None:
            nsg = {
                "id": nsg_id,
                "name": name,
                "type": "Microsoft.Network/networkSecurityGroups",
                "location": body["location"],
                "properties": {"networkInterfaces": []},
            }
            self.nsgs[nsg_id.lower()] = nsg
            status = 201
        elif nsg["location"] != body["location"]:
            raise _bad(
                f"Resource {nsg_id} exists in location {nsg['location']}; a resource "
                "cannot change location.",
                "InvalidResourceLocation",
            )
        for rule in rules:
            rule["id"] = f"{nsg_id}/securityRules/{rule.get('name', '')}"
            rule["properties"]["provisioningState"] = "Succeeded"
        nsg["properties"]["securityRules"] = rules
        nsg["properties"]["defaultSecurityRules"] = [
            {
                "name": rule_name,
                "id": f"{nsg_id}/defaultSecurityRules/{rule_name}",
                "properties": {
                    "priority": priority,
                    "direction": direction,
                    "access": access,
                    "protocol": "*",
                    "sourceAddressPrefix": source if direction == "Inbound" else "*",
                    "destinationAddressPrefix": "*" if direction == "Inbound" else source,
                    "sourcePortRange": "*",
                    "destinationPortRange": "*",
                },
            }
            for rule_name, priority, direction, access, source in self._DEFAULT_RULES
        ]
        nsg["properties"]["provisioningState"] = "Succeeded"
        nsg["tags"] = body.get("tags", {})
        headers = self._operation("Microsoft.Network", body["location"], lambda: None)
        return status, headers, nsg

    def _security_rule(self, method: str, rg: str, nsg_name: str, name: str, body: Any):
        """One rule of a group by itself (REST "Security Rules - Create Or Update", PUT
        …/networkSecurityGroups/{group}/securityRules/{rule}: learn.microsoft.com/rest/api/
        virtualnetwork/security-rules/create-or-update): the group's other rules and its NIC
        associations are untouched; the same priority and direction rules apply."""
        nsg_id = self._network_id(rg, "networkSecurityGroups", nsg_name)
        nsg = self.nsgs.get(nsg_id.lower())
        if nsg is None:
            raise self._not_found("networkSecurityGroups", rg, nsg_name)
        rules = nsg["properties"].get("securityRules", [])
        current = next((r for r in rules if r.get("name", "").lower() == name.lower()), None)
        if method == "GET":
            if current is None:
                raise self._not_found(f"networkSecurityGroups/{nsg_name}/securityRules", rg, name)
            return 200, {}, current
        if method != "PUT":
            raise ArmError(405, "MethodNotAllowed", method)
        from azure.mgmt.network import models

        check_model(models.SecurityRule, body)
        rule = {**body, "name": name}
        others = [r for r in rules if r is not current]
        _check_rules([*others, rule])
        rule["id"] = f"{nsg_id}/securityRules/{name}"
        rule.setdefault("properties", {})["provisioningState"] = "Succeeded"
        nsg["properties"]["securityRules"] = [*others, rule]
        headers = self._operation("Microsoft.Network", nsg["location"], lambda: None)
        return (201 if current is None else 200), headers, rule

    # Managed disks. What ARM refuses, and how:
    # - deleting a disk attached to a VM: OperationNotAllowed "Disk <name> is attached to VM
    #   <VM id>." (ARM's answer quoted in ansible/ansible#54644: "Azure Error:
    #   OperationNotAllowed\nMessage: Disk mdb57dc956081 is attached to VM /subscriptions/…/
    #   virtualMachines/trb57dc95608.");
    # - attaching a zonal disk to a VM in another zone: 400 BadRequest "Disk <id> cannot be
    #   attached to the VM because it is not in the same zone as the VM. VM zone: '1'. Disk
    #   zone: '2'." (jenkins-infra/azure#1406, ARM's answer to a VM CreateOrUpdate);
    # - attaching a disk another VM holds: a disk attaches to one VM unless created with
    #   maxShares > 1 ("maxShares should be set to a value greater than one for disks to allow
    #   attaching them to multiple VMs", azure-mgmt-compute Disk.managed_by_extended; maxShares
    #   is not emulated, so every disk is single-attach). No
    #   recorded answer to that attach was found, so the delete's code and sentence stand in;
    # - a VM's deletion leaves data disks whose deleteOption is Detach, unattached ("Detach. If
    #   this value is used, the managed disk is retained after VM gets deleted",
    #   azure-mgmt-compute DiskDeleteOptionTypes).

    def _disk_id(self, rg: str, name: str) -> str:
        return (
            f"/subscriptions/{self.subscription_id}/resourceGroups/{rg}/providers/"
            f"Microsoft.Compute/disks/{name}"
        )

    def _disk(self, method: str, rg: str, name: str, headers: dict, body: Any):
        disk_id = self._disk_id(rg, name)
        disk = self.disks.get(disk_id.lower())
        if method == "PUT":
            return self._put_disk(rg, name, headers, body, disk)
        if method == "GET":
            if disk is None:
                raise ArmError(
                    404,
                    "ResourceNotFound",
                    f"The Resource 'Microsoft.Compute/disks/{name}' under resource group "
                    f"'{rg}' was not found.",
                )
            return 200, {}, disk
        if method != "DELETE":
            raise ArmError(405, "MethodNotAllowed", method)
        if disk is None:
            return 204, {}, None
        if disk.get("managedBy"):
            raise ArmError(
                409, "OperationNotAllowed", f"Disk {name} is attached to VM {disk['managedBy']}."
            )
        self.disks.pop(disk_id.lower())
        return 202, self._operation("Microsoft.Compute", disk["location"], lambda: None), None

    def _put_disk(self, rg: str, name: str, headers: dict, body: Any, existing: dict | None):
        from azure.mgmt.compute import models

        if headers.get("if-none-match") == "*" and existing:
            raise ArmError(
                412,
                "PreconditionFailed",
                f"The resource '{name}' already exists and "
                "the precondition If-None-Match: * failed.",
            )
        check_model(models.Disk, body)
        if existing:  # an update: only tags are emulated
            existing["tags"] = body.get("tags", {})
            return 200, {}, existing
        if not re.fullmatch(r"[a-z0-9]+", body.get("location", "")):
            raise _bad(
                f"Location '{body.get('location')}' is not valid.",
                "LocationNotAvailableForResourceType",
            )
        zones = body.get("zones") or []
        if len(zones) > 1 or any(z not in ("1", "2", "3") for z in zones):
            raise _bad(f"Zones {zones} are invalid for a disk.")
        props = copy.deepcopy(body.get("properties") or {})
        # DiskProperties.creationData: "Disk source information. CreationData information
        # cannot be changed after the disk has been created." Required.
        if not (props.get("creationData") or {}).get("createOption"):
            raise _bad("Required property 'properties.creationData.createOption' is missing")
        if props["creationData"]["createOption"] == "Empty" and not props.get("diskSizeGB"):
            raise _bad("Required parameter 'diskSizeGB' is missing (null).", "InvalidParameter")
        size = int(props.get("diskSizeGB") or 0)
        props.update(
            diskSizeBytes=size * 1024**3,
            uniqueId=str(uuid.uuid4()),
            provisioningState="Succeeded",
            diskState="Unattached",
            timeCreated=self._now(),
        )
        disk_id = self._disk_id(rg, name)
        disk = {
            "id": disk_id,
            "name": name,
            "type": "Microsoft.Compute/disks",
            "location": body["location"],
            **({"zones": zones} if zones else {}),
            "tags": body.get("tags", {}),
            "sku": {
                "name": (body.get("sku") or {}).get("name", "Standard_LRS"),
                "tier": "Standard",
            },
            "properties": props,
        }
        self.disks[disk_id.lower()] = disk
        # Disks_CreateOrUpdate answers 200 or 202 (the SDK's accepted codes, from the spec)
        return 202, self._operation("Microsoft.Compute", disk["location"], lambda: None), disk

    def _list_disks(self, rg: str, query: dict):
        prefix = f"/subscriptions/{self.subscription_id}/resourcegroups/{rg.lower()}/"
        items = [d for key, d in sorted(self.disks.items()) if key.startswith(prefix)]
        skip = int(query.get("$skiptoken", "0"))
        size = self.disk_page_size
        result: dict[str, Any] = {"value": items[skip : skip + size]}
        if skip + size < len(items):
            result["nextLink"] = (
                f"{self.base_url}/subscriptions/{self.subscription_id}/resourceGroups/{rg}/"
                f"providers/Microsoft.Compute/disks?api-version={query['api-version']}"
                f"&$skiptoken={skip + size}"
            )
        return 200, {}, result

    def _set_attached(self, disk: dict, vm_id: str | None) -> None:
        disk["managedBy"] = vm_id
        if "properties" in disk:
            disk["properties"]["diskState"] = "Attached" if vm_id else "Unattached"

    def _update_vm(self, vm: _Vm, body: dict):
        """A PUT on an existing VM: its tags, and its data disks (attach what is new, detach
        what is gone), checked before anything changes."""
        vm_id, zone = vm.body["id"], (vm.body.get("zones") or [""])[0]
        props = vm.body["properties"]
        storage = props.setdefault("storageProfile", {})
        before = {d["managedDisk"]["id"].lower(): d for d in storage.get("dataDisks", [])}
        wanted = (body.get("properties", {}).get("storageProfile") or {}).get("dataDisks") or []
        luns = [d.get("lun") for d in wanted]
        if len(luns) != len(set(luns)):
            raise _bad("Data disk LUNs must be unique.", "InvalidParameter")
        added = []
        for entry in wanted:
            ref = (entry.get("managedDisk") or {}).get("id", "")
            if ref.lower() in before:
                continue
            if entry.get("createOption") != "Attach":
                raise _bad("Only attaching existing managed disks is emulated.")
            disk = self.disks.get(ref.lower())
            if disk is None or "properties" not in disk:
                raise ArmError(404, "NotFound", f"Disk {ref} not found.")
            disk_zone = (disk.get("zones") or [""])[0]
            if disk_zone and disk_zone != zone:
                raise ArmError(
                    400,
                    "BadRequest",
                    f"Disk {disk['id']} cannot be attached to the VM because it is not in the "
                    f"same zone as the VM. VM zone: '{zone}'. Disk zone: '{disk_zone}'.",
                )
            if disk.get("managedBy") and disk["managedBy"].lower() != vm_id.lower():
                raise ArmError(
                    409,
                    "OperationNotAllowed",
                    f"Disk {disk['name']} is attached to VM {disk['managedBy']}.",
                )
            added.append((entry, disk))
        kept = {(d.get("managedDisk") or {}).get("id", "").lower() for d in wanted}
        removed = [d for key, d in before.items() if key not in kept]
        vm.body["tags"] = body.get("tags", {})

        def complete() -> dict | None:
            for entry in removed:
                disk = self.disks.get(entry["managedDisk"]["id"].lower())
                if disk is not None:
                    self._set_attached(disk, None)
            stored = [d for d in storage.get("dataDisks", []) if d not in removed]
            for entry, disk in added:
                stored.append(
                    {
                        "lun": entry["lun"],
                        "name": disk["name"],
                        "createOption": "Attach",
                        "caching": entry.get("caching", "None"),
                        "managedDisk": {
                            "id": disk["id"],
                            "storageAccountType": disk["sku"]["name"],
                        },
                        "deleteOption": entry.get("deleteOption", "Detach"),
                        "diskSizeGB": disk["properties"]["diskSizeGB"],
                        "toBeDetached": False,
                    }
                )
                self._set_attached(disk, vm_id)
            storage["dataDisks"] = stored
            return None

        headers = self._operation("Microsoft.Compute", vm.body["location"], complete)
        return 200, headers, vm.body

    # --- operations, activity log, prices

    def _poll(self, op_id: str, *, monitor: bool):
        op = self._ops.get(op_id)
        if op is None:
            raise ArmError(404, "NotFound", f"Operation {op_id} not found.")
        status = op.poll()
        if monitor:  # the Location URL: 202 while running, then 200 (or the error)
            if status == "InProgress":
                return 202, {"Retry-After": "0"}, None
            if status == "Failed":
                raise ArmError(409, op.error["code"], op.error["message"])
            return 200, {}, None
        body: dict[str, Any] = {"name": op_id, "status": status}
        if op.error:
            body["error"] = op.error
        return 200, {"Retry-After": "0"} if status == "InProgress" else {}, body

    def _activity(self, query: dict):
        clauses = _parse_filter(query.get("$filter", ""))
        since = clauses.get(("eventTimestamp", "ge"))
        if not since:
            raise _bad("The $filter must contain eventTimestamp ge '<time>'.", "BadRequest")
        since_dt = datetime.fromisoformat(since.replace("Z", "+00:00"))
        uri = clauses.get(("resourceUri", "eq"), "").lower()
        events = [
            e
            for e in self.activity
            if datetime.fromisoformat(e["eventTimestamp"].replace("Z", "+00:00")) >= since_dt
            and (not uri or e["resourceId"].lower() == uri)
        ]
        events.sort(key=lambda e: e["eventTimestamp"], reverse=True)  # newest first, as ARM
        skip = int(query.get("$skiptoken", "0"))
        result: dict[str, Any] = {"value": events[skip : skip + self.page_size]}
        if skip + self.page_size < len(events):
            result["nextLink"] = (
                f"{self.base_url}/subscriptions/{self.subscription_id}/providers/"
                f"microsoft.insights/eventtypes/management/values?api-version="
                f"{API_VERSION_ACTIVITY}&$filter={quote(query['$filter'])}"
                f"&$skiptoken={skip + self.page_size}"
            )
        return 200, {}, result

    def _prices(self, query: dict):
        clauses = _parse_filter(query.get("$filter", ""))
        if any(op != "eq" for _, op in clauses):
            raise _bad("Only eq filters are emulated.")
        fields = {"priceType": "type"}  # the filter name differs from the item's field
        rows = [
            row
            for row in self.prices
            if all(
                str(row.get(fields.get(k, k), "")).lower() == v.lower()
                for (k, _), v in clauses.items()
            )
        ]
        skip = int(query.get("$skip", "0"))
        page = rows[skip : skip + self.prices_page_size]
        result = {
            "BillingCurrency": "USD",
            "CustomerEntityId": "Default",
            "CustomerEntityType": "Retail",
            "Items": page,
            "Count": len(page),
            "NextPageLink": None,
        }
        if skip + self.prices_page_size < len(rows):
            result["NextPageLink"] = (
                f"{self.base_url}/api/retail/prices?$filter={quote(query['$filter'])}"
                f"&$skip={skip + self.prices_page_size}"
            )
        return 200, {}, result


def _check_rules(rules: list[dict]) -> None:
    """A group's custom rules: priorities 100-4096 (network-security-groups-overview, confirmed
    by Microsoft in MicrosoftDocs/azure-docs#115185), unique per direction (same page)."""
    seen: set[tuple[str, int]] = set()
    for rule in rules:
        props = rule.get("properties") or {}
        priority = props.get("priority")
        if not isinstance(priority, int) or not 100 <= priority <= 4096:
            raise _bad(
                f"Security rule has invalid Priority. Value provided: {priority} "
                "Allowed range 100-4096.",
                "SecurityRuleInvalidPriority",
            )
        key = (props.get("direction", ""), priority)
        if key in seen:
            raise _bad(
                f"Security rule {rule.get('name')} conflicts with another rule: rules cannot "
                "have the same Priority and Direction.",
                "SecurityRuleConflict",
            )
        seen.add(key)


def _rule_matches(rule: dict, source: str, port: int) -> bool:
    """Does an inbound NSG rule cover TCP ``port`` from internet address ``source``?"""
    if rule.get("protocol", "*") not in ("*", "Tcp"):
        return False
    prefixes = rule.get("sourceAddressPrefixes") or [rule.get("sourceAddressPrefix", "")]
    address = ipaddress.ip_address(source)

    def covers(prefix: str) -> bool:
        if prefix in ("*", "Internet"):
            return True
        try:
            return address in ipaddress.ip_network(prefix, strict=False)
        except ValueError:
            return False  # other service tags (VirtualNetwork, AzureLoadBalancer): not the internet

    ranges = rule.get("destinationPortRanges") or [rule.get("destinationPortRange", "")]

    def in_range(text: str) -> bool:
        if text == "*":
            return True
        low, _, high = text.partition("-")
        return low.isdigit() and int(low) <= port <= int(high or low)

    return any(covers(p) for p in prefixes) and any(in_range(r) for r in ranges)


def _parse_filter(text: str) -> dict[tuple[str, str], str]:
    """``a eq 'x' and b ge 'y'`` → {(a, eq): x, (b, ge): y}; anything else is a 400."""
    clauses: dict[tuple[str, str], str] = {}
    for part in filter(None, re.split(r"\s+and\s+", text.strip())):
        m = _FILTER_CLAUSE.match(part)
        if not m:
            raise _bad(f"Invalid $filter clause: {part!r}", "BadRequest")
        clauses[(m[1], m[2])] = m[3]
    return clauses


def _handler(emulator: AzureEmulator) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out in two writes

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            try:
                status, extra, body = emulator.handle(self.command, self.path, headers, raw)
            except ArmError as err:
                status, extra = err.status, err.headers
                body = {"error": {"code": err.code, "message": err.message}}
            except IdentityError as err:
                status, extra = err.status, {}
                body = {"error": err.error, "error_description": err.description}
            if status < 400 and emulator.take_loss(self.command, urlsplit(self.path).path):
                self.close_connection = True  # carried out; the answer never arrives
                return
            payload = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            for name, value in extra.items():
                self.send_header(name, value)
            self.send_header("x-ms-request-id", str(uuid.uuid4()))
            if payload:
                self.send_header("Content-Type", "application/json; charset=utf-8")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = _serve

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    return Handler


def price_row(
    region: str,
    sku: str,
    price: float,
    *,
    spot: bool = False,
    windows: bool = False,
    low_priority: bool = False,
) -> dict:
    """One Retail Prices API item in the recorded shape."""
    short = sku.removeprefix("Standard_").replace("_", " ")
    sku_name = short + (" Spot" if spot else " Low Priority" if low_priority else "")
    series = " ".join(short.split()[1:]) or short
    return {
        "currencyCode": "USD",
        "tierMinimumUnits": 0.0,
        "retailPrice": price,
        "unitPrice": price,
        "armRegionName": region,
        "location": region,
        "effectiveStartDate": "2026-01-01T00:00:00Z",
        "meterId": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{region}/{sku}/{spot}/{windows}")),
        "meterName": sku_name,
        "productId": "DZH318Z0BQ4N",
        "skuId": "DZH318Z0BQ4N/00J2",
        "productName": f"Virtual Machines {series} Series" + (" Windows" if windows else ""),
        "skuName": sku_name,
        "serviceName": "Virtual Machines",
        "serviceId": "DZH313Z7MMC8",
        "serviceFamily": "Compute",
        "unitOfMeasure": "1 Hour",
        "type": "Consumption",
        "isPrimaryMeterRegion": True,
        "armSkuName": sku,
    }
