"""A local Compute Engine v1 REST emulator (plus a Cloud Billing Catalog fixture) for the GCP
adapter's tests.

It speaks the wire protocol the unmodified google-cloud-compute REST transport uses: JSON bodies
with camelCase fields, ``requestId`` query parameters, zone operations that move PENDING →
RUNNING → DONE, ``filter``/``maxResults``/``pageToken`` listing, and Google's error shape
``{"error": {"code", "message", "errors": [{"reason", …}]}}`` so the SDK raises the same
google.api_core exceptions as against the real API. Insert bodies are parsed into the SDK's own
``compute_v1.Instance`` with unknown fields refused and checked against GCP's rules; a malformed
request gets HTTP 400 and so fails the test that sent it.

Control surface for tests: :meth:`GCPEmulator.exhaust`, :meth:`~GCPEmulator.exceed_quota`,
:meth:`~GCPEmulator.throttle`, :meth:`~GCPEmulator.lose_responses`,
:meth:`~GCPEmulator.slow_operations`, :meth:`~GCPEmulator.preempt`,
:meth:`~GCPEmulator.add_instance`, :meth:`~GCPEmulator.deny_auth`,
:meth:`~GCPEmulator.console_stop`, :meth:`~GCPEmulator.console_delete`,
:meth:`~GCPEmulator.preempt_on_create`, :meth:`~GCPEmulator.withdraw_accelerator`,
:meth:`~GCPEmulator.delete_network`, :meth:`~GCPEmulator.delete_firewall`,
:meth:`~GCPEmulator.lose_firewall_race`; received requests are in :attr:`~GCPEmulator.requests`,
firewall rules in :attr:`~GCPEmulator.firewalls`, and :meth:`~GCPEmulator.reachable_on_22` says
whether the rules admit SSH to an instance.

Persistent disks (disks insert/get/list/aggregatedList/delete, instances attachDisk/detachDisk) are
in :attr:`~GCPEmulator.disks`, with ``users`` kept as GCP keeps it and the attach and delete rules
cited beside ``_route_disks``.

Firewall rules (global/firewalls get and insert, awaited as global operations) are parsed into the
SDK's own ``compute_v1.Firewall`` with unknown fields refused and checked against the rules its
docstrings and Google's VPC firewall docs state (see ``_parse_firewall``).
"""

from __future__ import annotations

import base64
import ipaddress
import json
import random
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

API = "https://www.googleapis.com/compute/v1"
# Deep Learning VM images: Google's image family list (cloud.google.com/deep-learning-vm/docs/
# images, "Choose an image": common-cu128-ubuntu-2204-nvidia-570 is its current base CUDA family,
# with the NVIDIA 570 driver). Families are supported about two years; the Debian 11 family
# common-cu124-debian-11 is modelled retired (Debian 11 LTS ended 2026-08: the repo's reference
# notes, clouds.md), its last image DEPRECATED (compute_v1 DeprecationStatus), so getFromFamily no
# longer resolves it. Image names (the -vYYYYMMDD suffix) are made up; families are Google's.
DLVM_PROJECT = "deeplearning-platform-release"
DLVM_IMAGES = (
    {
        "name": "common-cu128-ubuntu-2204-nvidia-570-v20261105",
        "family": "common-cu128-ubuntu-2204-nvidia-570",
        "status": "READY",
    },
    {
        "name": "common-cu124-v20250325-debian-11",
        "family": "common-cu124-debian-11",
        "status": "READY",
        "deprecated": {
            "state": "DEPRECATED",
            "replacement": f"{API}/projects/{DLVM_PROJECT}/global/images/family/"
            "common-cu128-ubuntu-2204-nvidia-570",
        },
    },
)
BILLING_SERVICE = "6F81-5844-456A"
PREEMPTED_TYPE = "compute.instances.preempted"
NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")
ZONE_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
MACHINE_TYPES = {
    **{f"a2-highgpu-{n}g": ("A100", n) for n in (1, 2, 4, 8)},
    "a2-megagpu-16g": ("A100", 16),
    **{f"a2-ultragpu-{n}g": ("A100-80GB", n) for n in (1, 2, 4, 8)},
    **{f"a3-highgpu-{n}g": ("H100", n) for n in (1, 2, 4, 8)},
    "a3-megagpu-8g": ("H100", 8),
    "a3-ultragpu-8g": ("H200", 8),
    **{f"g2-standard-{v}": ("L4", 1) for v in (4, 8, 12, 16, 32)},
    "g2-standard-24": ("L4", 2),
    "g2-standard-48": ("L4", 4),
    "g2-standard-96": ("L4", 8),
    **{f"n1-standard-{v}": ("", 0) for v in (1, 2, 4, 8, 16, 32, 64, 96)},
}
ACCELERATOR_TYPES = {"nvidia-tesla-t4", "nvidia-tesla-v100"}


# Where each attachable accelerator type exists, the emulator's own copy (it must not follow the
# adapter's assumptions: a wrong zone in providers/gcp/prices.py has to fail a launch here). The
# zones of `gcloud compute accelerator-types list` as recorded in SkyPilot's GCP catalog, 2026-11;
# Google's "GPU regions and zones" page (cloud.google.com/compute/docs/gpus/gpu-regions-zones)
# was not among the stored sources to check it against. An insert naming the type elsewhere is
# refused at once, HTTP 400 badRequest "The resource 'projects/P/zones/Z/acceleratorTypes/A' was
# not found" (hashicorp/terraform-provider-google#5860; fastai/course-v3#430 and #493 show the
# same text from `gcloud compute instances create`).
def _zones(text: str) -> frozenset[str]:
    return frozenset(text.split())


ACCELERATOR_ZONES = {
    "nvidia-tesla-t4": _zones(
        """asia-east1-a asia-east1-c asia-east2-a asia-east2-c asia-northeast1-a asia-northeast1-c
        asia-northeast3-b asia-northeast3-c asia-south1-a asia-south1-b asia-southeast1-a
        asia-southeast1-b asia-southeast1-c asia-southeast2-a asia-southeast2-b
        australia-southeast1-a australia-southeast1-c europe-central2-b europe-central2-c
        europe-west1-b europe-west1-c europe-west1-d europe-west2-a europe-west2-b europe-west3-b
        europe-west4-a europe-west4-b europe-west4-c me-west1-b me-west1-c
        northamerica-northeast1-c southamerica-east1-a southamerica-east1-b southamerica-east1-c
        us-central1-a us-central1-b us-central1-c us-central1-f us-east1-b us-east1-c us-east1-d
        us-east4-a us-east4-b us-east4-c us-west1-a us-west1-b us-west2-b us-west2-c us-west3-b
        us-west4-a us-west4-b"""
    ),
    "nvidia-tesla-v100": _zones(
        """asia-east1-c europe-west4-a europe-west4-b europe-west4-c us-central1-a us-central1-b
        us-central1-c us-central1-f us-east1-b us-east1-c us-west1-a us-west1-b"""
    ),
}
# How many of one attachable GPU an N1 instance takes (https://cloud.google.com/compute/docs/gpus,
# "NVIDIA T4": 1, 2 or 4 GPUs; "NVIDIA V100": 1, 2, 4 or 8). Any other count is refused with
# 400 invalid "Invalid value for field 'resource.guestAccelerators[0].acceleratorCount': '8'.
# Number of accelerator cards attached to an instance must be one of [1, 2, 4]."
# (google/deepvariant#136).
ACCELERATOR_COUNTS = {"nvidia-tesla-t4": (1, 2, 4), "nvidia-tesla-v100": (1, 2, 4, 8)}
# Boot disk types a machine series cannot take. compute_v1.AttachedDiskInitializeParams.disk_type:
# "The disk type you specify must be compatible with the instance's machine series."
# - A3 Ultra (a3-ultragpu, H200) boots from Hyperdisk only: no Persistent Disk
#   (https://cloud.google.com/compute/docs/accelerator-optimized-machines, A3 Ultra supported disk
#   types; Vertex AI DiskSpec.bootDiskType: "for A3U machines ... hyperdisk-balanced").
# - N1 (with or without GPUs) and A2 take no Hyperdisk Balanced
#   (https://cloud.google.com/compute/docs/disks/hyperdisks, machine series support table: the
#   N1, N1+GPU and A2 rows have no Hyperdisk Balanced).
# The refusal is HTTP 400 badRequest "[<disk type>, <machine type>] features are not compatible
# for creating instance." (elastic/elastic-agent#5091: "[pd-ssd, c4a-standard-4] ...").
PERSISTENT_DISKS = frozenset({"pd-standard", "pd-balanced", "pd-ssd", "pd-extreme"})
HYPERDISKS = frozenset(
    {"hyperdisk-balanced", "hyperdisk-balanced-high-availability", "hyperdisk-extreme"}
    | {"hyperdisk-ml", "hyperdisk-throughput"}
)
BOOT_DISK_FORBIDDEN = {
    "a3-ultragpu": PERSISTENT_DISKS,
    "a2-highgpu": HYPERDISKS,
    "a2-megagpu": HYPERDISKS,
    "a2-ultragpu": HYPERDISKS,
    "n1": HYPERDISKS,
}
# The roots a full resource URL may start with (compute_v1 docstrings: machineType and
# acceleratorType take a "Full or partial URL"; diskType lists
# https://www.googleapis.com/compute/v1/projects/p/zones/z/diskTypes/t, projects/p/zones/z/...
# and zones/z/diskTypes/t).
URL_ROOTS = ("https://www.googleapis.com/compute/v1/", "https://compute.googleapis.com/compute/v1/")
# Query parameters the real API accepts on each call we serve (anything else is a 400).
LIST_PARAMS = {"filter", "maxResults", "pageToken", "orderBy", "returnPartialSuccess"}
AGGREGATED_PARAMS = LIST_PARAMS | {"includeAllScopes", "serviceProjectNumber"}
GLOBAL = "global"  # the scope of global operations (firewall rules are global resources)
NETWORK_RE = re.compile(
    r"(?:(?:https://[^/]+/compute/v1/)?projects/([^/]+)/)?global/networks/([^/]+)"
)
# The rules a new project's auto-mode `default` network comes with ("prepopulated rules",
# https://cloud.google.com/vpc/docs/firewalls#more_rules_default_vpc; their JSON as the API lists
# them: gist l4rz/29a04343905bf6329a4e9d619ca70d31). Any of them may be deleted, and a network
# created by hand has none: only the implied deny-all-ingress applies.
DEFAULT_NETWORK_RULES = {
    "default-allow-internal": {
        "allowed": [
            {"IPProtocol": "tcp", "ports": ["0-65535"]},
            {"IPProtocol": "udp", "ports": ["0-65535"]},
            {"IPProtocol": "icmp"},
        ],
        "sourceRanges": ["10.128.0.0/9"],
    },
    "default-allow-ssh": {"allowed": [{"IPProtocol": "tcp", "ports": ["22"]}]},
    "default-allow-rdp": {"allowed": [{"IPProtocol": "tcp", "ports": ["3389"]}]},
    "default-allow-icmp": {"allowed": [{"IPProtocol": "icmp"}]},
}
# Output-only fields of a stored rule (compute_v1.Firewall: "[Output Only]"), not sent back in a
# body the API parses.
_FIREWALL_OUTPUT_FIELDS = {"kind", "id", "creationTimestamp", "selfLink"}
# Allowed.ports / Denied.ports: "only applicable for the UDP or TCP protocol" (compute_v1.Allowed);
# IPProtocol is a well-known name "(tcp, udp, icmp, esp, ah, ipip, sctp) or the IP protocol number".
FIREWALL_PROTOCOLS = {"tcp": 6, "udp": 17, "icmp": 1, "esp": 50, "ah": 51, "ipip": 94, "sctp": 132}
PORT_PROTOCOLS = {"tcp", "udp", "6", "17"}


