"""A Yandex Cloud API emulator: a gRPC server with TLS on loopback that implements the SDK's own
generated servicers (ApiEndpoint, IamToken, Instance, Operation, Image, VPC Subnet, billing
Sku), so ``yandexcloud.SDK(iam_token=…, endpoint="localhost:PORT", root_certificates=pem)``
runs unmodified against it.

Control surface for tests: ``capacity_exhausted`` (zones, with ``capacity_code`` and
``capacity_in_call``), ``quota_exceeded`` (a quota id, with ``quota_details``), ``throttle(n)``,
``lose_responses(method, n)``, ``slow_polls``, ``preempt(id)``, ``add_instance(...)``,
``page_size_cap``, ``console_stop(id)``, ``console_delete(id)``, ``default_group_ssh_cidrs``;
``calls(method)`` gives what went on the wire (request + metadata); ``reachable(id)``,
``billed()`` and ``disks`` are the books a test reads. Disks (DiskService, with AttachDisk and
DetachDisk of InstanceService) follow the attach rules of ``_Disks`` below.
Requests are checked strictly: a malformed one gets INVALID_ARGUMENT and is kept in ``rejected``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import itertools
import re
import threading
import zlib
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import jwt
from google.protobuf import empty_pb2
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import status_pb2
from yandex.cloud.billing.v1 import sku_pb2, sku_service_pb2, sku_service_pb2_grpc
from yandex.cloud.compute.v1 import (
    disk_pb2,
    disk_service_pb2,
    disk_service_pb2_grpc,
    image_pb2,
    image_service_pb2_grpc,
    instance_pb2,
)
from yandex.cloud.compute.v1 import instance_service_pb2 as isvc
from yandex.cloud.compute.v1 import instance_service_pb2_grpc as isvc_grpc
from yandex.cloud.endpoint import (
    api_endpoint_pb2,
    api_endpoint_service_pb2,
    api_endpoint_service_pb2_grpc,
)
from yandex.cloud.iam.v1 import iam_token_service_pb2, iam_token_service_pb2_grpc
from yandex.cloud.operation import operation_pb2, operation_service_pb2_grpc
from yandex.cloud.quota import quota_pb2
from yandex.cloud.vpc.v1 import (
    security_group_pb2,
    security_group_service_pb2,
    security_group_service_pb2_grpc,
    subnet_pb2,
    subnet_service_pb2,
    subnet_service_pb2_grpc,
)

FOLDER = "b1gemulatorfolder001"
NETWORK = "enpnet0001"
IAM_TOKEN = "t1.emulator-iam-token"
ZONES = ("ru-central1-a", "ru-central1-b", "ru-central1-d", "ru-central1-e")
GIB = 1 << 30
# Platform → allowed (gpus, cores, memory GB); what the real API refuses, this refuses.
SHAPES = {
    "gpu-standard-v1": {(1, 8, 96), (2, 16, 192), (4, 32, 384)},
    "gpu-standard-v2": {(1, 8, 48), (2, 16, 96), (4, 32, 192), (8, 64, 384)},
    "gpu-standard-v3": {(1, 28, 119), (2, 56, 238), (4, 112, 476), (8, 224, 952)},
    "gpu-standard-v3i": {(1, 18, 144), (2, 36, 288), (4, 72, 576), (8, 180, 1440)},
    "gpu-standard-v4": {(1, 22, 220), (2, 44, 440), (4, 88, 880), (8, 180, 1800)},
    "standard-v3-t4": {(1, 4, 16), (1, 8, 32), (1, 16, 64), (1, 32, 128)},
    "standard-v3-t4i": {(1, 4, 16), (1, 8, 32), (1, 16, 64), (1, 32, 128)},
    "standard-v3": {(0, 2, 2), (0, 2, 4)},  # a small CPU VM for machines made "by hand"
}
# CreateInstanceRequest.name: "The value must match the regular expression:
# `|[a-z]([-_a-z0-9]{0,61}[a-z0-9])?`" (the empty name is taken, we never send one)
_NAME = re.compile(r"[a-z]([-_a-z0-9]{0,61}[a-z0-9])?")
_LABEL_KEY = re.compile(r"[a-z][-_./\\@0-9a-z]{0,62}")
_LABEL_VALUE = re.compile(r"[-_./\\@0-9a-z]{0,63}")


# Yandex Cloud docs, "Create a VM with a GPU" (compute/operations/vm-create/create-vm-with-gpu;
# shared/reference/clouds.md): the image family whose driver serves each platform.
DOCUMENTED_GPU_IMAGE = {
    "gpu-standard-v1": "ubuntu-2004-lts-gpu",
    "gpu-standard-v2": "ubuntu-2004-lts-gpu",
    "standard-v3-t4": "ubuntu-2004-lts-gpu",
    "gpu-standard-v3": "ubuntu-2204-lts-cuda-12-2",
    "standard-v3-t4i": "ubuntu-2204-lts-cuda-12-2",
    "gpu-standard-v3i": "ubuntu-2004-lts-secureboot-cuda-12-2",
}


# --- what Yandex answers when a zone, a quota or a limit runs out ----------------------------
# Each text is one Yandex is documented or seen to send; nothing here is made up. Where the
# source gives the text but not the gRPC code, the code is marked as assumed.

# Yandex Compute troubleshooting, "Not enough resources" error (yandex-cloud/docs
# en/compute/qa/not-enough-resources.md, en/troubleshooting/compute/known-issues/
# not-enough-resources.md; en/compute/concepts/preemptible-vm.md): a zone without hardware for
# the VM fails its creation, or a preemptible VM's start, with this error. The docs quote only
# these words, and no gRPC code: RESOURCE_EXHAUSTED is assumed (the API error table,
# en/_includes/errors-handling.md, also names INTERNAL for "insufficient computing resources";
# ``capacity_code`` switches to it). Whether the API adds words around it is not known.
NOT_ENOUGH_RESOURCES = "Not enough resources"

# RESOURCE_EXHAUSTED on InstanceService.Create when the folder has too many operations running
# (quota "concurrent operations per folder", 15: en/_includes/compute-limits.md), as logged in
# github.com/yc-actions/yc-github-runner/issues/700:
# "/yandex.cloud.compute.v1.InstanceService/Create RESOURCE_EXHAUSTED: The limit on maximum
# number of active operations has exceeded."
ACTIVE_OPERATIONS_LIMIT = "The limit on maximum number of active operations has exceeded."

# RESOURCE_EXHAUSTED at once in the answer to Create when a cloud quota is used up.
# Cores: "The limit on maximum number of cores has exceeded", seen live on Yandex Cloud
# (README of github.com/AlexeySetevoi/yandex-fleeting-plugin, "what was checked on the live
# cloud"). GPU devices (compute.instanceGpus.count = 0, the default, with gpu-standard-v2):
# "ResourceExhausted: The limit on maximum number of GPU devices has exceeded", a third-party
# note found in public code search. The final period is as in the #700 log above. The texts
# for the A100/T4/Gen2 GPU quotas are not known, so they are not offered here.
QUOTA_MESSAGES = {
    "compute.instanceGpus.count": "The limit on maximum number of GPU devices has exceeded.",
    "compute.instanceCores.count": "The limit on maximum number of cores has exceeded.",
}


@dataclass
class Call:
    method: str  # "<Service>.<Method>", e.g. "InstanceService.Create"
    request: Message
    metadata: dict[str, str]


@dataclass
class _Op:
    pb: operation_pb2.Operation
    instance_id: str
    polls_left: int
    finish: Any  # () -> None, applied once when the operation completes


@dataclass
class _Throttle:
    remaining: int
    code: grpc.StatusCode
    message: str
    methods: set[str] | None


@dataclass
class YandexEmulator:
    cert_pem: bytes
    key_pem: bytes
    tokens: set[str] = field(default_factory=lambda: {IAM_TOKEN})
    oauth_tokens: set[str] = field(default_factory=set)
    service_account_keys: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    subnets: dict[str, str] = field(
        default_factory=lambda: {z: f"e9bsubnet{z[-1]}0000000000" for z in ZONES}
    )
    # The public GPU image families (standard-images) that Yandex's "Create a VM with a GPU"
    # docs name, each the latest of its family here.
    images: dict[tuple[str, str], str] = field(
        default_factory=lambda: {
            ("standard-images", "ubuntu-2004-lts-gpu"): "fd8gpuimage000000001",
            ("standard-images", "ubuntu-2204-lts-cuda-12-2"): "fd8cuda122image00002",
            ("standard-images", "ubuntu-2004-lts-secureboot-cuda-12-2"): "fd8sbcuda122image003",
        }
    )
    boot_images: dict[str, str] = field(default_factory=dict)  # instance id → image id
    skus: list[sku_pb2.Sku] = field(default_factory=list)
    page_size_cap: int = 1000
    # Test infra, not Compute Cloud: every one-to-one NAT address this emulator assigns ("An
    # external IP address associated with this instance", OneToOneNat.address in
    # yandex/cloud/compute/v1/instance.proto) is this one, e.g. 127.0.0.1 where a test's sshd
    # listens; None: its own 51.250.x.y addresses.
    public_address: str | None = None
    capacity_exhausted: set[str] = field(default_factory=set)  # zones with no stock
    capacity_code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED  # assumed, see above
    capacity_in_call: bool = False  # refuse Create itself instead of failing its operation
    quota_exceeded: str | None = None  # a key of QUOTA_MESSAGES: that quota is used up
    # Also attach a yandex.cloud.quota.QuotaFailure (public cloudapi, yandex/cloud/quota/
    # quota.proto) to the quota error. Whether Compute does is not confirmed: off by default.
    quota_details: bool = False
    slow_polls: int = 0
    requests: list[Call] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    instances: dict[str, instance_pb2.Instance] = field(default_factory=dict)
    # Every disk, boot or not: id → {"instance_id", "auto_delete", "pb" (its Disk)}; a disk
    # outlives its instance unless auto_delete ("Specifies whether the disk will be auto-deleted
    # when the instance is deleted", AttachedDiskSpec.auto_delete in
    # yandex/cloud/compute/v1/instance_service.proto).
    disks: dict[str, dict] = field(default_factory=dict)
    # Who reaches TCP 22 through the network's default security group, which every VM without
    # a group of its own gets. Yandex creates it admitting SSH (22/TCP) from 0.0.0.0/0, RDP,
    # ICMP, all traffic from its members, and all outgoing traffic (yandex-cloud/docs
    # en/vpc/concepts/security-groups.md, "Default security group rules"). A test narrows it
    # as a user editing that group would.
    default_group_ssh_cidrs: tuple[str, ...] = ("0.0.0.0/0",)
    security_groups: dict[str, security_group_pb2.SecurityGroup] = field(default_factory=dict)
    # the Billing usage API's books (tests/emulators/yandex_billing.py): `provisioner bill`
    usage_records: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.RLock()
        self._ops: dict[str, _Op] = {}
        self._by_key: dict[str, str] = {}
        self._throttles: list[_Throttle] = []
        self._lose: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._nat = itertools.count(7)
        self._clock = dt.datetime(2026, 11, 30, 9, 0, tzinfo=dt.UTC)
        self._server: grpc.Server | None = None
        self.port = 0

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> YandexEmulator:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        creds = grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])
        self.port = server.add_secure_port("localhost:0", creds)
        api_endpoint_service_pb2_grpc.add_ApiEndpointServiceServicer_to_server(
            _Endpoints(self), server
        )
        iam_token_service_pb2_grpc.add_IamTokenServiceServicer_to_server(_Iam(self), server)
        isvc_grpc.add_InstanceServiceServicer_to_server(_Instances(self), server)
        operation_service_pb2_grpc.add_OperationServiceServicer_to_server(_Operations(self), server)
        image_service_pb2_grpc.add_ImageServiceServicer_to_server(_Images(self), server)
        disk_service_pb2_grpc.add_DiskServiceServicer_to_server(_Disks(self), server)
        subnet_service_pb2_grpc.add_SubnetServiceServicer_to_server(_Subnets(self), server)
        security_group_service_pb2_grpc.add_SecurityGroupServiceServicer_to_server(
            _SecurityGroups(self), server
        )
        sku_service_pb2_grpc.add_SkuServiceServicer_to_server(_Skus(self), server)
        from tests.emulators import yandex_billing  # the Billing usage API

        yandex_billing.consumption_core_service_pb2_grpc.add_ConsumptionCoreServiceServicer_to_server(
            yandex_billing.Consumption(self), server
        )
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)

    @property
    def endpoint(self) -> str:
        return f"localhost:{self.port}"

    # --- control surface -----------------------------------------------------------------------

    def throttle(
        self,
        n: int,
        code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED,
        message: str = ACTIVE_OPERATIONS_LIMIT,
        methods: set[str] | None = None,
    ) -> None:
        """The next ``n`` authenticated calls (of ``methods``, default all) fail."""
        self._throttles.append(_Throttle(n, code, message, methods))

    def lose_responses(self, method: str, n: int = 1) -> None:
        """Carry out the next ``n`` calls of ``method`` but answer UNAVAILABLE, as when the
        response is lost on the way back."""
        self._lose[method] = n

    def preempt(self, instance_id: str, *, record_operation: bool = True) -> None:
        """Yandex takes a preemptible machine back: it goes STOPPED, and (by default) a
        PreemptInstance operation is recorded in its history."""
        with self._lock:
            inst = self.instances[instance_id]
            assert inst.scheduling_policy.preemptible, "only preemptible VMs are preempted"
            inst.status = instance_pb2.Instance.STOPPED
            self.release_public_address(inst)
            if record_operation:
                op = self._new_op(
                    "Preempt instance",
                    isvc.PreemptInstanceMetadata(instance_id=instance_id),
                    instance_id,
                    created_by="",
                )
                op.pb.done = True

    def console_stop(self, instance_id: str) -> None:
        """A person stops the machine in the console: STOPPED, with a "Stop instance" operation
        by that user in its history (what InstanceService.ListOperations shows)."""
        with self._lock:
            inst = self.instances[instance_id]
            inst.status = instance_pb2.Instance.STOPPED
            self.release_public_address(inst)
            op = self._new_op(
                "Stop instance",
                isvc.StopInstanceMetadata(instance_id=instance_id),
                instance_id,
                created_by="ajeconsoleuser000001",
            )
            op.pb.done = True

    def guest_shutdown(self, instance_id: str) -> None:
        """The machine's OS powers itself off: it goes STOPPED (Yandex Compute Cloud, "VM
        statuses": STOPPED, "VM is stopped", the one halted status), and "The time when the VM
        is stopped is not charged" for its vCPUs, RAM and GPUs (Compute Cloud pricing policy,
        as ``billed_instances`` reads it). Its docs say nothing of a power-off from inside
        besides: no API call made it, so no operation of its history records it and nothing
        dates it (the Instance message has only ``created_at``)."""
        with self._lock:
            inst = self.instances[instance_id]
            inst.status = instance_pb2.Instance.STOPPED
            self.release_public_address(inst)

    def console_delete(self, instance_id: str) -> None:
        """Someone deletes the machine outside provisioner: Get answers NOT_FOUND."""
        with self._lock:
            self.remove_instance(instance_id)

    def remove_instance(self, instance_id: str) -> None:
        """The instance goes, and its auto-delete disks with it; other disks stay (and bill)."""
        self.instances.pop(instance_id, None)
        for disk_id, disk in list(self.disks.items()):
            if disk["instance_id"] == instance_id:
                if disk["auto_delete"]:
                    del self.disks[disk_id]
                else:  # "they will be disabled when the VM is deleted. Disk data is preserved"
                    disk["instance_id"] = None
                    del disk["pb"].instance_ids[:]

    def assign_public_address(self, inst: instance_pb2.Instance) -> None:
        """A dynamic one-to-one NAT address for an interface that asked for one."""
        address = inst.network_interfaces[0].primary_v4_address
        if address.HasField("one_to_one_nat"):
            address.one_to_one_nat.address = (
                self.public_address or f"51.250.{next(self._nat) % 250}.{next(self._nat) % 250}"
            )

    def release_public_address(self, inst: instance_pb2.Instance) -> None:
        """ "When a VM with a dynamic public IP is stopped, its address is released, and it gets
        a new public IP address when started next time" (yandex-cloud/docs
        en/vpc/concepts/address.md, "Public addresses")."""
        address = inst.network_interfaces[0].primary_v4_address
        if address.HasField("one_to_one_nat"):
            address.one_to_one_nat.address = ""

    def reachable(self, instance_id: str, port: int = 22, *, source: str = "203.0.113.7") -> bool:
        """Can ``source`` (an internet address) open TCP ``port`` on the instance? Only when it
        runs with a public (one-to-one NAT) address, and its security groups admit it: with
        none of its own, the network's default group (see ``default_group_ssh_cidrs``; RDP's
        3389 is open there too)."""
        with self._lock:
            inst = self.instances.get(instance_id)
            if inst is None or inst.status != instance_pb2.Instance.RUNNING:
                return False
            nic = inst.network_interfaces[0]
            if not nic.primary_v4_address.one_to_one_nat.address:
                return False
            address = ipaddress.ip_address(source)
            if not nic.security_group_ids:
                cidrs = {22: self.default_group_ssh_cidrs, 3389: ("0.0.0.0/0",)}.get(port, ())
                return any(address in ipaddress.ip_network(c) for c in cidrs)
            return self._admitted(nic.security_group_ids, "INGRESS", address, port)

    def outbound_internet(self, instance_id: str) -> bool:
        """Can the instance open a connection to the internet (the agent reporting home)? A
        public address, and an egress rule: a group "operates on the principle of 'what is not
        allowed is forbidden'" (security-groups.md); the default group allows all egress."""
        with self._lock:
            nic = self.instances[instance_id].network_interfaces[0]
            if not nic.primary_v4_address.one_to_one_nat.address:
                return False
            if not nic.security_group_ids:
                return True
            return self._admitted(nic.security_group_ids, "EGRESS", None, 443)

    def _admitted(self, group_ids: Any, direction: str, address: Any, port: int) -> bool:
        """Rules of all the interface's groups count; one that matches admits (docs: "a VM
        may receive traffic that falls under at least one of the rules")."""
        for group_id in group_ids:
            for rule in self.security_groups[group_id].rules:
                if security_group_pb2.SecurityGroupRule.Direction.Name(rule.direction) != direction:
                    continue
                if rule.protocol_name not in ("TCP", "ANY"):
                    continue
                if (
                    rule.HasField("ports")
                    and not rule.ports.from_port <= port <= rule.ports.to_port
                ):
                    continue
                blocks = rule.cidr_blocks.v4_cidr_blocks
                if address is None:
                    if "0.0.0.0/0" in blocks:
                        return True
                elif any(address in ipaddress.ip_network(c) for c in blocks):
                    return True
        return False

    def billed(self) -> list[str]:
        """What bills: every instance not STOPPED ("The time when the VM is stopped is not
        charged"), and every disk ("You are charged for disks regardless of whether the VM is
        running"): yandex-cloud/docs en/compute/pricing.md, "VM usage", "Use of storage"."""
        with self._lock:
            running = [i for i, inst in self.instances.items() if inst.status != inst.STOPPED]
            return running + list(self.disks)

    def add_instance(
        self,
        name: str,
        labels: dict[str, str],
        zone: str = "ru-central1-a",
        preemptible: bool = False,
    ) -> str:
        """A machine made outside provisioner (console, terraform), RUNNING."""
        with self._lock:
            inst = self._instance(
                name=name,
                zone=zone,
                labels=labels,
                platform="standard-v3",
                resources=instance_pb2.Resources(memory=2 * GIB, cores=2, core_fraction=100),
                preemptible=preemptible,
                subnet=self.subnets[zone],
                metadata={},
            )
            inst.status = instance_pb2.Instance.RUNNING
            return inst.id

    def gpu_driver_works(self, instance_id: str) -> bool:
        """Whether the instance booted an image whose driver serves its platform's GPUs: the
        pairing of Yandex's GPU docs (ubuntu-2004-lts-gpu has the driver for V100 and T4
        only; A100 and T4i need the CUDA 12.2 image, Gen2 the secure-boot one). The real
        cloud boots any image; the GPU just stays invisible, which the agent then reports."""
        platform = self.instances[instance_id].platform_id
        family = next(f for (_, f), i in self.images.items() if i == self.boot_images[instance_id])
        return family == DOCUMENTED_GPU_IMAGE.get(platform)

    def add_disk(
        self, *, name: str, zone: str, size: int, type_id: str, labels: dict[str, str]
    ) -> disk_pb2.Disk:
        """A READY disk in the folder (a boot disk, or one made outside provisioner)."""
        with self._lock:
            disk = disk_pb2.Disk(
                id=f"fhm{next(self._ids):017d}",  # 20 characters, as Yandex ids are
                folder_id=FOLDER,
                created_at=self.now(),
                name=name,
                labels=labels,
                type_id=type_id,
                zone_id=zone,
                size=size,
                block_size=4096,
                status=disk_pb2.Disk.READY,
            )
            self.disks[disk.id] = {"instance_id": None, "auto_delete": False, "pb": disk}
            return disk

    def attach(
        self,
        disk_id: str,
        inst: instance_pb2.Instance,
        *,
        auto_delete: bool,
        boot: bool = False,
        device_name: str = "",
    ) -> None:
        """The disk is attached to the instance: both sides of the books."""
        disk = self.disks[disk_id]
        disk.update(instance_id=inst.id, auto_delete=auto_delete)
        disk["pb"].instance_ids[:] = [inst.id]
        attached = instance_pb2.AttachedDisk(
            mode=instance_pb2.AttachedDisk.READ_WRITE,
            device_name=device_name or disk_id,
            auto_delete=auto_delete,
            disk_id=disk_id,
        )
        if boot:
            inst.boot_disk.CopyFrom(attached)
        else:
            inst.secondary_disks.append(attached)

    def detach(self, disk_id: str, inst: instance_pb2.Instance) -> None:
        disk = self.disks[disk_id]
        disk["instance_id"] = None
        del disk["pb"].instance_ids[:]
        kept = [d for d in inst.secondary_disks if d.disk_id != disk_id]
        del inst.secondary_disks[:]
        inst.secondary_disks.extend(kept)

    def calls(self, method: str) -> list[Call]:
        return [c for c in self.requests if c.method == method]

    # --- plumbing used by the servicers --------------------------------------------------------

    def begin(self, method: str, request: Message, context: grpc.ServicerContext) -> None:
        """Record the call, check its credentials, apply throttling."""
        metadata = dict(context.invocation_metadata())
        with self._lock:
            self.requests.append(Call(method, _copy(request), metadata))
            if method.startswith(("ApiEndpointService.", "IamTokenService.")):
                return  # these two are called without a token, as on the real API
            auth = metadata.get("authorization", "")
            if not auth.startswith("Bearer "):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "Authorization header is missing")
            if auth.removeprefix("Bearer ") not in self.tokens:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "The token is invalid")
            for t in self._throttles:
                if t.remaining > 0 and (t.methods is None or method in t.methods):
                    t.remaining -= 1
                    context.abort(t.code, t.message)

    def reply(self, method: str, response: Message, context: grpc.ServicerContext) -> Message:
        with self._lock:
            if self._lose.get(method, 0) > 0:
                self._lose[method] -= 1
                context.abort(grpc.StatusCode.UNAVAILABLE, "Connection reset by peer")
        return response

    def not_enough_resources(self) -> status_pb2.Status:
        """The documented capacity error, as a failed operation carries it."""
        return status_pb2.Status(code=self.capacity_code.value[0], message=NOT_ENOUGH_RESOURCES)

    def refuse_quota(self, context: grpc.ServicerContext) -> None:
        """Answer the call with the quota error of ``quota_exceeded``."""
        quota = self.quota_exceeded or ""
        message = QUOTA_MESSAGES[quota]
        if self.quota_details:
            failure = quota_pb2.QuotaFailure(
                violations=[
                    quota_pb2.QuotaFailure.Violation(
                        metric=quota_pb2.QuotaMetric(name=quota, limit=0, usage=0), required=1
                    )
                ]
            )
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            status = status_pb2.Status(code=code.value[0], message=message)
            status.details.add().Pack(failure)
            # how gRPC carries a google.rpc.Status with details (grpcio-status does the same)
            context.set_trailing_metadata([("grpc-status-details-bin", status.SerializeToString())])
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    def invalid(self, method: str, context: grpc.ServicerContext, message: str) -> None:
        self.rejected.append((method, message))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    def new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):017d}"

    def now(self) -> Timestamp:
        self._clock += dt.timedelta(seconds=1)  # strictly increasing: history has an order
        ts = Timestamp()
        ts.FromDatetime(self._clock)
        return ts

    def _instance(
        self, *, name, zone, labels, platform, resources, preemptible, subnet, metadata
    ) -> instance_pb2.Instance:
        n = next(self._ids)
        inst = instance_pb2.Instance(
            id=f"fhm{n:017d}",
            folder_id=FOLDER,
            created_at=self.now(),
            name=name,
            labels=labels,
            zone_id=zone,
            platform_id=platform,
            resources=resources,
            status=instance_pb2.Instance.PROVISIONING,
            metadata=metadata,
            scheduling_policy=instance_pb2.SchedulingPolicy(preemptible=preemptible),
            network_interfaces=[
                instance_pb2.NetworkInterface(
                    index="0",
                    subnet_id=subnet,
                    primary_v4_address=instance_pb2.PrimaryAddress(address=f"10.0.0.{n % 250}"),
                )
            ],
        )
        self.instances[inst.id] = inst
        return inst

    def _new_op(
        self,
        description: str,
        meta: Message,
        instance_id: str,
        *,
        created_by: str = "ajeemulatoruser00001",
        finish: Any = None,
    ) -> _Op:
        pb = operation_pb2.Operation(
            id=self.new_id("fhmop"),
            description=description,
            created_at=self.now(),
            created_by=created_by,
            done=False,
        )
        pb.modified_at.CopyFrom(pb.created_at)
        pb.metadata.Pack(meta)
        op = _Op(pb, instance_id, self.slow_polls, finish or (lambda: None))
        self._ops[pb.id] = op
        return op

    def _poll(self, op_id: str) -> operation_pb2.Operation | None:
        with self._lock:
            op = self._ops.get(op_id)
            if op is None:
                return None
            if not op.pb.done:
                if op.polls_left > 0:
                    op.polls_left -= 1
                else:
                    op.finish()
                    op.pb.done = True
                    op.pb.modified_at.CopyFrom(self.now())
            return _copy(op.pb)


def _copy(message: Message) -> Any:
    out = type(message)()
    out.CopyFrom(message)
    return out


def _page(items: list, page_size: int, token: str, cap: int) -> tuple[list, str]:
    start = int(token or 0)
    size = min(page_size or 100, cap)
    end = start + size
    return items[start:end], (str(end) if end < len(items) else "")


class _Endpoints(api_endpoint_service_pb2_grpc.ApiEndpointServiceServicer):
    IDS = ("compute", "operation", "iam", "billing", "vpc", "resource-manager", "endpoint")

    def __init__(self, emu: YandexEmulator) -> None:
        self.emu = emu

    def List(self, request, context):
        self.emu.begin("ApiEndpointService.List", request, context)
        return api_endpoint_service_pb2.ListApiEndpointsResponse(
            endpoints=[
                api_endpoint_pb2.ApiEndpoint(id=i, address=self.emu.endpoint) for i in self.IDS
            ]
        )

    def Get(self, request, context):
        self.emu.begin("ApiEndpointService.Get", request, context)
        if request.api_endpoint_id not in self.IDS:
            context.abort(grpc.StatusCode.NOT_FOUND, "endpoint not found")
        return api_endpoint_pb2.ApiEndpoint(id=request.api_endpoint_id, address=self.emu.endpoint)