class ApiError(Exception):
    """An HTTP error answered in Google's JSON error shape."""

    def __init__(self, status: int, reason: str, message: str, domain: str = "global") -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.domain = status, reason, message, domain

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "code": self.status,
                "message": self.message,
                "errors": [{"message": self.message, "domain": self.domain, "reason": self.reason}],
            }
        }


def invalid(message: str) -> ApiError:
    return ApiError(400, "invalid", message)


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    body: dict[str, Any] | None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class _Pending:
    """An operation not DONE yet: ``polls`` more reads, then ``finish`` runs."""

    polls: int
    finish: Callable[[], dict[str, Any] | None]


class GCPEmulator:
    """Compute Engine v1 for one project, in memory, on ``http://127.0.0.1:<port>``."""

    def __init__(self, project: str = "test-project") -> None:
        self.project = project
        self.instances: dict[tuple[str, str], dict[str, Any]] = {}
        self.disks: dict[tuple[str, str], dict[str, Any]] = {}  # persistent disks by (zone, name)
        self.operations: dict[tuple[str, str], dict[str, Any]] = {}
        self.global_operations: dict[tuple[str, str], dict[str, Any]] = {}
        self.firewalls: dict[str, dict[str, Any]] = {}
        self.requests: list[Recorded] = []
        self.max_page_size = 500  # the real API may return fewer than maxResults
        # Test infra, not Compute Engine: every external address this emulator assigns (an
        # accessConfig's natIP, "An external IP address associated with this instance",
        # compute_v1 AccessConfig.nat_i_p) is this one, e.g. 127.0.0.1 where a test's sshd
        # listens; None: its own 34.1.x.y addresses.
        self.public_address: str | None = None
        self.billing_pages: list[dict[str, Any]] = billing_fixture_pages()
        self.billing_api_key = "test-billing-key"
        self.networks: set[str] = {"default"}  # the auto-mode network a new project gets
        # the project's commonInstanceMetadata (e.g. enable-oslogin=TRUE) and the organization
        # policy constraints enforced on it (see require_os_login)
        self.project_metadata: dict[str, str] = {}
        self.constraints: set[str] = set()
        self.accelerator_zones = {k: frozenset(v) for k, v in ACCELERATOR_ZONES.items()}
        # public images by (project, name), as images.get and images.getFromFamily read them
        self.images: dict[tuple[str, str], dict[str, Any]] = {
            (DLVM_PROJECT, i["name"]): dict(i) for i in DLVM_IMAGES
        }
        self._preempt_on_create: set[str] = set()
        self._pending: dict[tuple[str, str], _Pending] = {}
        self._request_ids: dict[str, tuple[str, str]] = {}
        self._exhausted: dict[str, str] = {}
        self._quota: tuple[str, str, str | None] | None = None
        self._throttle = 0
        self._throttle_status = 429
        self._throttle_call: str | None = None
        self._lose = 0
        self._lose_call: str | None = None
        self._firewall_race: dict[str, Any] | None = None
        self._creating_firewalls: set[str] = set()
        self._op_polls = 0
        self._auth_denied = False
        self._clock = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
        self._lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        for name, rule in DEFAULT_NETWORK_RULES.items():
            body = {"sourceRanges": ["0.0.0.0/0"], "priority": 65534, **rule, "name": name}
            self._store_firewall(_parse_firewall(body, project, self.networks))

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> GCPEmulator:
        emulator = self

        class Handler(_Handler):
            pass

        Handler.emulator = emulator
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> GCPEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "emulator not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # --- control surface -------------------------------------------------------------------

    def exhaust(self, zone: str, code: str = "ZONE_RESOURCE_POOL_EXHAUSTED") -> None:
        """Inserts and starts in ``zone`` end in an operation DONE with this error (as on GCP)."""
        self._exhausted[zone] = code

    def exceed_quota(self, quota: str, *, via: str = "http", region: str | None = None) -> None:
        """Every insert breaks ``quota`` (e.g. NVIDIA_A100_GPUS, GPUS_ALL_REGIONS): as an HTTP 403
        ``quotaExceeded`` (via="http") or as an operation error QUOTA_EXCEEDED (via="operation").
        ``region`` limits it to inserts in that region."""
        self._quota = (quota, via, region)

    def withdraw_accelerator(self, zone: str, accelerator: str) -> None:
        """``accelerator`` is no longer offered in ``zone`` (a catalog older than the cloud)."""
        self.accelerator_zones[accelerator] = self.accelerator_zones[accelerator] - {zone}

    def delete_network(self, name: str = "default") -> None:
        """The project has no such VPC network (deleted, or never created by policy), so none
        of its firewall rules either (a network with rules cannot be deleted)."""
        self.networks.discard(name)
        for rule in [r for r in self.firewalls.values() if _network_name(r["network"]) == name]:
            del self.firewalls[rule["name"]]

    def delete_firewall(self, name: str) -> None:
        """Someone deletes a firewall rule (e.g. the `default` network's `default-allow-ssh`)."""
        del self.firewalls[name]

    def lose_firewall_race(self, body: dict[str, Any]) -> None:
        """Another process creates this firewall rule just after our next firewalls.get of its
        name answered 404: our insert then meets 409 alreadyExists."""
        self._firewall_race = body

    def reachable_on_22(self, zone: str, name: str, source: str = "203.0.113.10") -> bool:
        """Would a TCP connection from ``source`` to port 22 of the instance be admitted? The
        VPC firewall of its first interface's network decides (compute_v1.Firewall docstrings):
        an enabled INGRESS rule applies when it has no targetTags or one of the instance's tags,
        and matches when ``source`` is in its sourceRanges and its allowed/denied entries cover
        tcp:22 (an entry without ports covers every port). The matching rule with the lowest
        priority number decides, a DENY winning over an ALLOW of equal priority; with none, the
        implied deny-all-ingress rule applies (priority: "VPC networks have implied rules with a
        priority of 65535")."""
        with self._lock:
            instance = self._find(zone, name)
            network = _network_name(instance["networkInterfaces"][0]["network"])
            tags = set(instance.get("tags", {}).get("items", []))
            address = ipaddress.ip_address(source)
            decisions = []
            for rule in self.firewalls.values():
                if _network_name(rule["network"]) != network or rule.get("disabled"):
                    continue
                if rule.get("direction", "INGRESS") != "INGRESS":
                    continue
                targets = set(rule.get("targetTags", []))
                if targets and not targets & tags:
                    continue
                if not any(
                    address.version == net.version and address in net
                    for net in map(_cidr, rule.get("sourceRanges", []))
                ):
                    continue
                for action, entries in (("allow", "allowed"), ("deny", "denied")):
                    if any(_covers_ssh(entry) for entry in rule.get(entries, [])):
                        decisions.append((rule.get("priority", 1000), action == "allow"))
            if not decisions:
                return False
            # the lowest priority number wins; at equal priority deny (False) sorts first
            return sorted(decisions)[0][1]

    def require_os_login(self) -> None:
        """The organization enforces ``constraints/compute.requireOsLogin`` on this project:
        "enable-oslogin=true is included in the project metadata" and "requests that set
        enable-oslogin to false in VM or project metadata are rejected"
        (https://cloud.google.com/compute/docs/oslogin/manage-oslogin-in-an-org). GCE refuses a
        request an organization policy forbids with HTTP 412 conditionNotMet "Constraint
        constraints/compute.<name> violated for project projects/<P>. ..." (the shape recorded
        for requireShieldedVm in a Terraform run and for vmExternalIpAccess in GKE guides)."""
        self.constraints.add("compute.requireOsLogin")
        self.project_metadata["enable-oslogin"] = "TRUE"

    def metadata_ssh_login(self, zone: str, name: str, user: str) -> bool:
        """Would the guest let ``user`` in with the key in the instance's ``ssh-keys``
        metadata? Not when OS Login is on for it: "When you set OS Login metadata, Compute
        Engine deletes the VM's authorized_keys files and no longer accepts connections from SSH
        keys that are stored in project or instance metadata" (compute/docs/instances/
        managing-instance-access); "Instance-level values override the project-level value"
        (compute/docs/oslogin)."""
        with self._lock:
            instance = self._find(zone, name)
            items = {
                i["key"]: i.get("value", "") for i in instance.get("metadata", {}).get("items", [])
            }
            oslogin = items.get("enable-oslogin", self.project_metadata.get("enable-oslogin", ""))
            if oslogin.strip().lower() == "true":
                return False
            keys = items.get("ssh-keys", "").splitlines()
            return any(k.partition(":")[0] == user and k.partition(":")[2].strip() for k in keys)

    def preempt_on_create(self, zone: str) -> None:
        """The next Spot insert in ``zone`` is preempted before it finishes booting: its operation
        ends DONE with error UNSUPPORTED_OPERATION "Instance failed to start due to preemption."
        (SkyPilot's GCP failover handler: "UNSUPPORTED_OPERATION is observed empirically when VM
        is preempted during creation"; the message as reported in scylladb/scylla-cluster-tests
        #2790) and the instance is left behind stopped (TERMINATED) under its name, its boot disk
        still there (scylladb/scylla-cluster-tests#2840: "This instance won't be destroyed but
        stopped and stays with the name")."""
        self._preempt_on_create.add(zone)

    def clear_faults(self) -> None:
        self._exhausted.clear()
        self._preempt_on_create.clear()
        self._quota = None
        self._throttle = self._lose = self._op_polls = 0
        self._throttle_call = self._lose_call = self._firewall_race = None
        self._auth_denied = False

    def throttle(self, count: int, status: int = 429, call: str | None = None) -> None:
        """The next ``count`` requests (only those of ``call``, e.g. "POST /instances": method
        and path suffix) are refused with ``rateLimitExceeded``."""
        self._throttle, self._throttle_status, self._throttle_call = count, status, call

    def lose_responses(self, count: int, call: str | None = None) -> None:
        """The next ``count`` mutating requests (only those of ``call``, as in :meth:`throttle`)
        are carried out, then answered 503 (as if the answer got lost on the way back)."""
        self._lose, self._lose_call = count, call

    def slow_operations(self, polls: int) -> None:
        """New operations stay PENDING/RUNNING for ``polls`` reads (get or wait)."""
        self._op_polls = polls

    def deny_auth(self) -> None:
        self._auth_denied = True

    def preempt(self, zone: str, name: str, at: datetime | None = None) -> None:
        """GCP takes back a spot instance: per its instanceTerminationAction it is stopped
        (TERMINATED) or deleted, and a ``compute.instances.preempted`` operation is logged.
        ``at`` dates it (default: the logical clock) as GCP writes times, with the Pacific
        offset of its API answers (e.g. ``"lastStopTimestamp": "2022-04-05T01:23:00.444-07:00"``
        in recorded instances.get answers; RFC 3339 per the compute v1 Instance reference)."""
        with self._lock:
            instance = self.instances[(zone, name)]
            scheduling = instance.get("scheduling", {})
            assert scheduling.get("provisioningModel") == "SPOT", "only spot VMs are preempted"
            op = self._new_operation(zone, PREEMPTED_TYPE, instance)
            op["user"] = "system"
            op.update(status="DONE", progress=100, endTime=self._now())
            if scheduling.get("instanceTerminationAction") == "DELETE":
                del self.instances[(zone, name)]
                self._release_disks(instance)
            else:
                when = self._now() if at is None else _pacific(at)
                instance.update(status="TERMINATED", lastStopTimestamp=when, statusMessage="")

    def console_stop(self, zone: str, name: str) -> None:
        """A person stops the instance in the console: a ``stop`` operation by a user, and the
        instance TERMINATED (GCP's word for stopped), as after instances.stop."""
        with self._lock:
            instance = self.instances[(zone, name)]
            op = self._new_operation(zone, "stop", instance)
            op.update(status="DONE", progress=100, endTime=self._now())
            instance.update(status="TERMINATED", lastStopTimestamp=self._now())

    def guest_shutdown(self, zone: str, name: str, at: datetime | None = None) -> None:
        """The VM's OS shuts itself down (``shutdown -h now``) at ``at`` (default: the logical
        clock): it goes TERMINATED, GCP's word for stopped, with ``lastStopTimestamp`` (compute
        v1 Instance reference: the last stop, RFC 3339), as a stop through the API leaves it; a
        stopped VM bills no vCPU, memory or GPU, only its disks (Compute Engine docs, "Stop and
        start a Compute Engine instance" and "Compute Engine instance lifecycle", as the shared
        reference clouds.md records under "Shutting down from inside the machine"). No API
        call made it, so no
        operation of the project records it (Cloud Audit Logs name it a system event,
        ``compute.instances.guestTerminate``); a spot VM's instanceTerminationAction applies to
        preemptions only, so it is stopped, not deleted."""
        with self._lock:
            instance = self.instances[(zone, name)]
            when = self._now() if at is None else _pacific(at)
            instance.update(status="TERMINATED", lastStopTimestamp=when, statusMessage="")

    def console_delete(self, zone: str, name: str) -> None:
        """Someone deletes the instance outside provisioner: it is gone (GET answers 404)."""
        with self._lock:
            instance = self.instances.pop((zone, name))
            self._release_disks(instance)
            op = self._new_operation(zone, "delete", instance)
            op.update(status="DONE", progress=100, endTime=self._now())

    def add_instance(
        self,
        zone: str,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        machine_type: str = "n1-standard-4",
        status: str = "RUNNING",
    ) -> dict[str, Any]:
        """Create an instance directly, as someone else's tool would."""
        with self._lock:
            body = {
                "name": name,
                "machineType": f"zones/{zone}/machineTypes/{machine_type}",
                "labels": labels or {},
                "networkInterfaces": [{"network": "global/networks/default"}],
            }
            instance = self._materialise(zone, body)
            instance["status"] = status
            return instance

    def instance(self, zone: str, name: str) -> dict[str, Any] | None:
        return self.instances.get((zone, name))

    def calls(self, method: str, path_suffix: str = "") -> list[Recorded]:
        return [r for r in self.requests if r.method == method and r.path.endswith(path_suffix)]

    # --- request handling ------------------------------------------------------------------

    def handle(
        self, method: str, path: str, query: dict[str, str], body: Any, headers: dict[str, str]
    ) -> tuple[int, Any]:
        with self._lock:
            if self._throttle > 0 and _is_call(method, path, self._throttle_call):
                self._throttle -= 1
                error = ApiError(
                    self._throttle_status, "rateLimitExceeded", "Rate Limit Exceeded", "usageLimits"
                )
                return error.status, error.body()
            try:
                if path.startswith(f"/v1/services/{BILLING_SERVICE}/skus"):
                    return 200, self._billing(query, headers)
                if self._auth_denied:
                    raise ApiError(
                        401,
                        "authError",
                        "Request is missing required authentication credential.",
                    )
                answer = self._route(method, path, query, body)
            except ApiError as error:
                return error.status, error.body()
            mutating = method in ("POST", "DELETE", "PATCH") and not path.endswith("/wait")
            if self._lose > 0 and mutating and _is_call(method, path, self._lose_call):
                self._lose -= 1
                lost = ApiError(
                    503,
                    "backendError",
                    "Internal error. Please try again or contact Google Support.",
                )
                return lost.status, lost.body()
            return 200, answer

    def _route(self, method: str, path: str, query: dict[str, str], body: Any) -> Any:
        image = re.fullmatch(r"/compute/v1/projects/([^/]+)/global/images/(family/)?([^/]+)", path)
        if image and method == "GET":  # an image of any project: public images are readable
            _allow(query, set())
            return self._image(image.group(1), image.group(3), family=bool(image.group(2)))
        base = f"/compute/v1/projects/{self.project}"
        if path != base and not path.startswith(base + "/"):
            raise ApiError(404, "notFound", f"The resource '{path}' was not found")
        rest = path[len(base) :]
        if rest == "" and method == "GET":  # projects.get: the project and its metadata
            _allow(query, set())
            items = [{"key": k, "value": v} for k, v in sorted(self.project_metadata.items())]
            return {
                "kind": "compute#project",
                "name": self.project,
                "id": "1234567890",
                "commonInstanceMetadata": {"kind": "compute#metadata", "items": items},
                "selfLink": f"{API}/projects/{self.project}",
            }
        if rest == "/aggregated/instances" and method == "GET":
            _allow(query, AGGREGATED_PARAMS)
            return self._aggregated(query)
        if rest == "/aggregated/disks" and method == "GET":
            _allow(query, AGGREGATED_PARAMS)
            return self._aggregated(query, "disks")
        if rest.startswith("/global/"):
            return self._route_global(method, path, rest, query, body)
        match = re.fullmatch(
            r"/zones/([^/]+)/(instances|operations|disks)(?:/([^/]+))?(?:/([^/]+))?", rest
        )
        if not match:
            raise ApiError(404, "notFound", f"The resource '{path}' was not found")
        zone, kind, name, verb = match.groups()
        if not ZONE_RE.match(zone):
            raise invalid(f"Invalid value for field 'zone': '{zone}'. Unknown zone.")
        if kind == "operations":
            if name is None and method == "GET":
                _allow(query, LIST_PARAMS)
                return self._list(
                    "compute#operationList",
                    [o for (z, _), o in self.operations.items() if z == zone],
                    query,
                    "items",
                )
            if name and (method, verb) in (("GET", None), ("POST", "wait")):
                _allow(query, set())
                return self._poll(zone, name)
        elif kind == "disks":
            return self._route_disks(method, path, zone, name, verb, query, body)
        elif name is None and method == "POST":
            _allow(query, {"requestId", "sourceInstanceTemplate", "sourceMachineImage"})
            return self._insert(zone, query.get("requestId"), body)
        elif name is None and method == "GET":
            _allow(query, LIST_PARAMS)
            found = [i for (z, _), i in sorted(self.instances.items()) if z == zone]
            return self._list("compute#instanceList", found, query, "items")
        elif method == "GET" and verb is None:
            _allow(query, set())
            return self._find(zone, name)
        elif method == "DELETE" and verb is None:
            _allow(query, {"requestId", "noGracefulShutdown"})
            return self._delete(zone, name, query.get("requestId"))
        elif method == "POST" and verb in ("stop", "start"):
            extra = {"discardLocalSsd", "noGracefulShutdown"} if verb == "stop" else set()
            _allow(query, {"requestId"} | extra)
            return self._stop_start(zone, name, verb, query.get("requestId"))
        elif method == "POST" and verb == "attachDisk":
            _allow(query, {"requestId", "forceAttach"})
            return self._attach_disk(zone, name, query.get("requestId"), body)
        elif method == "POST" and verb == "detachDisk":
            _allow(query, {"requestId", "deviceName"})
            return self._detach_disk(zone, name, query.get("requestId"), query.get("deviceName"))
        raise ApiError(404, "notFound", f"The resource '{path}' was not found")

    def _route_global(
        self, method: str, path: str, rest: str, query: dict[str, str], body: Any
    ) -> Any:
        firewall = re.fullmatch(r"/global/firewalls(?:/([^/]+))?", rest)
        if firewall and firewall.group(1) is None and method == "POST":
            _allow(query, {"requestId"})
            return self._insert_firewall(query.get("requestId"), body)
        if firewall and firewall.group(1) is None and method == "GET":
            _allow(query, LIST_PARAMS)
            rules = [r for _, r in sorted(self.firewalls.items())]
            return self._list("compute#firewallList", rules, query, "items")
        if firewall and firewall.group(1) and method == "GET":
            _allow(query, set())
            return self._get_firewall(firewall.group(1))
        if firewall and firewall.group(1) and method == "DELETE":
            _allow(query, {"requestId"})
            return self._delete_firewall(firewall.group(1), query.get("requestId"))
        if firewall and firewall.group(1) and method == "PATCH":
            _allow(query, {"requestId"})
            return self._patch_firewall(firewall.group(1), query.get("requestId"), body)
        operation = re.fullmatch(r"/global/operations/([^/]+)(/wait)?", rest)
        if operation and (method, bool(operation.group(2))) in (("GET", False), ("POST", True)):
            _allow(query, set())
            return self._poll(GLOBAL, operation.group(1))
        raise ApiError(404, "notFound", f"The resource '{path}' was not found")

    # --- firewall rules --------------------------------------------------------------------

    def _get_firewall(self, name: str) -> dict[str, Any]:
        rule = self.firewalls.get(name)
        if rule is None:
            if self._firewall_race and self._firewall_race.get("name") == name:
                race, self._firewall_race = self._firewall_race, None
                # the other process's insert, done by the time ours arrives
                self._store_firewall(_parse_firewall(race, self.project, self.networks))
            raise ApiError(
                404,
                "notFound",
                f"The resource 'projects/{self.project}/global/firewalls/{name}' was not found",
            )
        return rule

    def _insert_firewall(self, request_id: str | None, body: Any) -> dict[str, Any]:
        _check_request_id(request_id)
        if request_id in self._request_ids:
            return self._poll(*self._request_ids[request_id])
        resource = _parse_firewall(body, self.project, self.networks)
        name = resource["name"]
        # "the name you choose for each of them must be unique to the project"
        # (https://cloud.google.com/firewall/docs/using-firewalls): one name, one rule, whatever
        # its network. A second insert is refused at once, as instances.insert refuses a taken
        # name (409 alreadyExists).
        if name in self.firewalls or name in self._creating_firewalls:
            raise ApiError(
                409,
                "alreadyExists",
                f"The resource 'projects/{self.project}/global/firewalls/{name}' already exists",
            )
        self._creating_firewalls.add(name)
        op = self._new_operation(GLOBAL, "insert", {"name": name, "id": _new_id()}, "firewalls")
        if request_id:
            op["clientOperationId"] = request_id
            self._request_ids[request_id] = (GLOBAL, op["name"])

        def created() -> None:
            self._creating_firewalls.discard(name)
            self._store_firewall(resource, op["targetId"])

        return self._schedule(GLOBAL, op, created)

    def _delete_firewall(self, name: str, request_id: str | None) -> dict[str, Any]:
        """firewalls.delete: a global operation; nothing checks whether instances rely on the
        rule (a VPC firewall rule is not attached to instances, it only applies to them)."""
        _check_request_id(request_id)
        if request_id in self._request_ids:
            return self._poll(*self._request_ids[request_id])
        rule = self._get_firewall(name)
        op = self._new_operation(GLOBAL, "delete", rule, "firewalls")
        if request_id:
            self._request_ids[request_id] = (GLOBAL, op["name"])
        return self._schedule(GLOBAL, op, lambda: self.firewalls.pop(name, None) and None)

    def _patch_firewall(self, name: str, request_id: str | None, body: Any) -> dict[str, Any]:
        """firewalls.patch: "PATCH semantics and ... the JSON merge patch format and processing
        rules" (compute_v1.FirewallsClient.patch): the fields given replace the stored ones (a
        list is replaced whole, RFC 7396), the rest stay; the result must still be a valid rule
        and keep its name and network."""
        _check_request_id(request_id)
        if request_id in self._request_ids:
            return self._poll(*self._request_ids[request_id])
        rule = self._get_firewall(name)
        if not isinstance(body, dict):
            raise invalid("Required field 'resource' not specified")
        if body.get("name", name) != name:
            raise invalid(f"Invalid value for field 'resource.name': '{body['name']}'.")
        stored = {k: v for k, v in rule.items() if k not in _FIREWALL_OUTPUT_FIELDS}
        merged = _parse_firewall({**stored, **body}, self.project, self.networks)
        if _network_name(merged["network"]) != _network_name(rule["network"]):
            raise invalid("Invalid value for field 'resource.network': it cannot be changed.")
        op = self._new_operation(GLOBAL, "patch", rule, "firewalls")
        if request_id:
            self._request_ids[request_id] = (GLOBAL, op["name"])
        return self._schedule(GLOBAL, op, lambda: rule.update(merged) and None)

    def _store_firewall(self, resource: dict[str, Any], rule_id: str | None = None) -> None:
        name = resource["name"]
        self.firewalls[name] = {
            "kind": "compute#firewall",
            "id": rule_id or _new_id(),
            "creationTimestamp": self._now(),
            "direction": "INGRESS",
            "priority": 1000,
            "disabled": False,
            "logConfig": {"enable": False},
            **resource,
            "selfLink": f"{API}/projects/{self.project}/global/firewalls/{name}",
        }

    # --- instances -------------------------------------------------------------------------

    def add_image(self, project: str, name: str, family: str | None = None, **deprecated: str):
        """A public image someone published (``deprecated``: a DeprecationStatus, e.g.
        ``state="DEPRECATED"``)."""
        image = {"name": name, "family": family, "status": "READY"}
        if deprecated:
            image["deprecated"] = deprecated
        self.images[(project, name)] = {k: v for k, v in image.items() if v is not None}

    def _image(self, project: str, name: str, *, family: bool) -> dict[str, Any]:
        """images.get, or images.getFromFamily: "Returns the latest image that is part of an
        image family and is not deprecated" (compute_v1 ImagesClient.get_from_family); a family
        with none such is not found, so a deprecated family stops resolving."""
        kind = "images/family" if family else "images"
        if family:
            live = [
                i
                for (p, _), i in sorted(self.images.items())
                if p == project and i.get("family") == name and "deprecated" not in i
            ]
            found = live[-1] if live else None
        else:
            found = self.images.get((project, name))
        if found is None:
            raise ApiError(
                404,
                "notFound",
                f"The resource 'projects/{project}/global/{kind}/{name}' was not found",
            )
        return {
            "kind": "compute#image",
            "id": str(int(uuid.uuid5(uuid.NAMESPACE_URL, f"{project}/{found['name']}")) % 10**18),
            "selfLink": f"{API}/projects/{project}/global/images/{found['name']}",
            **found,
        }

    def _boot_image(self, resource: dict[str, Any]) -> None:
        """The boot disk's sourceImage must resolve; one OBSOLETE or DELETED is refused: "Operations
        which use OBSOLETE or DELETED resources will be rejected and result in an error"
        (compute_v1 DeprecationStatus.state)."""
        boot = next(d for d in resource["disks"] if d.get("boot"))
        source = boot["initializeParams"]["sourceImage"]
        m = re.search(r"projects/([^/]+)/global/images/(family/)?([^/]+)$", source)
        if m is None:
            raise invalid(
                "Invalid value for field 'resource.disks[0].initializeParams.sourceImage': "
                f"'{source}'."
            )
        image = self._image(m.group(1), m.group(3), family=bool(m.group(2)))
        if image.get("deprecated", {}).get("state") in ("OBSOLETE", "DELETED"):
            raise invalid(f"The resource '{source}' is {image['deprecated']['state'].lower()}.")

    def _insert(self, zone: str, request_id: str | None, body: Any) -> dict[str, Any]:
        _check_request_id(request_id)
        if request_id in self._request_ids:
            return self._poll(*self._request_ids[request_id])
        resource = _parse_instance(body, zone, self.project, self.networks, self.accelerator_zones)
        self._enforce_os_login(resource)
        self._boot_image(resource)
        name = resource["name"]
        if (zone, name) in self.instances:
            raise ApiError(
                409,
                "alreadyExists",
                f"The resource 'projects/{self.project}/zones/{zone}/instances/{name}' "
                "already exists",
            )
        quota = self._quota
        region = zone.rsplit("-", 1)[0]
        if quota and quota[2] in (None, region):
            message = _quota_message(quota[0], region)
            if quota[1] == "http":
                raise ApiError(403, "quotaExceeded", message, "usageLimits")
        target = {"name": name, "id": _new_id()}
        op = self._new_operation(zone, "insert", target)
        if request_id:
            op["clientOperationId"] = request_id
            self._request_ids[request_id] = (zone, op["name"])
        if zone in self._exhausted:
            code = self._exhausted[zone]
            error = {"code": code, "message": _no_resources(self.project, zone)}
            return self._schedule(zone, op, lambda: {"errors": [error]})
        if quota and quota[2] in (None, region):
            error = {"code": "QUOTA_EXCEEDED", "message": _quota_message(quota[0], region)}
            return self._schedule(zone, op, lambda: {"errors": [error]})
        instance = self._materialise(zone, resource, target["id"])
        instance["status"] = "PROVISIONING"
        spot = resource.get("scheduling", {}).get("provisioningModel") == "SPOT"
        if spot and zone in self._preempt_on_create:
            self._preempt_on_create.discard(zone)
            error = {
                "code": "UNSUPPORTED_OPERATION",
                "message": "Instance failed to start due to preemption.",
            }

            def preempted() -> dict[str, Any]:
                instance.update(status="TERMINATED", lastStopTimestamp=self._now())
                return {"errors": [error]}

            return self._schedule(zone, op, preempted)

        def boot() -> None:
            instance.update(status="RUNNING", lastStartTimestamp=self._now())

        return self._schedule(zone, op, boot)

    def _enforce_os_login(self, resource: dict[str, Any]) -> None:
        if "compute.requireOsLogin" not in self.constraints:
            return
        for item in resource.get("metadata", {}).get("items", []):
            if item["key"] == "enable-oslogin" and item.get("value", "").lower() != "true":
                raise ApiError(
                    412,
                    "conditionNotMet",
                    # what follows the constraint's sentence is not documented: left out
                    "Constraint constraints/compute.requireOsLogin violated for project "
                    f"projects/{self.project}.",
                )

    def _materialise(
        self, zone: str, body: dict[str, Any], instance_id: str | None = None
    ) -> dict[str, Any]:
        instance = json.loads(json.dumps(body))
        name = instance["name"]
        number = len(self.instances) + 2
        for nic_index, nic in enumerate(instance.get("networkInterfaces", [])):
            nic.update(name=f"nic{nic_index}", networkIP=f"10.128.0.{number}")
            for access in nic.get("accessConfigs", []):
                access["natIP"] = self.public_address or f"34.1.{number // 250}.{number % 250}"
        # The boot disk is made from initializeParams under the instance's name unless it
        # names one (compute_v1.AttachedDiskInitializeParams.disk_name: "If not specified, the
        # default is to use the name of the instance"); the instance links it by URL
        # (AttachedDisk.source). It stays with a stopped instance and is deleted with it.
        for disk in instance.get("disks", []):
            if disk.get("boot") and "source" not in disk:
                disk_name = disk.get("initializeParams", {}).get("diskName") or name
                disk["source"] = f"{API}/projects/{self.project}/zones/{zone}/disks/{disk_name}"
        instance.update(
            kind="compute#instance",
            id=instance_id or _new_id(),
            creationTimestamp=self._now(),
            zone=f"{API}/projects/{self.project}/zones/{zone}",
            machineType=f"{API}/projects/{self.project}/zones/{zone}/machineTypes/"
            + instance["machineType"].rsplit("/", 1)[-1],
            selfLink=f"{API}/projects/{self.project}/zones/{zone}/instances/{name}",
            status="RUNNING",
            lastStartTimestamp=self._now(),
        )
        self.instances[(zone, name)] = instance
        return instance

    def _find(self, zone: str, name: str) -> dict[str, Any]:
        instance = self.instances.get((zone, name))
        if instance is None:  # the API also takes the numeric id
            instance = next(
                (i for (z, _), i in self.instances.items() if z == zone and i["id"] == name), None
            )
        if instance is None:
            raise ApiError(
                404,
                "notFound",
                f"The resource 'projects/{self.project}/zones/{zone}/instances/{name}' was not "
                "found",
            )
        return instance

    def _stop_start(self, zone: str, name: str, verb: str, request_id: str | None) -> Any:
        _check_request_id(request_id)
        if request_id in self._request_ids:
            return self._poll(*self._request_ids[request_id])
        instance = self._find(zone, name)
        op = self._new_operation(zone, verb, instance)
        if request_id:
            self._request_ids[request_id] = (zone, op["name"])
        if verb == "stop":
            if instance["status"] in ("TERMINATED", "STOPPED"):
                return self._schedule(zone, op, lambda: None)
            instance["status"] = "STOPPING"

            def stopped() -> None:
                instance.update(status="TERMINATED", lastStopTimestamp=self._now())

            return self._schedule(zone, op, stopped)
        if instance["status"] == "RUNNING":
            return self._schedule(zone, op, lambda: None)
        if zone in self._exhausted:
            # A zone without stock refuses a restart as it refuses a create: "A resource
            # availability error occurs when a zone doesn't have enough available capacity to
            # provision the compute resources you requested to create, restart, or update
            # Compute Engine instances" (cloud.google.com/compute/docs/resource-error); the
            # operation ends DONE with the error and the instance stays stopped.
            error = {"code": self._exhausted[zone], "message": _no_resources(self.project, zone)}
            return self._schedule(zone, op, lambda: {"errors": [error]})
        instance["status"] = "STAGING"

        def started() -> None:
            instance.update(status="RUNNING", lastStartTimestamp=self._now())

        return self._schedule(zone, op, started)

    def _delete(self, zone: str, name: str, request_id: str | None) -> Any:
        _check_request_id(request_id)
        if request_id in self._request_ids:
            return self._poll(*self._request_ids[request_id])
        instance = self._find(zone, name)
        op = self._new_operation(zone, "delete", instance)
        if request_id:
            self._request_ids[request_id] = (zone, op["name"])
        instance["status"] = "STOPPING"

        def deleted() -> None:
            self.instances.pop((zone, instance["name"]), None)
            self._release_disks(instance)

        return self._schedule(zone, op, deleted)

    # --- persistent disks ------------------------------------------------------------------
    # disks.insert/get/list/aggregatedList/delete and instances.attachDisk/detachDisk. What is
    # refused, and how, comes from Google's own answers:
    # - an attach to an instance in another zone: 400 invalid "Invalid value for field
    #   'resource.source': '<disk URL>'. Disk must be in the same zone as the instance."
    #   (GoogleCloudPlatform/google-cloud-powershell#237, the API's answer quoted);
    # - an attach of a READ_WRITE disk some instance uses: the operation fails with
    #   RESOURCE_IN_USE_BY_ANOTHER_RESOURCE "The disk resource 'projects/P/zones/Z/disks/D' is
    #   already being used by 'projects/P/zones/Z/instances/I'" (openshift/release#7550: "GCE
    #   200 - RESOURCE_IN_USE_BY_ANOTHER_RESOURCE: The disk resource ... is already being used
    #   by ..."); compute_v1.AttachedDisk.mode: "READ_WRITE ... If not specified, the default is
    #   to attach the disk in READ_WRITE mode", and only READ_ONLY disks are shared;
    # - disks.delete while ``users`` is not empty: 400 resourceInUseByAnotherResource with the
    #   same sentence (hashicorp/terraform#23698 "Error 400: The disk resource ... is already
    #   being used by ..., resourceInUseByAnotherResource"; hashicorp/terraform#18898, gcloud);
    # - instance deletion deletes only its autoDelete disks and leaves the rest, no longer used
    #   ("Specifies whether the disk will be auto-deleted when the instance is deleted (but not
    #   when the disk is detached from the instance)", compute_v1.AttachedDisk.auto_delete).

    def _route_disks(
        self,
        method: str,
        path: str,
        zone: str,
        name: str | None,
        verb: str | None,
        query: dict[str, str],
        body: Any,
    ) -> Any:
        if name is None and method == "POST":
            _allow(query, {"requestId", "sourceImage"})
            return self._insert_disk(zone, query.get("requestId"), body)
        if name is None and method == "GET":
            _allow(query, LIST_PARAMS)
            found = [d for (z, _), d in sorted(self.disks.items()) if z == zone]
            return self._list("compute#diskList", found, query, "items")
        if name and verb is None and method == "GET":
            _allow(query, set())
            return self._find_disk(zone, name)
        if name and verb is None and method == "DELETE":
            _allow(query, {"requestId"})
            return self._delete_disk(zone, name, query.get("requestId"))
        raise ApiError(404, "notFound", f"The resource '{path}' was not found")

    def _disk_path(self, zone: str, name: str) -> str:
        return f"projects/{self.project}/zones/{zone}/disks/{name}"

    def _find_disk(self, zone: str, name: str) -> dict[str, Any]:
        disk = self.disks.get((zone, name))
        if disk is None:
            raise ApiError(
                404, "notFound", f"The resource '{self._disk_path(zone, name)}' was not found"
            )
        return disk

    def _insert_disk(self, zone: str, request_id: str | None, body: Any) -> dict[str, Any]:
        from google.cloud import compute_v1

        _check_request_id(request_id)
        if request_id in self._request_ids:
            return self._poll(*self._request_ids[request_id])
        if not isinstance(body, dict):
            raise invalid("Required field 'resource' not specified")
        try:
            compute_v1.Disk.from_json(json.dumps(body), ignore_unknown_fields=False)
        except Exception as exc:
            raise invalid(f"Invalid JSON payload received. {exc}") from None
        name = body.get("name", "")
        if not NAME_RE.match(name):
            raise invalid(f"Invalid value for field 'resource.name': '{name}'.")
        for key, value in body.get("labels", {}).items():
            if not LABEL_KEY_RE.match(key) or not LABEL_VALUE_RE.match(value):
                raise invalid(f"Invalid value for field 'resource.labels': '{key}={value}'.")
        # compute_v1.Disk.type_: "URL of the disk type resource describing which disk type to
        # use to create the disk. Provide this when creating the disk." (default pd-standard)
        type_url = body.get("type") or f"zones/{zone}/diskTypes/pd-standard"
        disk_type = zonal_name(type_url, "diskTypes", self.project, zone)
        if disk_type not in PERSISTENT_DISKS | HYPERDISKS:
            raise invalid(f"Invalid value for field 'resource.type': '{type_url}'.")
        if (zone, name) in self.disks:
            raise ApiError(
                409, "alreadyExists", f"The resource '{self._disk_path(zone, name)}' already exists"
            )
        zone_url = f"{API}/projects/{self.project}/zones/{zone}"
        disk = {
            "kind": "compute#disk",
            "id": _new_id(),
            "creationTimestamp": self._now(),
            "name": name,
            "sizeGb": str(body.get("sizeGb") or 10),
            "zone": zone_url,
            "status": "CREATING",
            "selfLink": f"{zone_url}/disks/{name}",
            "type": f"{zone_url}/diskTypes/{disk_type}",
            "labels": dict(body.get("labels", {})),
            "labelFingerprint": "42WmSpB8rSM=",
            "physicalBlockSizeBytes": "4096",
        }
        self.disks[(zone, name)] = disk
        op = self._new_operation(zone, "insert", disk, "disks")
        if request_id:
            op["clientOperationId"] = request_id
            self._request_ids[request_id] = (zone, op["name"])
        return self._schedule(zone, op, lambda: disk.update(status="READY") and None)

    def _delete_disk(self, zone: str, name: str, request_id: str | None) -> dict[str, Any]:
        _check_request_id(request_id)
        if request_id in self._request_ids:
            return self._poll(*self._request_ids[request_id])
        disk = self._find_disk(zone, name)
        if disk.get("users"):
            raise ApiError(400, "resourceInUseByAnotherResource", self._in_use(disk))
        op = self._new_operation(zone, "delete", disk, "disks")
        if request_id:
            self._request_ids[request_id] = (zone, op["name"])
        disk["status"] = "DELETING"
        return self._schedule(zone, op, lambda: self.disks.pop((zone, name), None) and None)

    def _in_use(self, disk: dict[str, Any]) -> str:
        zone = disk["zone"].rsplit("/", 1)[-1]
        user = disk["users"][0].split("/compute/v1/", 1)[-1]
        return (
            f"The disk resource '{self._disk_path(zone, disk['name'])}' is already being used "
            f"by '{user}'"
        )

    def _attach_disk(
        self, zone: str, name: str, request_id: str | None, body: Any
    ) -> dict[str, Any]:
        from google.cloud import compute_v1

        _check_request_id(request_id)
        if request_id in self._request_ids:
            return self._poll(*self._request_ids[request_id])
        if not isinstance(body, dict):
            raise invalid("Required field 'resource' not specified")
        try:
            compute_v1.AttachedDisk.from_json(json.dumps(body), ignore_unknown_fields=False)
        except Exception as exc:
            raise invalid(f"Invalid JSON payload received. {exc}") from None
        instance = self._find(zone, name)
        source = body.get("source", "")
        disk_name = zonal_name(source, "disks", self.project, zone)
        if disk_name is None:
            raise invalid(
                f"Invalid value for field 'resource.source': '{source}'. "
                "Disk must be in the same zone as the instance."
            )
        disk = self._find_disk(zone, disk_name)
        op = self._new_operation(zone, "attachDisk", instance)
        if request_id:
            self._request_ids[request_id] = (zone, op["name"])
        # A data disk obeys the same series rule as a boot disk (BOOT_DISK_FORBIDDEN: A3 Ultra
        # takes no Persistent Disk, N1 and A2 no Hyperdisk). The attach is accepted, then its
        # operation ends in error: "operation ... failed (UNSUPPORTED_OPERATION): [pd-balanced,
        # c4-standard-16] features are not compatible for creating instance."
        # (astronomer/astronomer#2463, a GKE attach of a pd-balanced volume to a Hyperdisk-only
        # machine; NVIDIA/aicr#2338 the same for a4x-highgpu-4g).
        machine = instance["machineType"].rsplit("/", 1)[-1]
        disk_type = disk["type"].rsplit("/", 1)[-1]
        if disk_type in BOOT_DISK_FORBIDDEN.get(machine_series(machine), frozenset()):
            unsupported = {
                "code": "UNSUPPORTED_OPERATION",
                "message": incompatible(disk_type, machine).message,
            }
            return self._schedule(zone, op, lambda: {"errors": [unsupported]})
        mode = body.get("mode", "READ_WRITE")
        if disk.get("users") and (
            mode == "READ_WRITE"
            or any(
                d.get("mode", "READ_WRITE") == "READ_WRITE"
                for other in self.instances.values()
                for d in other.get("disks", [])
                if d.get("source") == disk["selfLink"]
            )
        ):
            error = {"code": "RESOURCE_IN_USE_BY_ANOTHER_RESOURCE", "message": self._in_use(disk)}
            return self._schedule(zone, op, lambda: {"errors": [error]})

        def attached() -> None:
            entry = {
                "kind": "compute#attachedDisk",
                "type": "PERSISTENT",
                "mode": mode,
                "source": disk["selfLink"],
                "deviceName": body.get("deviceName")
                or f"persistent-disk-{len(instance.get('disks', []))}",
                "index": len(instance.get("disks", [])),
                "boot": False,
                "autoDelete": bool(body.get("autoDelete", False)),
                "interface": "SCSI",
                "diskSizeGb": disk["sizeGb"],
            }
            instance.setdefault("disks", []).append(entry)
            disk.setdefault("users", []).append(instance["selfLink"])
            disk["lastAttachTimestamp"] = self._now()

        return self._schedule(zone, op, attached)

    def _detach_disk(
        self, zone: str, name: str, request_id: str | None, device: str | None
    ) -> dict[str, Any]:
        _check_request_id(request_id)
        if request_id in self._request_ids:
            return self._poll(*self._request_ids[request_id])
        instance = self._find(zone, name)
        # compute_v1.DetachDiskInstanceRequest.device_name: "The device name of the disk to
        # detach. Make a get() request on the instance to view currently attached disks and
        # device names." A name no attached disk carries is refused.
        entry = next(
            (d for d in instance.get("disks", []) if d.get("deviceName") == device and device),
            None,
        )
        if entry is None:
            raise invalid(f"Invalid value for field 'deviceName': '{device}'.")
        op = self._new_operation(zone, "detachDisk", instance)
        if request_id:
            self._request_ids[request_id] = (zone, op["name"])

        def detached() -> None:
            instance["disks"].remove(entry)
            for disk in self.disks.values():
                if disk["selfLink"] == entry.get("source"):
                    disk["users"] = [u for u in disk.get("users", []) if u != instance["selfLink"]]
                    disk["lastDetachTimestamp"] = self._now()

        return self._schedule(zone, op, detached)

    def _release_disks(self, instance: dict[str, Any]) -> None:
        """The instance is gone: its autoDelete disks with it, the others left unused."""
        for entry in instance.get("disks", []):
            for key, disk in list(self.disks.items()):
                if disk["selfLink"] != entry.get("source"):
                    continue
                if entry.get("autoDelete"):
                    del self.disks[key]
                else:
                    disk["users"] = [u for u in disk.get("users", []) if u != instance["selfLink"]]
                    disk["lastDetachTimestamp"] = self._now()

    # --- operations ------------------------------------------------------------------------

    def _new_operation(
        self, zone: str, op_type: str, target: dict[str, Any], collection: str = "instances"
    ) -> dict[str, Any]:
        """A zonal operation, or a global one when ``zone`` is GLOBAL (no ``zone`` field)."""
        name = f"operation-{uuid.uuid4().hex[:13]}-{uuid.uuid4().hex[:8]}"
        scope = "global" if zone == GLOBAL else f"zones/{zone}"
        zone_url = f"{API}/projects/{self.project}/{scope}"
        op = {
            "kind": "compute#operation",
            "id": _new_id(),
            "name": name,
            **({} if zone == GLOBAL else {"zone": zone_url}),
            "operationType": op_type,
            "targetLink": f"{zone_url}/{collection}/{target['name']}",
            "targetId": target["id"],
            "status": "PENDING",
            "user": "user@example.com",
            "progress": 0,
            "insertTime": self._now(),
            "selfLink": f"{zone_url}/operations/{name}",
        }
        self._operation_store(zone)[(zone, name)] = op
        return op

    def _operation_store(self, zone: str) -> dict[tuple[str, str], dict[str, Any]]:
        return self.global_operations if zone == GLOBAL else self.operations

    def _schedule(
        self, zone: str, op: dict[str, Any], finish: Callable[[], dict[str, Any] | None]
    ) -> dict[str, Any]:
        op["startTime"] = self._now()
        self._pending[(zone, op["name"])] = _Pending(self._op_polls, finish)
        return self._poll(zone, op["name"], count=False)

    def _poll(self, zone: str, name: str, *, count: bool = True) -> dict[str, Any]:
        op = self._operation_store(zone).get((zone, name))
        if op is None:
            scope = "global" if zone == GLOBAL else f"zones/{zone}"
            raise ApiError(
                404,
                "notFound",
                f"The resource 'projects/{self.project}/{scope}/operations/{name}' was not found",
            )
        pending = self._pending.get((zone, name))
        if pending is not None:
            if count:
                pending.polls -= 1
            if pending.polls <= 0:
                del self._pending[(zone, name)]
                error = pending.finish()
                op.update(status="DONE", progress=100, endTime=self._now())
                if error:
                    op["error"] = error
            else:
                op.update(status="RUNNING", progress=50)
        return op

    # --- listing ---------------------------------------------------------------------------

    def _matching(self, items: list[dict[str, Any]], query: dict[str, str]) -> list[dict]:
        terms = parse_filter(query.get("filter", ""))
        return [item for item in items if all(t(item) for t in terms)]

    def _page(self, items: list[Any], query: dict[str, str]) -> tuple[list[Any], str]:
        try:
            size = int(query.get("maxResults", "500"))
        except ValueError:
            raise invalid("Invalid value for field 'maxResults'") from None
        if not 0 <= size <= 500:
            raise invalid(f"Invalid value for field 'maxResults': {size}. Must be in [0, 500].")
        size = min(size or 500, self.max_page_size)
        start = 0
        if query.get("pageToken"):
            try:
                start = int(base64.urlsafe_b64decode(query["pageToken"]).decode())
            except ValueError:
                raise invalid("Invalid value for field 'pageToken'") from None
        end = start + size
        token = base64.urlsafe_b64encode(str(end).encode()).decode() if end < len(items) else ""
        return items[start:end], token

    def _list(self, kind: str, items: list[dict], query: dict[str, str], key: str) -> Any:
        page, token = self._page(self._matching(items, query), query)
        answer: dict[str, Any] = {"kind": kind, key: page, "selfLink": "", "id": kind}
        if token:
            answer["nextPageToken"] = token
        return answer

    def _aggregated(self, query: dict[str, str], kind: str = "instances") -> Any:
        """instances.aggregatedList or disks.aggregatedList: the page's items by zone scope."""
        store = self.instances if kind == "instances" else self.disks
        found = self._matching([i for _, i in sorted(store.items())], query)
        page, token = self._page(found, query)
        items: dict[str, Any] = {}
        for item in page:
            scope = "zones/" + item["zone"].rsplit("/", 1)[-1]
            items.setdefault(scope, {kind: []})[kind].append(item)
        singular = "instance" if kind == "instances" else "disk"
        answer: dict[str, Any] = {
            "kind": f"compute#{singular}AggregatedList",
            "id": f"projects/{self.project}/aggregated/{kind}",
            "items": items,
            "selfLink": f"{API}/projects/{self.project}/aggregated/{kind}",
        }
        if token:
            answer["nextPageToken"] = token
        return answer

    # --- billing ---------------------------------------------------------------------------

    def _billing(self, query: dict[str, str], headers: dict[str, str]) -> Any:
        key = query.get("key") or headers.get("x-goog-api-key", "")
        if key != self.billing_api_key:
            raise ApiError(
                400, "API_KEY_INVALID", "API key not valid. Please pass a valid API key."
            )
        _allow(query, {"key", "pageSize", "pageToken", "currencyCode", "startTime", "endTime"})
        token = query.get("pageToken") or "0"
        if not token.isdigit() or int(token) >= len(self.billing_pages):
            raise invalid(f"Invalid value for field 'pageToken': '{token}'.")
        return self.billing_pages[int(token)]

    def _now(self) -> str:
        """A logical clock: every timestamp is one second after the last one."""
        self._clock += timedelta(seconds=1)
        return self._clock.isoformat(timespec="milliseconds")


def _pacific(at: datetime) -> str:
    """``at`` in RFC 3339 at UTC-08:00, milliseconds, as GCP's answers carry their times."""
    return at.astimezone(timezone(timedelta(hours=-8))).isoformat(timespec="milliseconds")


class _Handler(BaseHTTPRequestHandler):
    emulator: GCPEmulator
    protocol_version = "HTTP/1.1"

    def _serve(self) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        emulator = self.emulator
        with emulator._lock:
            emulator.requests.append(Recorded(self.command, parts.path, query, body, headers))
            if isinstance(body, str):
                error = invalid("Invalid JSON payload received.")
                status, answer = error.status, error.body()
            else:
                status, answer = emulator.handle(self.command, parts.path, query, body, headers)
        payload = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_DELETE = do_PATCH = _serve

    def log_message(self, format: str, *args: Any) -> None:
        pass


# --- strict request parsing -------------------------------------------------------------------


def _allow(query: dict[str, str], allowed: set[str]) -> None:
    unknown = set(query) - allowed
    if unknown:
        raise invalid(f"Invalid JSON payload received. Unknown name {sorted(unknown)[0]!r}")


def _check_request_id(request_id: str | None) -> None:
    if request_id is None:
        return
    try:
        parsed = uuid.UUID(request_id)
    except ValueError:
        raise invalid(f"Invalid value for field 'requestId': '{request_id}'.") from None
    if parsed.int == 0 or str(parsed) != request_id.lower():
        raise invalid(f"Invalid value for field 'requestId': '{request_id}'.")