class _Iam(iam_token_service_pb2_grpc.IamTokenServiceServicer):
    """OAuth token or service-account JWT (PS256, verified against the registered key) →
    a fresh IAM token that the other services then accept."""

    def __init__(self, emu: YandexEmulator) -> None:
        self.emu = emu

    def Create(self, request, context):
        emu = self.emu
        emu.begin("IamTokenService.Create", request, context)
        kind = request.WhichOneof("identity")
        if kind == "yandex_passport_oauth_token":
            if request.yandex_passport_oauth_token not in emu.oauth_tokens:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "OAuth token is invalid")
        elif kind == "jwt":
            try:
                key_id = jwt.get_unverified_header(request.jwt)["kid"]
                sa_id, public_pem = emu.service_account_keys[key_id]
                claims = jwt.decode(
                    request.jwt, public_pem, algorithms=["PS256"], options={"verify_aud": False}
                )
                assert claims["iss"] == sa_id
            except (KeyError, AssertionError, jwt.PyJWTError) as exc:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"JWT is invalid: {exc!r}")
        else:
            emu.invalid("IamTokenService.Create", context, "identity is required")
        token = emu.new_id("t1.issued-")
        emu.tokens.add(token)
        return iam_token_service_pb2.CreateIamTokenResponse(iam_token=token)