def zonal_name(url: str, kind: str, project: str, zone: str) -> str | None:
    """The resource name a full or partial URL of a zonal resource names (``kind`` is e.g.
    ``machineTypes``), or None when it is malformed or points at another project or zone."""
    for root in URL_ROOTS:
        if url.startswith(root):
            url = url[len(root) :]
            if not url.startswith("projects/"):
                return None
            break
    match = re.fullmatch(rf"(?:projects/([^/]+)/)?zones/([^/]+)/{kind}/([^/]+)", url)
    if not match or match.group(1) not in (None, project) or match.group(2) != zone:
        return None
    return match.group(3)


def machine_series(machine_type: str) -> str:
    """``a3-ultragpu-8g`` -> ``a3-ultragpu``; ``n1-standard-4`` -> ``n1``."""
    family, _, rest = machine_type.partition("-")
    return f"{family}-{rest.split('-')[0]}" if family in ("a2", "a3") else family


def incompatible(*features: str) -> ApiError:
    message = f"[{', '.join(features)}] features are not compatible for creating instance."
    return ApiError(400, "badRequest", message)


def _parse_instance(
    body: Any,
    zone: str,
    project: str,
    networks: set[str],
    accelerator_zones: dict[str, frozenset[str]],
) -> dict[str, Any]:
    """Parse with the SDK's own type (unknown fields refused), then apply GCP's rules. Returns
    the body with machineType, acceleratorType and diskType in their full-URL form."""
    from google.cloud import compute_v1

    if not isinstance(body, dict):
        raise invalid("Required field 'resource' not specified")
    try:
        compute_v1.Instance.from_json(json.dumps(body), ignore_unknown_fields=False)
    except Exception as exc:  # json_format.ParseError and friends
        raise invalid(f"Invalid JSON payload received. {exc}") from None
    body = json.loads(json.dumps(body))
    zone_url = f"{API}/projects/{project}/zones/{zone}"
    name = body.get("name", "")
    if not NAME_RE.match(name):
        raise invalid(f"Invalid value for field 'resource.name': '{name}'.")
    machine = zonal_name(body.get("machineType", ""), "machineTypes", project, zone)
    if machine not in MACHINE_TYPES:
        raise invalid(
            f"Invalid value for field 'resource.machineType': '{body.get('machineType')}'. "
            f"Machine type does not exist in zone '{zone}'."
        )
    body["machineType"] = f"{zone_url}/machineTypes/{machine}"
    family = machine.split("-", 1)[0]
    if len(body.get("labels", {})) > 64:  # "No more than 64 labels" (labels requirements)
        raise invalid("Invalid value for field 'resource.labels': at most 64 labels.")
    for key, value in body.get("labels", {}).items():
        if not LABEL_KEY_RE.match(key) or not LABEL_VALUE_RE.match(value):
            raise invalid(f"Invalid value for field 'resource.labels': '{key}={value}'.")
    accelerators = body.get("guestAccelerators", [])
    for i, acc in enumerate(accelerators):
        url = acc.get("acceleratorType", "")
        accelerator = zonal_name(url, "acceleratorTypes", project, zone)
        if accelerator is None:
            raise invalid(
                f"Invalid value for field 'resource.guestAccelerators[{i}].acceleratorType': "
                f"'{url}'."
            )
        if zone not in accelerator_zones.get(accelerator, frozenset()):
            raise ApiError(
                400,
                "badRequest",
                f"The resource 'projects/{project}/zones/{zone}/acceleratorTypes/{accelerator}' "
                "was not found",
            )
        if family != "n1":  # a2/a3/g2 bring their own GPUs; skypilot-org/skypilot#212 shows
            # "[nvidia-tesla-a100, n1-highmem-8] features are not compatible for creating
            # instance." for a pairing GCP does not offer
            raise incompatible(accelerator, machine)
        count = acc.get("acceleratorCount")
        allowed = ACCELERATOR_COUNTS[accelerator]
        if count not in allowed:
            raise invalid(
                f"Invalid value for field 'resource.guestAccelerators[{i}].acceleratorCount': "
                f"'{count}'. Number of accelerator cards attached to an instance must be one of "
                f"[{', '.join(map(str, allowed))}]."
            )
        acc["acceleratorType"] = f"{zone_url}/acceleratorTypes/{accelerator}"
    scheduling = body.get("scheduling", {})
    has_gpu = bool(accelerators) or MACHINE_TYPES[machine][1] > 0
    if has_gpu and scheduling.get("onHostMaintenance") != "TERMINATE":
        raise invalid("Instances with guest accelerators do not support live migration.")
    model = scheduling.get("provisioningModel", "STANDARD")
    if model not in ("STANDARD", "SPOT"):
        raise invalid(f"Invalid value for field 'resource.scheduling.provisioningModel': '{model}'")
    if family == "a3" and MACHINE_TYPES[machine][1] < 8 and model != "SPOT":
        raise invalid(f"Machine type {machine} is only available as Spot or Flex-start VM.")
    nics = body.get("networkInterfaces") or [{}]
    if family == "a3" and nics[0].get("nicType") != "GVNIC":
        raise invalid(f"Machine type {machine} requires a gVNIC network interface.")
    if model == "SPOT":
        if scheduling.get("automaticRestart", True):
            raise invalid("Spot VMs must have automaticRestart set to false.")
        if scheduling.get("instanceTerminationAction") not in ("STOP", "DELETE"):
            raise invalid("Invalid value for field 'resource.scheduling.instanceTerminationAction'")
    elif "instanceTerminationAction" in scheduling:
        raise invalid("instanceTerminationAction is only allowed for Spot VMs.")
    boot = [d for d in body.get("disks", []) if d.get("boot")]
    if len(boot) != 1 or not boot[0].get("initializeParams", {}).get("sourceImage"):
        raise invalid("Exactly one boot disk with initializeParams.sourceImage is required.")
    params = boot[0]["initializeParams"]
    for key, value in params.get("labels", {}).items():  # the same rules as the instance's
        if not LABEL_KEY_RE.match(key) or not LABEL_VALUE_RE.match(value):
            raise invalid(
                f"Invalid value for field 'resource.disks[0].initializeParams.labels': "
                f"'{key}={value}'."
            )
    if int(params.get("diskSizeGb", 10)) < 10:
        raise invalid("Invalid value for field 'resource.disks[0].initializeParams.diskSizeGb'")
    # Without a diskType the series' default applies: pd-standard for N1/N2-era series,
    # hyperdisk-balanced for A3 and newer (compute_v1.AttachedDiskInitializeParams.disk_type).
    default_disk = "hyperdisk-balanced" if family == "a3" else "pd-standard"
    disk_url = params.get("diskType") or f"zones/{zone}/diskTypes/{default_disk}"
    disk = zonal_name(disk_url, "diskTypes", project, zone)
    if disk not in PERSISTENT_DISKS | HYPERDISKS:
        raise invalid(
            f"Invalid value for field 'resource.disks[0].initializeParams.diskType': '{disk_url}'."
        )
    if disk in BOOT_DISK_FORBIDDEN.get(machine_series(machine), frozenset()):
        raise incompatible(disk, machine)
    params["diskType"] = f"{zone_url}/diskTypes/{disk}"
    if not body.get("networkInterfaces") or not body["networkInterfaces"][0].get("network"):
        raise invalid("At least one network interface with a network is required.")
    for i, nic in enumerate(body["networkInterfaces"]):
        # A project may have no `default` network (it can be deleted, or an organization policy
        # skips creating it): "Invalid value for field 'resource.networkInterfaces[0].network':
        # '...'. The referenced network resource cannot be found." (seen from gcloud).
        network = nic["network"]
        match = re.fullmatch(
            r"(?:(?:https://[^/]+/compute/v1/)?projects/([^/]+)/)?global/networks/([^/]+)", network
        )
        if not match or match.group(1) not in (None, project) or match.group(2) not in networks:
            raise invalid(
                f"Invalid value for field 'resource.networkInterfaces[{i}].network': '{network}'. "
                "The referenced network resource cannot be found."
            )
    # compute_v1.Tags.items: "Each tag must be 1-63 characters long, and comply with RFC1035."
    for i, tag in enumerate(body.get("tags", {}).get("items", [])):
        if not NAME_RE.match(tag):
            raise invalid(f"Invalid value for field 'resource.tags.items[{i}]': '{tag}'.")
    items = body.get("metadata", {}).get("items", [])
    keys = [item["key"] for item in items]
    if len(keys) != len(set(keys)):
        raise invalid("Invalid value for field 'resource.metadata': duplicate keys.")
    # compute_v1 Items.value: "their size must be less than or equal to 262144 bytes (256
    # KiB)"; Compute Engine answers a value past it "Value for field '...metadata.items[2].value'
    # is too large: maximum size 32768 character(s); actual size 33595." (kubernetes/kubernetes
    # #37180, when the limit was 32 KB). Metadata.items: "The total size of all keys and values
    # must be less than 512 KB" (the message for that is not documented: worded alike).
    for i, item in enumerate(items):
        size = len(item.get("value", "").encode())
        if size > 262_144:
            raise invalid(
                f"Value for field 'resource.metadata.items[{i}].value' is too large: maximum "
                f"size 262144 character(s); actual size {size}."
            )
    total = sum(len(item["key"].encode()) + len(item.get("value", "").encode()) for item in items)
    if total >= 512 * 1024:
        raise invalid(
            f"Value for field 'resource.metadata' is too large: maximum size 524288 "
            f"character(s); actual size {total}."
        )
    return body


def _parse_firewall(body: Any, project: str, networks: set[str]) -> dict[str, Any]:
    """Parse a firewalls.insert body with the SDK's own ``compute_v1.Firewall`` (unknown fields
    refused), then apply the rules its docstrings state. Returns the body with ``network`` as
    a full URL and the defaults filled in."""
    from google.cloud import compute_v1

    if not isinstance(body, dict):
        raise invalid("Required field 'resource' not specified")
    try:
        compute_v1.Firewall.from_json(json.dumps(body), ignore_unknown_fields=False)
    except Exception as exc:  # json_format.ParseError and friends
        raise invalid(f"Invalid JSON payload received. {exc}") from None
    body = json.loads(json.dumps(body))
    name = body.get("name", "")
    if not NAME_RE.match(name):  # Firewall.name: 1-63 characters, [a-z]([-a-z0-9]*[a-z0-9])?
        raise invalid(f"Invalid value for field 'resource.name': '{name}'.")
    # Firewall.network: "If not specified when creating a firewall rule, the default network is
    # used", given as a full or partial URL. A bare name is refused "Invalid value for field
    # 'resource.network': 'default'. The URL is malformed." (GoogleCloudPlatform/
    # google-cloud-powershell#458); another project's network "Cross-project references for
    # this resource type are not allowed." (AppScale/appscale-tools#339); a network the project
    # lacks is a 404 notFound "The resource 'projects/P/global/networks/N' was not found"
    # (skyplane-project/skyplane#683, broadinstitute/sparklespray#12).
    network = body.get("network") or "global/networks/default"
    match = NETWORK_RE.fullmatch(network)
    if not match:
        raise invalid(
            f"Invalid value for field 'resource.network': '{network}'. The URL is malformed."
        )
    if match.group(1) not in (None, project):
        raise invalid(
            f"Invalid value for field 'resource.network': '{network}'.  Cross-project references "
            "for this resource type are not allowed."
        )
    if match.group(2) not in networks:
        raise ApiError(
            404,
            "notFound",
            f"The resource 'projects/{project}/global/networks/{match.group(2)}' was not found",
        )
    body["network"] = f"{API}/projects/{project}/global/networks/{match.group(2)}"
    # Firewall.direction: INGRESS (the default) or EGRESS; "For EGRESS traffic, you cannot
    # specify the sourceTags fields".
    direction = body.get("direction", "INGRESS")
    if direction not in ("INGRESS", "EGRESS") or (direction == "EGRESS" and body.get("sourceTags")):
        raise invalid(f"Invalid value for field 'resource.direction': '{direction}'.")
    # Firewall.priority: "an integer between 0 and 65535, both inclusive".
    priority = body.get("priority", 1000)
    if not 0 <= int(priority) <= 65535:
        raise invalid(f"Invalid value for field 'resource.priority': '{priority}'.")
    # Firewall.targetServiceAccounts "cannot be used at the same time as targetTags or sourceTags".
    if body.get("targetServiceAccounts") and (body.get("targetTags") or body.get("sourceTags")):
        raise invalid("Invalid value for field 'resource.targetServiceAccounts'.")
    for field_name in ("sourceTags", "targetTags"):  # tags are RFC1035 names (compute_v1.Tags)
        for i, tag in enumerate(body.get(field_name, [])):
            if not NAME_RE.match(tag):
                raise invalid(f"Invalid value for field 'resource.{field_name}[{i}]': '{tag}'.")
    # sourceRanges/destinationRanges "must be expressed in CIDR format"; "A firewall rule can
    # contain either IPv4 or IPv6 ranges, but not both" (cloud.google.com/firewall/docs/
    # using-firewalls).
    for field_name in ("sourceRanges", "destinationRanges"):
        versions = set()
        for i, text in enumerate(body.get(field_name, [])):
            try:
                versions.add(_cidr(text).version)
            except ValueError:
                raise invalid(
                    f"Invalid value for field 'resource.{field_name}[{i}]': '{text}'."
                ) from None
        if len(versions) > 1:
            raise invalid(f"Invalid value for field 'resource.{field_name}': IPv4 and IPv6 mixed.")
    for field_name in ("allowed", "denied"):
        for i, entry in enumerate(body.get(field_name, [])):
            where = f"resource.{field_name}[{i}]"
            protocol = str(entry.get("IPProtocol", "")).lower()
            # "The protocol type is required when creating a firewall rule": a well-known name or
            # an IP protocol number.
            if protocol not in FIREWALL_PROTOCOLS and not (
                protocol.isdigit() and 0 <= int(protocol) <= 255
            ):
                raise invalid(f"Invalid value for field '{where}.IPProtocol': '{protocol}'.")
            ports = entry.get("ports", [])
            if ports and protocol not in PORT_PROTOCOLS:
                raise invalid(f"Invalid value for field '{where}.ports': ports need tcp or udp.")
            for j, port in enumerate(ports):  # "either an integer or a range"
                low, _, high = str(port).partition("-")
                bounds = [low, high or low]
                numeric = all(b.isdigit() and int(b) <= 65535 for b in bounds)
                if not numeric or int(bounds[0]) > int(bounds[1]):
                    raise invalid(f"Invalid value for field '{where}.ports[{j}]': '{port}'.")
    return body