class _Instances(isvc_grpc.InstanceServiceServicer):
    def __init__(self, emu: YandexEmulator) -> None:
        self.emu = emu

    def _find(self, instance_id: str, context) -> instance_pb2.Instance:
        inst = self.emu.instances.get(instance_id)
        if inst is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"Instance {instance_id} not found")
        return inst

    def Get(self, request, context):
        self.emu.begin("InstanceService.Get", request, context)
        with self.emu._lock:
            return _copy(self._find(request.instance_id, context))

    def List(self, request, context):
        emu = self.emu
        emu.begin("InstanceService.List", request, context)
        if request.folder_id != FOLDER:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"folder {request.folder_id}")
        if request.filter:
            emu.invalid("InstanceService.List", context, "filter is not supported here")
        with emu._lock:
            items = [_copy(i) for i in emu.instances.values()]
        page, token = _page(items, request.page_size, request.page_token, emu.page_size_cap)
        return isvc.ListInstancesResponse(instances=page, next_page_token=token)

    def ListOperations(self, request, context):
        emu = self.emu
        emu.begin("InstanceService.ListOperations", request, context)
        with emu._lock:
            self._find(request.instance_id, context)
            ops = [
                _copy(o.pb)
                for o in reversed(emu._ops.values())
                if o.instance_id == request.instance_id
            ]
        page, token = _page(ops, request.page_size, request.page_token, emu.page_size_cap)
        return isvc.ListInstanceOperationsResponse(operations=page, next_page_token=token)

    def Create(self, request, context):
        emu = self.emu
        method = "InstanceService.Create"
        emu.begin(method, request, context)
        problem = _create_problem(emu, request)
        if problem:
            emu.invalid(method, context, problem)
        key = dict(context.invocation_metadata()).get("idempotency-key")
        with emu._lock:
            if key and key in emu._by_key:
                return emu.reply(method, _copy(emu._ops[emu._by_key[key]].pb), context)
            if emu.quota_exceeded:
                emu.refuse_quota(context)
            if emu.capacity_in_call and request.zone_id in emu.capacity_exhausted:
                context.abort(emu.capacity_code, NOT_ENOUGH_RESOURCES)
            if any(i.name == request.name for i in emu.instances.values()):
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"Instance with name {request.name} already exists",
                )
            spec = request.network_interface_specs[0]
            inst = emu._instance(
                name=request.name,
                zone=request.zone_id,
                labels=dict(request.labels),
                platform=request.platform_id,
                resources=instance_pb2.Resources(
                    memory=request.resources_spec.memory,
                    cores=request.resources_spec.cores,
                    core_fraction=request.resources_spec.core_fraction,
                    gpus=request.resources_spec.gpus,
                ),
                preemptible=request.scheduling_policy.preemptible,
                subnet=spec.subnet_id,
                metadata=dict(request.metadata),
            )
            emu.boot_images[inst.id] = request.boot_disk_spec.disk_spec.image_id
            disk = request.boot_disk_spec.disk_spec
            disk_id = emu.add_disk(
                name="", zone=request.zone_id, size=disk.size, type_id=disk.type_id, labels={}
            ).id
            emu.attach(disk_id, inst, auto_delete=request.boot_disk_spec.auto_delete, boot=True)
            inst.boot_disk.disk_id = disk_id
            inst.boot_disk.auto_delete = request.boot_disk_spec.auto_delete
            nat_spec = spec.primary_v4_address_spec.one_to_one_nat_spec
            if spec.primary_v4_address_spec.HasField("one_to_one_nat_spec"):
                nat = inst.network_interfaces[0].primary_v4_address.one_to_one_nat
                nat.SetInParent()
                nat.ip_version = nat_spec.ip_version
            inst.network_interfaces[0].security_group_ids.extend(spec.security_group_ids)
            out_of_stock = request.zone_id in emu.capacity_exhausted

            def finish() -> None:
                if out_of_stock:
                    emu.remove_instance(inst.id)
                    op.pb.error.CopyFrom(emu.not_enough_resources())
                    return
                inst.status = instance_pb2.Instance.RUNNING
                emu.assign_public_address(inst)
                op.pb.response.Pack(inst)

            op = emu._new_op(
                "Create instance",
                isvc.CreateInstanceMetadata(instance_id=inst.id),
                inst.id,
                finish=finish,
            )
            if key:
                emu._by_key[key] = op.pb.id
            return emu.reply(method, _copy(op.pb), context)

    def _transition(
        self,
        method: str,
        request,
        context,
        *,
        allowed,
        during,
        after,
        meta: Message,
        description: str,
        response: str,
        capacity_checked: bool = False,
    ):
        emu = self.emu
        emu.begin(method, request, context)
        key = dict(context.invocation_metadata()).get("idempotency-key")
        with emu._lock:
            if key and key in emu._by_key:
                return emu.reply(method, _copy(emu._ops[emu._by_key[key]].pb), context)
            inst = self._find(request.instance_id, context)
            if inst.status not in allowed:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"Instance {inst.id} is {instance_pb2.Instance.Status.Name(inst.status)}",
                )
            inst.status = during
            # Yandex checks capacity again when a preemptible VM starts (docs, "Not enough
            # resources" error): in a zone with no stock the start fails and the VM stays put.
            out_of_stock = (
                capacity_checked
                and inst.scheduling_policy.preemptible
                and inst.zone_id in emu.capacity_exhausted
            )

            def finish() -> None:
                if out_of_stock:
                    inst.status = instance_pb2.Instance.STOPPED
                    op.pb.error.CopyFrom(emu.not_enough_resources())
                    return
                if after is None:
                    emu.remove_instance(inst.id)
                    op.pb.response.Pack(empty_pb2.Empty())
                    return
                inst.status = after
                if after == instance_pb2.Instance.STOPPED:
                    emu.release_public_address(inst)
                elif after == instance_pb2.Instance.RUNNING:
                    emu.assign_public_address(inst)
                op.pb.response.Pack(inst if response == "instance" else empty_pb2.Empty())

            op = emu._new_op(description, meta, inst.id, finish=finish)
            if key:
                emu._by_key[key] = op.pb.id
            return emu.reply(method, _copy(op.pb), context)

    def Stop(self, request, context):
        s = instance_pb2.Instance
        return self._transition(
            "InstanceService.Stop",
            request,
            context,
            allowed={s.RUNNING},
            during=s.STOPPING,
            after=s.STOPPED,
            meta=isvc.StopInstanceMetadata(instance_id=request.instance_id),
            description="Stop instance",
            response="empty",
        )

    def Start(self, request, context):
        s = instance_pb2.Instance
        return self._transition(
            "InstanceService.Start",
            request,
            context,
            allowed={s.STOPPED},
            during=s.STARTING,
            after=s.RUNNING,
            meta=isvc.StartInstanceMetadata(instance_id=request.instance_id),
            description="Start instance",
            response="instance",
            capacity_checked=True,
        )

    def Delete(self, request, context):
        s = instance_pb2.Instance
        return self._transition(
            "InstanceService.Delete",
            request,
            context,
            allowed={s.RUNNING, s.STOPPED, s.ERROR, s.CRASHED},
            during=s.DELETING,
            after=None,
            meta=isvc.DeleteInstanceMetadata(instance_id=request.instance_id),
            description="Delete instance",
            response="empty",
        )

    # --- disks: AttachDisk / DetachDisk (the rules are _Disks's) ---------------------------

    def AttachDisk(self, request, context):
        emu = self.emu
        method = "InstanceService.AttachDisk"
        emu.begin(method, request, context)
        spec = request.attached_disk_spec
        if spec.WhichOneof("disk") != "disk_id":
            emu.invalid(method, context, "attached_disk_spec.disk_id is required here")
        if spec.device_name and not _DEVICE_NAME.fullmatch(spec.device_name):
            emu.invalid(method, context, f"device_name {spec.device_name!r} is invalid")
        key = dict(context.invocation_metadata()).get("idempotency-key")
        with emu._lock:
            if key and key in emu._by_key:
                return emu.reply(method, _copy(emu._ops[emu._by_key[key]].pb), context)
            inst = self._find(request.instance_id, context)
            s = instance_pb2.Instance
            if inst.status not in (s.RUNNING, s.STOPPED):  # "either a running or stopped VM"
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"Instance {inst.id} is {s.Status.Name(inst.status)}",
                )
            disk = _Disks.find(emu, spec.disk_id, context)
            if disk["instance_id"] is not None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, _attached(spec.disk_id))
            if disk["pb"].zone_id != inst.zone_id:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"Disk {spec.disk_id} is in zone {disk['pb'].zone_id}, instance {inst.id} "
                    f"in {inst.zone_id}",
                )
            names = {d.device_name for d in (inst.boot_disk, *inst.secondary_disks)}
            if (spec.device_name or spec.disk_id) in names:
                emu.invalid(method, context, f"device_name {spec.device_name!r} is taken")
            emu.attach(
                spec.disk_id, inst, auto_delete=spec.auto_delete, device_name=spec.device_name
            )
            meta = isvc.AttachInstanceDiskMetadata(instance_id=inst.id, disk_id=spec.disk_id)
            op = emu._new_op("Attach disk", meta, inst.id)
            op.finish = lambda: op.pb.response.Pack(inst)
            if key:
                emu._by_key[key] = op.pb.id
            return emu.reply(method, _copy(op.pb), context)

    def DetachDisk(self, request, context):
        emu = self.emu
        method = "InstanceService.DetachDisk"
        emu.begin(method, request, context)
        key = dict(context.invocation_metadata()).get("idempotency-key")
        with emu._lock:
            if key and key in emu._by_key:
                return emu.reply(method, _copy(emu._ops[emu._by_key[key]].pb), context)
            inst = self._find(request.instance_id, context)
            attached = next(
                (
                    d
                    for d in inst.secondary_disks
                    if request.disk_id in ("", d.disk_id)
                    and request.device_name in ("", d.device_name)
                ),
                None,
            )
            if attached is None or not (request.disk_id or request.device_name):
                # what Yandex answers here is not documented: a test failing on it says the
                # adapter asked to detach a disk it had not checked was attached there
                emu.invalid(method, context, "the disk is not a secondary disk of the instance")
            disk_id = attached.disk_id
            emu.detach(disk_id, inst)
            meta = isvc.DetachInstanceDiskMetadata(instance_id=inst.id, disk_id=disk_id)
            op = emu._new_op("Detach disk", meta, inst.id)
            op.finish = lambda: op.pb.response.Pack(inst)
            if key:
                emu._by_key[key] = op.pb.id
            return emu.reply(method, _copy(op.pb), context)