def _network_name(url: str) -> str:
    match = NETWORK_RE.fullmatch(url)
    return match.group(2) if match else url


def _cidr(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(text, strict=False)


def _covers_ssh(entry: dict[str, Any]) -> bool:
    """Does an allowed/denied entry cover tcp:22? ("all" or no ports: every port)."""
    protocol = str(entry.get("IPProtocol", "")).lower()
    if protocol not in ("tcp", "6", "all"):
        return False
    ports = entry.get("ports") or ["0-65535"]
    for port in ports:
        low, _, high = str(port).partition("-")
        if int(low) <= 22 <= int(high or low):
            return True
    return False


def _is_call(method: str, path: str, call: str | None) -> bool:
    """Is this request the ``call`` ("METHOD /path-suffix"; None: any request)?"""
    if call is None:
        return True
    want_method, _, suffix = call.partition(" ")
    return method == want_method and path.endswith(suffix)


def parse_filter(text: str) -> list[Callable[[dict[str, Any]], bool]]:
    """The subset of the list-filter grammar we need: ``field = value`` / ``field != value``
    terms, optionally parenthesised and quoted, joined by ``AND``. Anything else is a 400."""
    if not text.strip():
        return []
    terms = []
    for raw in re.split(r"\s+AND\s+", text.strip()):
        match = re.fullmatch(
            r'\(?\s*([A-Za-z][\w.-]*)\s*(=|!=)\s*(?:"([^"]*)"|([^\s()"]+))\s*\)?', raw.strip()
        )
        if not match:
            raise invalid(f"Invalid value for field 'filter': '{text}'. Invalid list filter")
        path, op, quoted, bare = match.groups()
        value = quoted if quoted is not None else bare

        def term(item: dict[str, Any], path: str = path, op: str = op, value: str = value) -> bool:
            current: Any = item
            for part in path.split("."):
                current = current.get(part) if isinstance(current, dict) else None
            equal = current is not None and str(current) == value
            return equal if op == "=" else not equal

        terms.append(term)
    return terms


def _quota_message(quota: str, region: str) -> str:
    where = "globally" if quota.endswith("ALL_REGIONS") else f"in region {region}"
    return f"Quota '{quota}' exceeded.  Limit: 0.0 {where}."


def _no_resources(project: str, zone: str) -> str:
    return (
        f"The zone 'projects/{project}/zones/{zone}' does not have enough resources available "
        "to fulfill the request.  Try a different zone, or try again later."
    )


def _new_id() -> str:
    return str(random.randrange(10**18, 10**19))


# --- Cloud Billing Catalog fixture ------------------------------------------------------------

_AMERICAS = ["us-central1", "us-east1", "us-east4", "us-west1", "us-west4"]
_EMEA = ["europe-west4", "europe-west1"]


def _sku(
    sku_id: str,
    description: str,
    group: str,
    usage: str,
    regions: list[str],
    price: str,
    unit: str = "h",
    family: str = "Compute",
) -> dict[str, Any]:
    units, _, frac = price.partition(".")
    nanos = int((frac + "000000000")[:9])
    return {
        "name": f"services/{BILLING_SERVICE}/skus/{sku_id}",
        "skuId": sku_id,
        "description": description,
        "category": {
            "serviceDisplayName": "Compute Engine",
            "resourceFamily": family,
            "resourceGroup": group,
            "usageType": usage,
        },
        "serviceRegions": regions,
        "pricingInfo": [
            {
                "summary": "",
                "pricingExpression": {
                    "usageUnit": unit,
                    "displayQuantity": 1,
                    "tieredRates": [
                        {
                            "startUsageAmount": 0,
                            "unitPrice": {"currencyCode": "USD", "units": units, "nanos": nanos},
                        }
                    ],
                    "usageUnitDescription": "hour" if unit == "h" else "gibibyte hour",
                    "baseUnit": "s" if unit == "h" else "By.s",
                    "baseUnitDescription": "second" if unit == "h" else "byte second",
                    "baseUnitConversionFactor": 3600 if unit == "h" else 3865470566400,
                },
                "currencyConversionRate": 1,
                "effectiveTime": "2026-11-29T12:00:00.000Z",
            }
        ],
        "serviceProviderName": "Google",
        "geoTaxonomy": {
            "type": "MULTI_REGIONAL" if len(regions) > 1 else "REGIONAL",
            "regions": regions,
        },
    }


def billing_fixture_pages() -> list[dict[str, Any]]:
    """Three pages of Compute Engine SKUs in the catalog's shape. The us-central1 ("Americas")
    unit prices reproduce SkyPilot's catalog for a2-highgpu-1g (0.73948 host + 2.93391 A100)
    and g2-standard-4 (0.14679 + 0.56004 L4); the rest are plausible. The A3 Mega and A3 Ultra
    GPUs have SKUs of their own ("Nvidia H100 80GB Mega GPU", "H200 141GB GPU": newer GPU SKUs
    drop "Nvidia"), A3 Ultra hosts too ("A3 Ultra Instance Core"). Noise SKUs (storage,
    commitments, custom/sole-tenant, vWS) must be ignored by the parser."""
    skus = []
    n = 0

    def add(*args: Any, **kwargs: Any) -> None:
        nonlocal n
        n += 1
        skus.append(_sku(f"{n:04X}-A1B2-C3D4", *args, **kwargs))

    for where, regions, factor in (("Americas", _AMERICAS, 1), ("EMEA", _EMEA, 1.1)):

        def p(value: float, factor: float = factor) -> str:
            return f"{value * factor:.9f}"

        for series, label, core, ram in (
            ("A2", "A2 Instance", 0.031611, 0.004237),
            ("A3", "A3 Instance", 0.0295, 0.0017757),
            ("A3 Ultra", "A3 Ultra Instance", 0.0307, 0.0019),
            ("G2", "G2 Instance", 0.02229, 0.0036019),
        ):
            add(f"{label} Core running in {where}", "CPU", "OnDemand", regions, p(core))
            add(f"{label} Ram running in {where}", "RAM", "OnDemand", regions, p(ram), "GiBy.h")
            add(
                f"Spot Preemptible {label} Core running in {where}",
                "CPU",
                "Preemptible",
                regions,
                p(core / 2),
            )
            add(
                f"Spot Preemptible {label} Ram running in {where}",
                "RAM",
                "Preemptible",
                regions,
                p(ram / 2),
                "GiBy.h",
            )
            add(
                f"Commitment v1: {series} Cpu in {where} for 1 Year",
                "CPU",
                "Commit1Yr",
                regions,
                p(core * 0.63),
            )
        add(
            f"N1 Predefined Instance Core running in {where}",
            "N1Standard",
            "OnDemand",
            regions,
            p(0.031611),
        )
        add(
            f"N1 Predefined Instance Ram running in {where}",
            "N1Standard",
            "OnDemand",
            regions,
            p(0.004237),
            "GiBy.h",
        )
        add(
            f"Spot Preemptible N1 Predefined Instance Core running in {where}",
            "N1Standard",
            "Preemptible",
            regions,
            p(0.00698),
        )
        add(
            f"Spot Preemptible N1 Predefined Instance Ram running in {where}",
            "N1Standard",
            "Preemptible",
            regions,
            p(0.000936),
            "GiBy.h",
        )
        add(f"Custom Instance Core running in {where}", "CPU", "OnDemand", regions, p(0.033174))
        add(
            f"N1 Sole Tenancy Instance Core running in {where}",
            "CPU",
            "OnDemand",
            regions,
            p(0.034773),
        )
        for gpu, od, spot in (
            ("Nvidia Tesla A100 GPU", 2.933908, 1.4341),
            ("Nvidia A100 80GB GPU", 1.8462, 1.964),
            ("Nvidia H100 80GB GPU", 4.20076, 2.9926),
            ("Nvidia L4 GPU", 0.56004, 0.2231),
            ("Nvidia Tesla T4 GPU", 0.35, 0.175),
            ("Nvidia Tesla V100 GPU", 2.48, 1.0885),
            ("Nvidia H100 80GB Mega GPU", 11.06, 2.5),
            ("H200 141GB GPU", 10.0, 2.8),
        ):
            add(f"{gpu} running in {where}", "GPU", "OnDemand", regions, p(od))
            add(
                f"{gpu} attached to Spot Preemptible VMs running in {where}",
                "GPU",
                "Preemptible",
                regions,
                p(spot),
            )
        add(
            f"Nvidia Tesla T4 Virtual Workstation GPU running in {where}",
            "GPU",
            "OnDemand",
            regions,
            p(0.55),
        )
        add(
            f"Storage PD Capacity in {where}",
            "PDStandard",
            "OnDemand",
            regions,
            p(0.000054),
            "GiBy.h",
            family="Storage",
        )
    third = len(skus) // 3 + 1
    chunks = [skus[:third], skus[third : 2 * third], skus[2 * third :]]
    return [
        {"skus": chunk, "nextPageToken": str(i + 1) if i + 1 < len(chunks) else ""}
        for i, chunk in enumerate(chunks)
    ]