def _create_problem(emu: YandexEmulator, r: isvc.CreateInstanceRequest) -> str | None:
    """What the real API would refuse in a CreateInstanceRequest, or None."""
    res = r.resources_spec
    shape = (res.gpus, res.cores, res.memory // GIB)
    disk = r.boot_disk_spec.disk_spec
    nics = r.network_interface_specs
    checks = [
        (r.folder_id == FOLDER, f"folder_id {r.folder_id!r} is unknown"),
        (bool(_NAME.fullmatch(r.name)), f"name {r.name!r} is invalid"),
        (r.zone_id in ZONES, f"zone_id {r.zone_id!r} is unknown"),
        (r.platform_id in SHAPES, f"platform_id {r.platform_id!r} is unknown"),
        (res.memory % GIB == 0, "memory must be a whole number of GB"),
        (shape in SHAPES.get(r.platform_id, ()), f"{shape} is not allowed on {r.platform_id}"),
        (res.core_fraction == 100, "GPU platforms need core_fraction 100"),
        (len(r.labels) <= 64, "at most 64 labels"),
        (all(_LABEL_KEY.fullmatch(k) for k in r.labels), f"bad label key in {dict(r.labels)}"),
        (
            all(_LABEL_VALUE.fullmatch(v) for v in r.labels.values()),
            f"bad label value in {dict(r.labels)}",
        ),
        (
            r.HasField("boot_disk_spec") and r.boot_disk_spec.HasField("disk_spec"),
            "boot_disk_spec.disk_spec is required",
        ),
        (disk.image_id in emu.images.values(), f"image {disk.image_id!r} not found"),
        (disk.size >= 20 * GIB and disk.size % GIB == 0, f"disk size {disk.size} is invalid"),
        (len(nics) == 1, "exactly one network interface expected"),
        (
            bool(nics) and emu.subnets.get(r.zone_id) == nics[0].subnet_id,
            f"subnet {nics[0].subnet_id if nics else ''!r} is not in zone {r.zone_id}",
        ),
        # CreateInstanceRequest.metadata (yandexcloud's instance_service.proto): "The total
        # size of all keys and values must be less than 512 KB. ... The values must be 256 KB
        # or less." (the wording of Yandex's refusal is not documented)
        (
            all(len(v.encode()) <= 256 * 1024 for v in r.metadata.values()),
            "metadata value is over 256 KB",
        ),
        (
            sum(len(k.encode()) + len(v.encode()) for k, v in r.metadata.items()) < 512 * 1024,
            "metadata is 512 KB or more",
        ),
        (
            all(
                g in emu.security_groups and emu.security_groups[g].network_id == NETWORK
                for n in nics
                for g in n.security_group_ids
            ),
            "a security group is unknown or in another network than the subnet",
        ),
    ]
    return next((msg for ok, msg in checks if not ok), None)


# --- disks ----------------------------------------------------------------------------------
# The rules, each from Yandex's own words:
#  * "You can attach a secondary disk to either a running or stopped VM" (yandex-cloud/docs
#    en/compute/operations/vm-control/vm-attach-disk.md); another status: FAILED_PRECONDITION
#    as for Start/Stop here.
#  * "Disks can only be attached to one VM at a time. The disk and VM must be located in the same
#    availability zone." and "If previously created disks were connected to the VM, they will be
#    disabled when the VM is deleted. Disk data is preserved" (yandex-cloud/docs
#    en/compute/concepts/disk.md, "Attaching and detaching disks"); ``remove_instance`` keeps
#    every disk not attached with auto_delete.
#  * Deleting an attached disk: FAILED_PRECONDITION 'Disk "<id>" has an invalid state for this
#    operation: attached to instance' (seen live: yandex-cloud/terraform-provider-yandex#222).
#    AttachDisk of a disk attached elsewhere is answered the same way here: the same state
#    check is assumed, its text is not documented for AttachDisk. Nor is the answer to a disk of
#    another zone: FAILED_PRECONDITION with a text of ours is assumed.
#  * Field rules from the SDK's compute/v1 protos: disk name ``|[a-z]([-_a-z0-9]{0,61}[a-z0-9])?``,
#    size 4194304..28587302322176 bytes (CreateDiskRequest); device_name
#    ``[a-z][a-z0-9-_]{,19}`` (AttachedDiskSpec); ListDisks "filtering only on the limited number
#    of fields" (served: ``name = "<name>"``). Disk types: network-ssd, network-hdd,
#    network-ssd-nonreplicated (en/compute/concepts/disk.md, "Disk types").
_DISK_NAME = re.compile(r"([a-z]([-_a-z0-9]{0,61}[a-z0-9])?)?")
_DEVICE_NAME = re.compile(r"[a-z][a-z0-9-_]{0,19}")
_DISK_TYPES = {"network-ssd", "network-hdd", "network-ssd-nonreplicated"}
_NAME_FILTER = re.compile(r"""name\s*=\s*(["'])(.*)\1""")


def _attached(disk_id: str) -> str:
    return f'Disk "{disk_id}" has an invalid state for this operation: attached to instance'


class _Disks(disk_service_pb2_grpc.DiskServiceServicer):
    def __init__(self, emu: YandexEmulator) -> None:
        self.emu = emu

    @staticmethod
    def find(emu: YandexEmulator, disk_id: str, context) -> dict:
        disk = emu.disks.get(disk_id)
        if disk is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"Disk {disk_id} not found")
        return disk

    def Get(self, request, context):
        self.emu.begin("DiskService.Get", request, context)
        with self.emu._lock:
            return _copy(self.find(self.emu, request.disk_id, context)["pb"])

    def List(self, request, context):
        emu = self.emu
        emu.begin("DiskService.List", request, context)
        if request.folder_id != FOLDER:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"folder {request.folder_id}")
        name = None
        if request.filter:
            m = _NAME_FILTER.fullmatch(request.filter.strip())
            if m is None:
                emu.invalid("DiskService.List", context, f"filter {request.filter!r}")
            name = m.group(2)
        with emu._lock:
            items = [
                _copy(d["pb"]) for d in emu.disks.values() if name is None or d["pb"].name == name
            ]
        page, token = _page(items, request.page_size, request.page_token, emu.page_size_cap)
        return disk_service_pb2.ListDisksResponse(disks=page, next_page_token=token)

    def Create(self, request, context):
        emu = self.emu
        method = "DiskService.Create"
        emu.begin(method, request, context)
        r = request
        checks = [
            (r.folder_id == FOLDER, f"folder_id {r.folder_id!r} is unknown"),
            (bool(_DISK_NAME.fullmatch(r.name)), f"name {r.name!r} is invalid"),
            (r.zone_id in ZONES, f"zone_id {r.zone_id!r} is unknown"),
            (r.type_id in _DISK_TYPES, f"type_id {r.type_id!r} is unknown"),
            (4194304 <= r.size <= 28587302322176, f"size {r.size} is out of range"),
            (len(r.labels) <= 64, "at most 64 labels"),
            (all(_LABEL_KEY.fullmatch(k) for k in r.labels), f"bad label key in {dict(r.labels)}"),
            (
                all(_LABEL_VALUE.fullmatch(v) for v in r.labels.values()),
                f"bad label value in {dict(r.labels)}",
            ),
        ]
        problem = next((msg for ok, msg in checks if not ok), None)
        if problem:
            emu.invalid(method, context, problem)
        key = dict(context.invocation_metadata()).get("idempotency-key")
        with emu._lock:
            if key and key in emu._by_key:
                return emu.reply(method, _copy(emu._ops[emu._by_key[key]].pb), context)
            # whether a second disk of a name is refused is not documented: not enforced
            disk = emu.add_disk(
                name=r.name, zone=r.zone_id, size=r.size, type_id=r.type_id, labels=dict(r.labels)
            )
            disk.status = disk_pb2.Disk.CREATING

            def finish() -> None:
                disk.status = disk_pb2.Disk.READY
                op.pb.response.Pack(disk)

            meta = disk_service_pb2.CreateDiskMetadata(disk_id=disk.id)
            op = emu._new_op("Create disk", meta, "", finish=finish)
            if key:
                emu._by_key[key] = op.pb.id
            return emu.reply(method, _copy(op.pb), context)

    def Delete(self, request, context):
        emu = self.emu
        method = "DiskService.Delete"
        emu.begin(method, request, context)
        key = dict(context.invocation_metadata()).get("idempotency-key")
        with emu._lock:
            if key and key in emu._by_key:
                return emu.reply(method, _copy(emu._ops[emu._by_key[key]].pb), context)
            disk = self.find(emu, request.disk_id, context)
            if disk["instance_id"] is not None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, _attached(request.disk_id))
            disk["pb"].status = disk_pb2.Disk.DELETING

            def finish() -> None:
                emu.disks.pop(request.disk_id, None)
                op.pb.response.Pack(empty_pb2.Empty())

            meta = disk_service_pb2.DeleteDiskMetadata(disk_id=request.disk_id)
            op = emu._new_op("Delete disk", meta, "", finish=finish)
            if key:
                emu._by_key[key] = op.pb.id
            return emu.reply(method, _copy(op.pb), context)


class _Operations(operation_service_pb2_grpc.OperationServiceServicer):
    def __init__(self, emu: YandexEmulator) -> None:
        self.emu = emu

    def Get(self, request, context):
        self.emu.begin("OperationService.Get", request, context)
        op = self.emu._poll(request.operation_id)
        if op is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"Operation {request.operation_id} not found")
        return op


class _Images(image_service_pb2_grpc.ImageServiceServicer):
    def __init__(self, emu: YandexEmulator) -> None:
        self.emu = emu

    def GetLatestByFamily(self, request, context):
        self.emu.begin("ImageService.GetLatestByFamily", request, context)
        image_id = self.emu.images.get((request.folder_id, request.family))
        if image_id is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"Image family {request.family} not found in {request.folder_id}",
            )
        return image_pb2.Image(
            id=image_id,
            folder_id=request.folder_id,
            family=request.family,
            status=image_pb2.Image.READY,
        )


class _Subnets(subnet_service_pb2_grpc.SubnetServiceServicer):
    def __init__(self, emu: YandexEmulator) -> None:
        self.emu = emu

    def List(self, request, context):
        emu = self.emu
        emu.begin("SubnetService.List", request, context)
        if request.folder_id != FOLDER:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"folder {request.folder_id}")
        items = [
            subnet_pb2.Subnet(id=s, folder_id=FOLDER, zone_id=z, network_id=NETWORK)
            for z, s in sorted(emu.subnets.items())
        ]
        page, token = _page(items, request.page_size, request.page_token, emu.page_size_cap)
        return subnet_service_pb2.ListSubnetsResponse(subnets=page, next_page_token=token)

    def Get(self, request, context):
        emu = self.emu
        emu.begin("SubnetService.Get", request, context)
        zone = next((z for z, s in emu.subnets.items() if s == request.subnet_id), None)
        if zone is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"Subnet {request.subnet_id} not found")
        return subnet_pb2.Subnet(
            id=request.subnet_id, folder_id=FOLDER, zone_id=zone, network_id=NETWORK
        )


class _SecurityGroups(security_group_service_pb2_grpc.SecurityGroupServiceServicer):
    """VPC security groups (yandex/cloud/vpc/v1/security_group_service.proto): Create, Get,
    List, UpdateRules, Delete. A rule needs a direction, a protocol, and a CIDR, a group or a
    predefined target (what the proto's oneof ``target`` allows); ports are 0-65535, from ≤ to
    (SecurityGroupRuleSpec / PortRange). Refusing to delete a group in use is not modelled:
    no source says what Yandex answers."""

    def __init__(self, emu: YandexEmulator) -> None:
        self.emu = emu

    def _rules(self, group_id: str, specs, context) -> list[security_group_pb2.SecurityGroupRule]:
        out = []
        for spec in specs:
            ports = spec.ports
            problem = (
                "direction is required"
                if spec.direction == 0
                else "protocol is required"
                if not (spec.protocol_name or spec.protocol_number)
                else "a rule needs cidr_blocks, security_group_id or predefined_target"
                if spec.WhichOneof("target") is None
                else "ports must be 0-65535, from_port ≤ to_port"
                if spec.HasField("ports") and not 0 <= ports.from_port <= ports.to_port <= 65535
                else None
            )
            if problem:
                self.emu.invalid("SecurityGroupService", context, problem)
            rule = security_group_pb2.SecurityGroupRule(
                id=self.emu.new_id("enprule"),
                description=spec.description,
                labels=dict(spec.labels),
                direction=spec.direction,
                protocol_name=spec.protocol_name,
                protocol_number=spec.protocol_number,
            )
            if spec.HasField("ports"):
                rule.ports.CopyFrom(spec.ports)
            if spec.HasField("cidr_blocks"):
                rule.cidr_blocks.CopyFrom(spec.cidr_blocks)
            out.append(rule)
        return out

    def _find(self, group_id: str, context) -> security_group_pb2.SecurityGroup:
        group = self.emu.security_groups.get(group_id)
        if group is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"Security group {group_id} not found")
        return group

    def _done(self, description: str, meta, response) -> operation_pb2.Operation:
        op = self.emu._new_op(description, meta, "")
        op.pb.done = True
        op.pb.response.Pack(response)
        return _copy(op.pb)

    def Create(self, request, context):
        emu = self.emu
        emu.begin("SecurityGroupService.Create", request, context)
        if request.folder_id != FOLDER:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"folder {request.folder_id}")
        if request.network_id != NETWORK:
            emu.invalid("SecurityGroupService.Create", context, "network_id is unknown")
        if request.name and not _NAME.fullmatch(request.name):
            emu.invalid("SecurityGroupService.Create", context, f"name {request.name!r}")
        key = dict(context.invocation_metadata()).get("idempotency-key")
        with emu._lock:
            if key and key in emu._by_key:  # a reused key: the first operation, as for VMs
                return _copy(emu._ops[emu._by_key[key]].pb)
            group = security_group_pb2.SecurityGroup(
                id=emu.new_id("enpsg"),
                folder_id=FOLDER,
                created_at=emu.now(),
                name=request.name,
                description=request.description,
                labels=dict(request.labels),
                network_id=request.network_id,
                status=security_group_pb2.SecurityGroup.ACTIVE,
            )
            group.rules.extend(self._rules(group.id, request.rule_specs, context))
            emu.security_groups[group.id] = group
            meta = security_group_service_pb2.CreateSecurityGroupMetadata(
                security_group_id=group.id
            )
            op = self._done("Create security group", meta, group)
            if key:
                emu._by_key[key] = op.id
            return op

    def Get(self, request, context):
        self.emu.begin("SecurityGroupService.Get", request, context)
        with self.emu._lock:
            return _copy(self._find(request.security_group_id, context))

    def List(self, request, context):
        emu = self.emu
        emu.begin("SecurityGroupService.List", request, context)
        if request.folder_id != FOLDER:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"folder {request.folder_id}")
        with emu._lock:
            items = [_copy(g) for g in emu.security_groups.values()]
        page, token = _page(items, request.page_size, request.page_token, emu.page_size_cap)
        return security_group_service_pb2.ListSecurityGroupsResponse(
            security_groups=page, next_page_token=token
        )

    def UpdateRules(self, request, context):
        emu = self.emu
        emu.begin("SecurityGroupService.UpdateRules", request, context)
        with emu._lock:
            group = self._find(request.security_group_id, context)
            ids = {r.id for r in group.rules}
            unknown = [i for i in request.deletion_rule_ids if i not in ids]
            if unknown:
                context.abort(grpc.StatusCode.NOT_FOUND, f"Rules {unknown} not found")
            added = self._rules(group.id, request.addition_rule_specs, context)
            kept = [r for r in group.rules if r.id not in set(request.deletion_rule_ids)]
            del group.rules[:]
            group.rules.extend(kept + added)
            meta = security_group_service_pb2.UpdateSecurityGroupMetadata(
                security_group_id=group.id, added_rule_ids=[r.id for r in added]
            )
            return self._done("Update security group rules", meta, group)

    def Delete(self, request, context):
        emu = self.emu
        emu.begin("SecurityGroupService.Delete", request, context)
        with emu._lock:
            self._find(request.security_group_id, context)
            del emu.security_groups[request.security_group_id]
            meta = security_group_service_pb2.DeleteSecurityGroupMetadata(
                security_group_id=request.security_group_id
            )
            return self._done("Delete security group", meta, empty_pb2.Empty())


class _Skus(sku_service_pb2_grpc.SkuServiceServicer):
    def __init__(self, emu: YandexEmulator) -> None:
        self.emu = emu

    def List(self, request, context):
        emu = self.emu
        emu.begin("SkuService.List", request, context)
        if request.currency not in ("RUB", "USD", "KZT"):
            emu.invalid("SkuService.List", context, "currency must be RUB/USD/KZT")
        page, token = _page(emu.skus, request.page_size, request.page_token, emu.page_size_cap)
        return sku_service_pb2.ListSkusResponse(skus=page, next_page_token=token)


def sku(name: str, versions: list[tuple[dt.datetime, str]], currency: str = "RUB") -> sku_pb2.Sku:
    """A fixture SKU in the billing API's shape: street-price versions (effective from, unit
    price), each with one rate tier starting at zero."""
    out = sku_pb2.Sku(
        id=f"dn2{zlib.crc32(name.encode()):017d}",
        name=name,
        service_id="dn22pas77ftg9h3f2djj",
        pricing_unit="unit*hour",
    )
    for when, price in versions:
        ts = Timestamp()
        ts.FromDatetime(when)
        out.pricing_versions.append(
            sku_pb2.PricingVersion(
                type=sku_pb2.STREET_PRICE,
                effective_time=ts,
                pricing_expressions=[
                    sku_pb2.PricingExpression(
                        rates=[
                            sku_pb2.Rate(
                                start_pricing_quantity="0", unit_price=price, currency=currency
                            )
                        ]
                    )
                ],
            )
        )
    return out
