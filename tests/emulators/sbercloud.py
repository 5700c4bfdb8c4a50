"""A local Huawei ECS API (cloud.ru Advanced) for tests: the unmodified ``huaweicloudsdkecs`` talks
to it over HTTP on 127.0.0.1.

Every request must carry a valid ``SDK-HMAC-SHA256`` signature made with the emulator's AK/SK; the
canonical request is rebuilt here the way ``huaweicloudsdkcore/signer/signer.py`` (3.1.219) builds
it, so a client with a wrong secret gets ``401 APIGW.0301`` like the real API gateway.

Paths served (what the adapter uses): ``POST /v1.1/{p}/cloudservers`` (create, honours
``X-Client-Token``), ``GET /v1/{p}/cloudservers/detail`` (``tags``, ``limit``, page-number
``offset``), ``GET /v1/{p}/cloudservers/{id}``, ``POST /v1/{p}/cloudservers/action``
(``os-start``/``os-stop``), ``POST /v1/{p}/cloudservers/delete``,
``POST /v1/{p}/cloudservers/{id}/metadata``, ``DELETE /v1/{p}/cloudservers/{id}/metadata/{key}``,
``GET /v1/{p}/jobs/{job_id}``, ``GET /v1/{p}/cloudservers/flavors`` and IAM's
``GET /v3/projects?name=`` (project id lookup). Bodies are checked strictly: an unknown or
missing field is a ``400 Ecs.0005`` and the recorded request shows what was wrong.

Errors use the bodies the real services send: ECS ``{"error": {"code", "message"}}``, the API
gateway ``{"error_code", "error_msg", "request_id"}``. Codes from the ECS API reference error table
(opentelekomcloud/docs ``doc/source/ecs/api-reference/error-code-description.md``): Ecs.0001 quota,
Ecs.0319 insufficient flavor capacity, Ecs.0114 server not found, Ecs.0005 invalid body; gateway
APIGW.0301 (bad signature) and APIGW.0308 (throttled).

Security groups (VPC API v1/v2.0 paths of huaweicloudsdkvpc.v2, the same endpoint here): list,
create, delete, rules list/create/delete, tags show/create; see ``_vpc``. The project starts with
its ``default`` group; ``reachable_on_22`` says whether a server's groups admit SSH from an address.

Volumes (EVS through huaweicloudsdkevs.v2, the same endpoint here): ``POST /v2.1/{p}/cloudvolumes``
(honours ``X-Client-Token``), ``GET /v2/{p}/cloudvolumes/detail`` (``limit``, row ``offset``,
``server_id``), ``GET``/``DELETE /v2/{p}/cloudvolumes/{id}``, and ECS's
``POST /v1/{p}/cloudservers/{id}/attachvolume`` and
``DELETE /v1/{p}/cloudservers/{id}/detachvolume/{volume_id}``; every change is a job. Their rules
and codes are cited at ``_evs`` below.

Elastic IPs are kept in their own books (``eips``): one made with a server (``publicip.eip``)
exists, and bills, until it is deleted; deleting the server deletes it only when it was made with
``delete_on_termination`` (or the delete asks ``delete_publicip``), else it is only unbound.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from tests.emulators import sbercloud_billing as billing

PROJECT_ID = "0a1b2c3d4e5f60718293a4b5c6d7e8f9"
REGION = "ru-moscow-1"
ZONES = ("ru-moscow-1a", "ru-moscow-1b", "ru-moscow-1c")
_ALGORITHM = "SDK-HMAC-SHA256"
_DATE_FORMAT = "%Y%m%dT%H%M%SZ"
_EMPTY_HASH = hashlib.sha256(b"").hexdigest()
_MAX_CLOCK_SKEW = timedelta(minutes=15)


def _gpu_flavor(name: str, vcpus: int, ram_gb: int, specs: dict[str, str]) -> dict[str, Any]:
    return {
        "id": name,
        "name": name,
        "vcpus": str(vcpus),
        "ram": ram_gb * 1024,
        "disk": "0",
        "swap": "",
        "OS-FLV-EXT-DATA:ephemeral": 0,
        "OS-FLV-DISABLED:disabled": False,
        "rxtx_factor": 1.0,
        "os-flavor-access:is_public": True,
        "links": [],
        "os_extra_specs": {
            "ecs:performancetype": "gpu",
            "cond:operation:status": "normal",
            **specs,
        },
    }


# Recorded-shape flavor list. Shapes are Huawei/OTC's (opentelekomcloud-docs/elastic-cloud-server,
# gpu-accelerated_ecss.rst); each GPU family is described by a different extra spec, as flavors of
# different generations are, so every parsing path of the adapter is exercised.
FLAVORS: tuple[dict[str, Any], ...] = (
    _gpu_flavor("pi2.2xlarge.4", 8, 32, {"pci_passthrough:alias": "nvidia-t4:1"}),
    _gpu_flavor("pi2.4xlarge.4", 16, 64, {"pci_passthrough:alias": "nvidia-t4:2"}),
    _gpu_flavor("p2s.2xlarge.8", 8, 64, {"pci_passthrough:gpu_specs": "v100:direct_graphics:1"}),
    _gpu_flavor(
        "p3.2xlarge.8",
        8,
        64,
        {
            "info:gpus": json.dumps(
                [{"name": "NVIDIA-A100-PCIE-80GB", "memory_mb": 81920, "count": 1}]
            )
        },
    ),
    _gpu_flavor("p5s.5xlarge.12", 20, 240, {}),  # only the family name says H100
    {
        **_gpu_flavor("s6.large.2", 2, 4, {}),
        "os_extra_specs": {"ecs:performancetype": "normal", "cond:operation:status": "normal"},
    },
)


class _Reject(Exception):
    """Ends a request with an error response."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(status, body)
        self.status = status
        self.body = body


def _ecs_error(status: int, code: str, message: str) -> _Reject:
    return _Reject(status, {"error": {"code": code, "message": message}})


def _gateway_error(status: int, code: str, message: str) -> _Reject:
    return _Reject(
        status, {"error_code": code, "error_msg": message, "request_id": uuid.uuid4().hex}
    )


def _invalid(message: str) -> _Reject:
    return _ecs_error(400, "Ecs.0005", f"Invalid request body: {message}")


@dataclass
class Recorded:
    """One request as received; ``status`` is what the emulator answered."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any
    status: int = 0


@dataclass
class _Job:
    id: str
    type: str
    server_ids: list[str]
    finish: Callable[[], None]  # applied once, when the job completes successfully
    polls_left: int
    fail: tuple[str, str] | None = None  # (error_code, fail_reason)
    status: str = "RUNNING"
    entities: dict[str, Any] | None = None  # an EVS job's (volume_id, …) instead of sub-jobs
    volume_id: str = ""  # the volume an attach/detach job changes


@dataclass
class Faults:
    """What the next requests should run into. Tests set these through :class:`EcsEmulator`."""

    sold_out: dict[str, str] = field(default_factory=dict)  # zone -> "sync" | "job"
    max_servers: int | None = None
    throttle_left: int = 0
    job_polls: int = 0  # RUNNING answers before a job completes
    drop_create_responses: int = 0
    drop_action_responses: int = 0  # os-start / os-stop carried out, the answer lost
    drop_volume_responses: int = 0  # create/attach/detach/delete of a volume done, answer lost
    max_eips: int | None = None  # EIP quota of the project


def _vpc_error(status: int, code: str, message: str) -> _Reject:
    """The VPC v1 API's error body, ``{"code", "message"}``: 400 VPC.0601 for a bad parameter
    ("Securitygroup id is invalid.", "Query security groups error vpcId is invalid." as
    recorded in yunionio/cloudpods' Huawei driver), 409 VPC.0602 for a group in use (OTC CCE
    troubleshooting: 409 {"code":"VPC.0602", ... "Security Group <id> in use." ...})."""
    return _Reject(status, {"code": code, "message": message})


def _rule(group_id: str, **fields: Any) -> dict[str, Any]:
    rule = {
        "id": str(uuid.uuid4()),
        "description": "",
        "security_group_id": group_id,
        "direction": "ingress",
        "ethertype": "IPv4",
        "protocol": None,
        "port_range_min": None,
        "port_range_max": None,
        "remote_ip_prefix": None,
        "remote_group_id": None,
        "remote_address_group_id": None,
        "tenant_id": PROJECT_ID,
    }
    rule.update(fields)
    return rule


def _new_group(group_id: str, name: str, *, vpc_id: str = "") -> dict[str, Any]:
    """A group as the VPC API makes it. Its rules: members reach each other (ingress from the
    group itself, IPv4 and IPv6), everything may go out (egress, IPv4 and IPv6), as in the
    "Creating a Security Group" response example; and, per the same page (2025-12): "after a
    security group is created, the default configuration allows any IP address to access TCP
    ports 22 and 3389" (support.huaweicloud.com/api-vpc/vpc_sg01_0001.html)."""
    rules = [_rule(group_id, ethertype=e, remote_group_id=group_id) for e in ("IPv4", "IPv6")] + [
        _rule(group_id, direction="egress", ethertype=e) for e in ("IPv4", "IPv6")
    ]
    if name != "default":
        rules += [
            _rule(
                group_id,
                protocol="tcp",
                port_range_min=port,
                port_range_max=port,
                remote_ip_prefix="0.0.0.0/0",
            )
            for port in (22, 3389)
        ]
    return {
        "id": group_id,
        "name": name,
        "description": "",
        "vpc_id": vpc_id,
        "enterprise_project_id": "0",
        "rules": {r["id"]: r for r in rules},
        "tags": {},
    }


# huaweicloudsdkvpc v2 CreateSecurityGroupOption.name: "1-64 characters: digits, letters,
# Chinese characters, _ - ." (安全组名称 取值范围：1-64个字符，支持数字、字母、中文、_、-、.)
_GROUP_NAME = re.compile(r"^[\w.\-\u4e00-\u9fff]{1,64}$")


class EcsEmulator:
    def __init__(self, ak: str, sk: str, *, project_id: str = PROJECT_ID) -> None:
        self.ak = ak
        self.sk = sk
        self.project_id = project_id
        self.faults = Faults()
        self.servers: dict[str, dict[str, Any]] = {}
        self.eips: dict[str, dict[str, Any]] = {}  # every EIP here exists and bills
        # Test infra, not ECS: every EIP this emulator assigns is at this address (a server's
        # "floating" address, huaweicloudsdkecs ServerAddress.addr with OS-EXT-IPS:type
        # floating), e.g. 127.0.0.1 where a test's sshd listens; None: its own 203.0.113.x.
        self.public_address: str | None = None
        self.volumes: dict[str, dict[str, Any]] = {}  # EVS disks: every one here bills
        self._volume_tokens: dict[str, dict[str, Any]] = {}  # X-Client-Token → first answer
        self.security_groups: dict[str, dict[str, Any]] = {
            "default": _new_group("default", "default")
        }
        self.requests: list[Recorded] = []
        self.fee_records: list[dict[str, Any]] = []  # BSS: tests/emulators/sbercloud_billing.py
        self._jobs: dict[str, _Job] = {}
        self._tokens: dict[str, tuple[str, list[str]]] = {}
        self._lock = threading.RLock()
        self._httpd: ThreadingHTTPServer | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> EcsEmulator:
        emulator = self

        class Handler(_Handler):
            owner = emulator

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        return self

    def stop(self) -> None:
        if self._httpd:
            self._httpd.shutdown()
            self._httpd.server_close()

    @property
    def endpoint(self) -> str:
        assert self._httpd, "not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    # -- control surface ------------------------------------------------------------------

    def sell_out(self, zone: str, *, mode: str = "job") -> None:
        """No capacity in ``zone``: the create call fails at once (``sync``, 400 Ecs.0319) or
        its job fails (``job``)."""
        assert mode in ("sync", "job")
        self.faults.sold_out[zone] = mode

    def throttle(self, n: int) -> None:
        """The next ``n`` requests get ``429 APIGW.0308``."""
        self.faults.throttle_left = n

    def preempt(self, server_id: str, *, how: str = "stop", at: datetime | None = None) -> None:
        """The cloud takes a spot server back: ``stop`` (SHUTOFF), ``delete`` (status DELETED)
        or ``vanish`` (gone: 404), at ``at`` (default: now)."""
        with self._lock:
            if how != "stop":
                self._release_eips(server_id, delete_publicip=False)
                # its data disks stay, detached: "竞享计费型实例在中断回收时，数据盘和弹性公网IP默认
                # 不释放" (Huawei ECS docs, spot-priced ECSs, constraints: ecs_03_0190) — written
                # for that kind of spot server, taken here for any server gone without a delete
                for volume in self.volumes.values():
                    if self._attached(volume, server_id):
                        volume.update(status="available", attachments=[])
            if how == "vanish":
                del self.servers[server_id]
            else:
                _set_status(self.servers[server_id], "SHUTOFF" if how == "stop" else "DELETED", at)

    def console_stop(self, server_id: str) -> None:
        """A person stops the server in the console: SHUTOFF. Huawei records no reason, so this
        looks exactly like a spot preemption that stopped it (``preempt(how="stop")``)."""
        self.preempt(server_id, how="stop")

    def guest_shutdown(self, server_id: str, at: datetime | None = None) -> None:
        """The server's OS powers itself off at ``at`` (default: now): ECS shows it SHUTOFF,
        as after a stop (the OpenStack status of a server whose guest halted; Huawei ECS "ECS
        Statuses": SHUTOFF, "stopped"), ``updated`` its last change, with no reason recorded.
        Billing: "After a pay-per-use or spot ECS is stopped (excluding bare metal ECSs or ECSs
        with local disks or FPGAs attached), its basic resources (vCPUs, memory, image, and
        GPUs) will no longer be billed"; those others (P1, P2, disk-intensive, FPGA, bare metal)
        "will continue to be billed after they are stopped" (Huawei Cloud, "How Can I Stop an
        ECS from Being Billed?", support.huaweicloud.com/intl/en-us/price-ecs/
        ecs_billing_11106.html). This emulator's flavors are GPU flavors without local disks:
        stopped, compute billing ends."""
        with self._lock:
            _set_status(self.servers[server_id], "SHUTOFF", at)

    def console_delete(self, server_id: str) -> None:
        """Someone deleted the server elsewhere and ECS no longer knows it: 404 Ecs.0114."""
        self.preempt(server_id, how="vanish")

    def add_server(
        self, name: str, *, zone: str = ZONES[0], tags: dict[str, str] | None = None
    ) -> str:
        """A server created by someone else (console, another tool), running."""
        with self._lock:
            server = self._new_server(name, "pi2.2xlarge.4", zone, tags or {}, spot=False)
            server["status"] = "ACTIVE"
            return server["id"]

    def reachable_on_22(self, server_id: str, source: str = "203.0.113.10") -> bool:
        """Could ``source`` open a TCP connection to port 22 at the server's EIP? It needs an
        EIP and an ingress rule of one of its groups admitting tcp/22 (no protocol: any; no
        ports: all) from a CIDR holding ``source``. Security groups only allow: "a security
        group denies all inbound traffic unless a rule allows it" (Huawei VPC user guide,
        "Security Group Rules")."""
        address = ipaddress.ip_address(source)
        with self._lock:
            server = self.servers[server_id]
            if not any(e["server_id"] == server_id for e in self.eips.values()):
                return False
            for gid in server["security_groups"]:
                group = self.security_groups.get(gid)
                for rule in (group or {}).get("rules", {}).values():
                    if rule["direction"] != "ingress" or not rule["remote_ip_prefix"]:
                        continue
                    if rule["protocol"] not in (None, "tcp", "6"):
                        continue
                    low = rule["port_range_min"] or 1
                    high = rule["port_range_max"] or 65535
                    net = ipaddress.ip_network(rule["remote_ip_prefix"], strict=False)
                    if low <= 22 <= high and address.version == net.version and address in net:
                        return True
            return False

    def received(self, method: str, pattern: str) -> list[Recorded]:
        rx = re.compile(pattern)
        return [r for r in self.requests if r.method == method and rx.search(r.path)]

    # -- request handling -----------------------------------------------------------------

    def verify_signature(self, method: str, target: str, headers: Any, body: bytes) -> None:
        auth = headers.get("Authorization") or ""
        m = re.fullmatch(
            rf"{_ALGORITHM} Access=([^,]+), SignedHeaders=([^,]+), Signature=([0-9a-f]+)", auth
        )
        if not m:
            raise _gateway_error(401, "APIGW.0301", "Incorrect IAM authentication information")
        access, signed_list, signature = m.groups()
        if access != self.ak:
            raise _gateway_error(401, "APIGW.0301", "Incorrect IAM authentication information")
        signed = signed_list.split(";")
        if not {"host", "x-sdk-date"} <= set(signed) or signed != sorted(signed):
            raise _gateway_error(401, "APIGW.0301", "Host and X-Sdk-Date must be signed")
        try:
            when = datetime.strptime(headers.get("X-Sdk-Date", ""), _DATE_FORMAT)
        except ValueError:
            raise _gateway_error(401, "APIGW.0301", "bad X-Sdk-Date") from None
        if abs(datetime.now(UTC).replace(tzinfo=None) - when) > _MAX_CLOCK_SKEW:
            raise _gateway_error(401, "APIGW.0301", "request expired")
        lines = []
        for name in signed:
            value = headers.get(name)
            if value is None:
                raise _gateway_error(401, "APIGW.0301", f"signed header {name} missing")
            lines.append(f"{name}:{value.encode('iso-8859-1').decode('utf-8').strip()}")
        if not body:
            payload_hash = _EMPTY_HASH
        else:
            payload_hash = headers.get("X-Sdk-Content-Sha256") or hashlib.sha256(body).hexdigest()
        parts = urlsplit(target)
        uri = "/".join(quote(p, safe="~") for p in unquote(parts.path).split("/"))
        uri = uri if uri.endswith("/") else uri + "/"
        query = "&".join(
            f"{quote(k, safe='~')}={quote(v, safe='~')}"
            for k, v in sorted(parse_qsl(parts.query, keep_blank_values=True))
        )
        canonical = "\n".join(
            [method, uri, query, "\n".join(lines) + "\n", ";".join(signed), payload_hash]
        )
        to_sign = "\n".join(
            [
                _ALGORITHM,
                when.strftime(_DATE_FORMAT),
                hashlib.sha256(canonical.encode()).hexdigest(),
            ]
        )
        expected = hmac.new(self.sk.encode(), to_sign.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, signature):
            raise _gateway_error(401, "APIGW.0301", "Incorrect IAM authentication information")

    def handle(self, rec: Recorded) -> tuple[int, dict[str, Any] | None]:
        with self._lock:
            if self.faults.throttle_left > 0:
                self.faults.throttle_left -= 1
                raise _gateway_error(429, "APIGW.0308", "The throttling threshold has been reached")
            path = rec.path
            if rec.method == "GET" and path == billing.PATH:
                try:
                    return 200, billing.answer(self.fee_records, rec.query, "RUB")
                except billing.BssReject as e:
                    return 400, e.body
            if rec.method == "GET" and path == "/v3/auth/domains":
                return 200, billing.auth_domains()
            if rec.method == "GET" and path == "/v3/projects":
                _only(rec.query, {"name"})
                return 200, {"projects": [{"id": self.project_id, "name": rec.query["name"]}]}
            m = re.fullmatch(r"/(v1|v1\.1|v2|v2\.0|v2\.1)/([^/]+)/(.+)", path)
            if not m:
                raise _gateway_error(404, "APIGW.0101", "The API does not exist")
            version, project, rest = m.groups()
            if project != self.project_id or rec.headers.get("X-Project-Id") != project:
                raise _ecs_error(400, "Ecs.0023", "The project ID in token does not match URL")
            route = (rec.method, version, rest)
            if rest.startswith(("security-groups", "security-group-rules")):
                return self._vpc(rec, version, rest)
            if rest.startswith("cloudvolumes"):
                return self._evs(rec, version, rest)
            if version == "v1" and (
                a := re.fullmatch(r"cloudservers/([^/]+)/(attachvolume|detachvolume/([^/]+))", rest)
            ):
                server = self._server(a.group(1))
                if server["status"] == "DELETED":
                    raise _ecs_error(
                        404, "Ecs.0114", f"Instance[{server['id']}] could not be found."
                    )
                if rec.method == "POST" and a.group(2) == "attachvolume":
                    return self._attach_volume(server, rec.body)
                if rec.method == "DELETE" and a.group(3):
                    _only(rec.query, {"delete_flag"})
                    return self._detach_volume(server, a.group(3))
            if route == ("POST", "v1.1", "cloudservers"):
                return self._create(rec)
            if route == ("GET", "v1", "cloudservers/detail"):
                return self._list(rec.query)
            if route == ("GET", "v1", "cloudservers/flavors"):
                _only(rec.query, {"availability_zone"})
                zone = rec.query.get("availability_zone")
                if zone and zone not in ZONES:
                    raise _invalid(f"unknown availability_zone {zone}")
                return 200, {"flavors": list(FLAVORS)}
            if route == ("POST", "v1", "cloudservers/action"):
                return self._action(rec.body)
            if route == ("POST", "v1", "cloudservers/delete"):
                return self._delete(rec.body)
            if rec.method == "GET" and (j := re.fullmatch(r"jobs/([^/]+)", rest)):
                return self._job(j.group(1))
            if s := re.fullmatch(r"cloudservers/([^/]+)(/metadata(?:/([^/]+))?)?", rest):
                server_id, meta, key = s.groups()
                server = self._server(server_id)
                if rec.method == "GET" and not meta:
                    return 200, {"server": self._detail(server)}
                if rec.method == "POST" and meta and not key:
                    return self._set_metadata(server, rec.body)
                if rec.method == "DELETE" and key:
                    if key not in server["metadata"]:
                        raise _ecs_error(404, "Ecs.0114", f"metadata key {key} not found")
                    del server["metadata"][key]
                    return 204, None
            raise _gateway_error(404, "APIGW.0101", "The API does not exist")

    # -- VPC security groups --------------------------------------------------------------

    def _vpc(self, rec: Recorded, version: str, rest: str) -> tuple[int, dict[str, Any] | None]:
        """The security-group calls of huaweicloudsdkvpc.v2 (paths from its VpcClient;
        fields and value ranges from its model docstrings)."""
        method, body = rec.method, rec.body
        groups = self.security_groups
        if version == "v1" and rest == "security-groups":
            if method == "GET":
                _only(rec.query, {"limit", "marker", "vpc_id", "enterprise_project_id"})
                found = sorted(groups.values(), key=lambda g: g["id"])
                if "marker" in rec.query:
                    found = [g for g in found if g["id"] > rec.query["marker"]]
                found = found[: int(rec.query.get("limit", 2000))]
                return 200, {"security_groups": [self._group_view(g) for g in found]}
            if method == "POST":
                _only(body, {"security_group"})
                option = _required(body, "security_group", dict)
                _only(option, {"name", "vpc_id", "enterprise_project_id"})
                name = option.get("name")
                if not isinstance(name, str) or not _GROUP_NAME.match(name):
                    raise _vpc_error(400, "VPC.0601", f"Security group name {name!r} is invalid.")
                group = _new_group(str(uuid.uuid4()), name, vpc_id=option.get("vpc_id", ""))
                groups[group["id"]] = group
                return 200, {"security_group": self._group_view(group)}
        if version == "v1" and (g := re.fullmatch(r"security-groups/([^/]+)", rest)):
            group = self._group(g.group(1))
            if method == "GET":
                return 200, {"security_group": self._group_view(group)}
            if method == "DELETE":
                # "Before deleting a security group, ensure that the security group is not
                # associated with any instance" (VPC API "Deleting a Security Group")
                users = [
                    s
                    for s in self.servers.values()
                    if s["status"] != "DELETED" and group["id"] in s["security_groups"]
                ]
                if users or group["name"] == "default":
                    raise _vpc_error(409, "VPC.0602", f"Security Group {group['id']} in use.")
                del groups[group["id"]]
                return 204, None
        if version == "v1" and rest == "security-group-rules":
            if method == "GET":
                _only(rec.query, {"marker", "limit", "security_group_id", "remote_ip_prefix"})
                rules = [
                    r
                    for grp in groups.values()
                    for r in grp["rules"].values()
                    if rec.query.get("security_group_id") in (None, grp["id"])
                ]
                return 200, {"security_group_rules": rules}
            if method == "POST":
                _only(body, {"security_group_rule"})
                rule = self._parse_rule(_required(body, "security_group_rule", dict))
                self._group(rule["security_group_id"])["rules"][rule["id"]] = rule
                return 200, {"security_group_rule": rule}
        if version == "v1" and (r := re.fullmatch(r"security-group-rules/([^/]+)", rest)):
            for grp in groups.values():
                if r.group(1) in grp["rules"] and method == "DELETE":
                    del grp["rules"][r.group(1)]
                    return 204, None
            raise _vpc_error(400, "VPC.0601", "Security group rule id is invalid.")
        if version == "v2.0" and (t := re.fullmatch(r"security-groups/([^/]+)/tags", rest)):
            group = self._group(t.group(1))
            if method == "GET":
                return 200, {"tags": [{"key": k, "value": v} for k, v in group["tags"].items()]}
            if method == "POST":
                _only(body, {"tag"})
                tag = _required(body, "tag", dict)
                _only(tag, {"key", "value"})
                group["tags"][_required(tag, "key", str)] = tag.get("value", "")
                return 204, None
        raise _gateway_error(404, "APIGW.0101", "The API does not exist")

    def _group(self, group_id: str) -> dict[str, Any]:
        group = self.security_groups.get(group_id)
        if group is None:
            raise _vpc_error(400, "VPC.0601", "Securitygroup id is invalid.")
        return group

    def _group_view(self, group: dict[str, Any]) -> dict[str, Any]:
        view = {k: v for k, v in group.items() if k not in ("rules", "tags")}
        return {**view, "security_group_rules": list(group["rules"].values())}

    def _parse_rule(self, option: dict[str, Any]) -> dict[str, Any]:
        """huaweicloudsdkvpc v2 CreateSecurityGroupRuleOption: direction egress|ingress;
        ethertype IPv4|IPv6 (default IPv4); protocol tcp, udp, icmp or a number 0-255 (empty:
        all); ports 1-65535, min not above max; remote_ip_prefix (an address or CIDR),
        remote_group_id and remote_address_group_id exclude each other; description 0-255."""
        fields = {
            "security_group_id",
            "description",
            "direction",
            "ethertype",
            "protocol",
            "port_range_min",
            "port_range_max",
            "remote_ip_prefix",
            "remote_group_id",
            "remote_address_group_id",
        }
        _only(option, fields)

        def bad(what: str) -> _Reject:
            return _vpc_error(400, "VPC.0601", f"Security group rule {what} is invalid.")

        group_id = _required(option, "security_group_id", str)
        self._group(group_id)
        if option.get("direction") not in ("ingress", "egress"):
            raise bad("direction")
        ethertype = option.get("ethertype", "IPv4")
        if ethertype not in ("IPv4", "IPv6"):
            raise bad("ethertype")
        protocol = option.get("protocol")
        if protocol not in (None, "", "tcp", "udp", "icmp") and not (
            isinstance(protocol, str) and protocol.isdigit() and int(protocol) <= 255
        ):
            raise bad("protocol")
        low, high = option.get("port_range_min"), option.get("port_range_max")
        for port in (low, high):
            if port is not None and not (isinstance(port, int) and 1 <= port <= 65535):
                raise bad("port")
        if low is not None and high is not None and low > high:
            raise bad("port range")
        remotes = [option.get(k) for k in ("remote_ip_prefix", "remote_group_id")]
        if sum(bool(x) for x in [*remotes, option.get("remote_address_group_id")]) > 1:
            raise bad("remote")
        if option.get("remote_ip_prefix"):
            try:
                ipaddress.ip_network(option["remote_ip_prefix"], strict=False)
            except ValueError:
                raise bad("remote_ip_prefix") from None
        if len(option.get("description", "")) > 255:
            raise bad("description")
        return _rule(group_id, **{k: v for k, v in option.items() if k != "security_group_id"})

    # -- EVS volumes, attached by ECS ------------------------------------------------------
    # Rules and codes, from Huawei's EVS and ECS API references as Open Telekom Cloud publishes
    # them (opentelekomcloud-docs/elastic-volume-service api-ref appendix/error_codes.rst and
    # evs_disk_status.rst; .../elastic-cloud-server api-ref appendix/error_codes.rst) and the SDK
    # models (huaweicloudsdkevs 3.1.219):
    #  * create: availability_zone must exist, else 400 EVS.1036 "invalid availability zone!";
    #    a data disk is 10..32768 GB (CreateVolumeOption.size), else 400 EVS.1010 "invalid
    #    volume size!"; volume_type one of SATA, SAS, GPSSD, SSD, ESSD, GPSSD2, ESSD2
    #    (CreateVolumeOption.volume_type); at most 10 tags, EVS.1061 "The Volume Tags is Exceed
    #    Max Limit Num.", a bad key or value EVS.1062 "invalid tag!" (key 1..36, value 0..43
    #    characters; both "Can contain only digits, letters, hyphens (-), and underscores (_)":
    #    api-ref "Creating EVS Disks"). ``X-Client-Token`` is the request's idempotency
    #    mark ("请求的幂等标识", CreateVolumeRequest): the same token gets the first answer.
    #    ``volume_ids`` is in the answer only with metadata ``create_for_volume_id: "true"``.
    #  * a volume that does not exist: 404 EVS.5404 "Resource(Volume, Snapshot, Backup .etc)
    #    cound not be found." (sic).
    #  * delete: only "available, error, error_extending, error_restoring, error_rollbacking",
    #    else 400 EVS.1046 with those words.
    #  * attach: "Disks and the server you attach the disks to must be in the same AZ" (EVS FAQ
    #    "Can I Attach a Disk to a Server in a Different AZ?"); what the API answers is not
    #    documented: 400 Ecs.0121 ("The disk cannot be attached to the ECS because the disk and
    #    the ECS are in different failure domains", the nearest documented code) is assumed.
    #    Attached there already: 400 Ecs.0057 "The disk has already been attached to the ECS and
    #    you cannot repeatedly attach it."; not available (attached elsewhere): 400 Ecs.0103
    #    "The disk can be attached to a server only when it exists and is in the Available
    #    state. Check the disk status and try again." (EVS disks here are not shareable.)
    #  * detach of a disk not attached there: 400 Ecs.0111 "The EVS disk has been detached from
    #    the ECS. Refresh the disk list and check the disk."
    VOLUME_TYPES = frozenset({"SATA", "SAS", "GPSSD", "SSD", "ESSD", "GPSSD2", "ESSD2"})
    VOLUME_FIELDS = frozenset(
        {
            "availability_zone",
            "backup_id",
            "count",
            "description",
            "enterprise_project_id",
            "imageRef",
            "metadata",
            "multiattach",
            "name",
            "size",
            "snapshot_id",
            "volume_type",
            "tags",
            "iops",
            "throughput",
        }
    )
    DELETABLE = ("available", "error", "error_extending", "error_restoring", "error_rollbacking")

    def _evs(self, rec: Recorded, version: str, rest: str) -> tuple[int, dict[str, Any] | None]:
        route = (rec.method, version, rest)
        if route == ("POST", "v2.1", "cloudvolumes"):
            return self._create_volume(rec)
        if route == ("GET", "v2", "cloudvolumes/detail"):
            return self._list_volumes(rec.query)
        if version == "v2" and (v := re.fullmatch(r"cloudvolumes/([^/]+)", rest)):
            volume = self._volume(v.group(1))
            if rec.method == "GET":
                for job in [j for j in self._jobs.values() if j.volume_id == volume["id"]]:
                    self._advance(job)
                return 200, {"volume": dict(volume)}
            if rec.method == "DELETE":
                if volume["status"] not in self.DELETABLE:
                    raise _ecs_error(
                        400,
                        "EVS.1046",
                        "volume status must be available, error, error_extending, "
                        "error_restoring, error_rollbacking when delete volume!",
                    )
                volume["status"] = "deleting"
                job = self._new_job(
                    "deleteVolume",
                    [],
                    lambda: self.volumes.pop(volume["id"], None),
                    entities={"volume_id": volume["id"]},
                )
                job.volume_id = volume["id"]
                return 200, {"job_id": job.id}
        raise _gateway_error(404, "APIGW.0101", "The API does not exist")

    def _volume(self, volume_id: str) -> dict[str, Any]:
        volume = self.volumes.get(volume_id)
        if volume is None:
            raise _ecs_error(
                404, "EVS.5404", "Resource(Volume, Snapshot, Backup .etc) cound not be found."
            )
        return volume

    @staticmethod
    def _attached(volume: dict[str, Any], server_id: str) -> bool:
        return any(a["server_id"] == server_id for a in volume["attachments"])

    def _create_volume(self, rec: Recorded) -> tuple[int, dict[str, Any]]:
        token = rec.headers.get("X-Client-Token")
        if token in self._volume_tokens:
            return 200, self._volume_tokens[token]
        body = rec.body
        _only(body, {"volume", "bss_param", "server_id", "OS-SCH-HNT:scheduler_hints"})
        option = _required(body, "volume", dict)
        _only(option, set(self.VOLUME_FIELDS))
        zone = option.get("availability_zone")
        if zone not in ZONES:
            raise _ecs_error(400, "EVS.1036", "invalid availability zone!")
        size = option.get("size")
        if not isinstance(size, int) or not 10 <= size <= 32768:
            raise _ecs_error(400, "EVS.1010", "invalid volume size!")
        if option.get("volume_type") not in self.VOLUME_TYPES:
            raise _invalid(f"volume_type {option.get('volume_type')!r}")
        if option.get("count", 1) != 1 or option.get("multiattach", False):
            raise _invalid("one volume, not shareable, here")
        volume_tags = option.get("tags", {})
        metadata = option.get("metadata", {})
        for what in (volume_tags, metadata):
            if not isinstance(what, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in what.items()
            ):
                raise _invalid("tags and metadata map strings to strings")
        if len(volume_tags) > 10:
            raise _ecs_error(400, "EVS.1061", "The Volume Tags is Exceed Max Limit Num.")
        for key, value in volume_tags.items():
            if not (_EVS_TAG_KEY.fullmatch(key) and _EVS_TAG_VALUE.fullmatch(value)):
                raise _ecs_error(400, "EVS.1062", "invalid tag!")
        vid = str(uuid.uuid4())
        volume = self.volumes[vid] = {
            "id": vid,
            "name": option.get("name", ""),
            "status": "creating",
            "availability_zone": zone,
            "size": size,
            "volume_type": option["volume_type"],
            "attachments": [],
            "tags": dict(volume_tags),
            "metadata": dict(metadata),
            "multiattach": False,
            "bootable": "false",
            "created_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f"),
        }
        job = self._new_job(
            "createVolume",
            [],
            lambda: volume.update(status="available"),
            entities={"volume_id": vid, "name": volume["name"], "size": size},
        )
        answer: dict[str, Any] = {"job_id": job.id}
        if metadata.get("create_for_volume_id") == "true":
            answer["volume_ids"] = [vid]
        if token is not None:
            self._volume_tokens[token] = answer
        return 200, answer

    def _list_volumes(self, query: dict[str, str]) -> tuple[int, dict[str, Any]]:
        _only(query, {"limit", "offset", "server_id", "name", "availability_zone", "status"})
        try:
            limit = int(query.get("limit", 1000))
            offset = int(query.get("offset", 0))
        except ValueError:
            raise _invalid("limit and offset must be integers") from None
        if not 1 <= limit <= 1000 or offset < 0:
            raise _invalid("limit must be 1..1000, offset not negative")
        matched = [
            v
            for v in self.volumes.values()
            if ("server_id" not in query or self._attached(v, query["server_id"]))
            and all(v[k] == query[k] for k in ("name", "availability_zone", "status") if k in query)
        ]
        rows = matched[offset : offset + limit]
        return 200, {"count": len(matched), "volumes": [dict(v) for v in rows]}

    def _attach_volume(self, server: dict[str, Any], body: Any) -> tuple[int, dict[str, Any]]:
        _only(body, {"volumeAttachment", "dry_run"})
        attachment = _required(body, "volumeAttachment", dict)
        _only(attachment, {"volumeId", "device", "volume_type", "count", "hw:passthrough"})
        volume = self.volumes.get(_required(attachment, "volumeId", str))
        sid = server["id"]
        if volume is not None and self._attached(volume, sid):
            raise _ecs_error(
                400,
                "Ecs.0057",
                "The disk has already been attached to the ECS and you cannot repeatedly "
                "attach it.",
            )
        if volume is None or volume["status"] != "available":
            raise _ecs_error(
                400,
                "Ecs.0103",
                "The disk can be attached to a server only when it exists and is in the "
                "Available state. Check the disk status and try again.",
            )
        if volume["availability_zone"] != server["zone"]:
            raise _ecs_error(
                400,
                "Ecs.0121",
                "The disk cannot be attached to the ECS because the disk and the ECS are in "
                "different failure domains.",
            )
        taken = {
            a["device"]
            for v in self.volumes.values()
            for a in v["attachments"]
            if a["server_id"] == sid
        }
        device = next(
            f"/dev/vd{c}" for c in "bcdefghijklmnopqrstuvwxyz" if f"/dev/vd{c}" not in taken
        )
        volume["status"] = "attaching"

        def finish() -> None:
            volume["status"] = "in-use"
            volume["attachments"] = [
                {
                    "server_id": sid,
                    "attachment_id": str(uuid.uuid4()),
                    "attached_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f"),
                    "host_name": None,
                    "volume_id": volume["id"],
                    "device": device,
                    "id": volume["id"],
                }
            ]

        job = self._new_job("attachVolume", [sid], finish)
        job.volume_id = volume["id"]
        return 200, {"job_id": job.id}

    def _detach_volume(self, server: dict[str, Any], volume_id: str) -> tuple[int, dict[str, Any]]:
        volume = self.volumes.get(volume_id)
        if volume is None or not self._attached(volume, server["id"]):
            raise _ecs_error(
                400,
                "Ecs.0111",
                "The EVS disk has been detached from the ECS. Refresh the disk list and check "
                "the disk.",
            )
        volume["status"] = "detaching"
        job = self._new_job(
            "detachVolume",
            [server["id"]],
            lambda: volume.update(status="available", attachments=[]),
        )
        job.volume_id = volume_id
        return 200, {"job_id": job.id}

    # -- ECS operations -------------------------------------------------------------------

    def _create(self, rec: Recorded) -> tuple[int, dict[str, Any]]:
        token = rec.headers.get("X-Client-Token")
        if token is not None and not 0 < len(token) <= 64:
            raise _invalid("X-Client-Token must be 1..64 characters")
        if token in self._tokens:
            job_id, ids = self._tokens[token]
            return 200, {"job_id": job_id, "serverIds": ids}
        body = rec.body
        _only(body, {"server", "dry_run"})
        server = _required(body, "server", dict)
        _only(
            server,
            {
                "imageRef",
                "flavorRef",
                "name",
                "user_data",
                "vpcid",
                "nics",
                "root_volume",
                "security_groups",
                "availability_zone",
                "extendparam",
                "metadata",
                "server_tags",
                "publicip",
                "count",
                "key_name",
                "description",
            },
        )
        for key in ("imageRef", "flavorRef", "name", "vpcid"):
            _required(server, key, str)
        # PrePaidServer.name: letters (Chinese too), digits, _ - . and 1-64 characters
        # (huaweicloudsdkecs: "只能由中文字符、英文字母、数字及“_”、“-”、“.”组成，
        # 且长度为[1-64]个字符")
        if not re.fullmatch(r"[\w.-]{1,64}", server["name"]):
            raise _invalid(f"name {server['name']!r}: 1-64 letters, digits, _ - .")
        flavor = server["flavorRef"]
        if flavor not in {f["id"] for f in FLAVORS}:
            raise _ecs_error(400, "Ecs.0029", f"Flavor [{flavor}] does not exist.")
        nics = _required(server, "nics", list)
        if not nics or any(set(n) != {"subnet_id"} for n in nics):
            raise _invalid("nics must be [{subnet_id}]")
        volume = _required(server, "root_volume", dict)
        _only(volume, {"volumetype", "size"})
        if volume.get("volumetype") not in ("SATA", "SAS", "SSD", "GPSSD", "ESSD"):
            raise _invalid(f"root_volume.volumetype {volume.get('volumetype')!r}")
        if not isinstance(volume.get("size"), int) or not 1 <= volume["size"] <= 1024:
            raise _invalid("root_volume.size must be 1..1024")
        for sg in server.get("security_groups", []):
            if set(sg) != {"id"}:
                raise _invalid("security_groups must be [{id}]")
        # none given: the server joins the "default" security group (huaweicloudsdkecs
        # PrePaidServer.security_groups: "当该值指定为空时，默认给云服务器绑定default安全组")
        groups = [sg["id"] for sg in server.get("security_groups", [])] or ["default"]
        zone = server.get("availability_zone", ZONES[0])
        if zone not in ZONES:
            raise _ecs_error(400, "Ecs.0005", f"availability_zone {zone} does not exist")
        tags = _server_tags(server.get("server_tags", []))
        publicip = self._publicip(server["publicip"]) if "publicip" in server else None
        if "user_data" in server:
            try:
                raw = base64.b64decode(server["user_data"], validate=True)
            except binascii.Error:
                raise _invalid("user_data is not base64") from None
            # huaweicloudsdkecs PrePaidServer.user_data: "注入内容（编码之前的内容）最大长度
            # 32KB" (at most 32 KB before base64); "text, a text file or a gzip file"
            if len(raw) > 32 * 1024:
                raise _invalid("user_data longer than 32 KB")
        ext = _required(server, "extendparam", dict)
        _only(ext, {"chargingMode", "marketType", "spotPrice", "regionID"})
        if ext.get("chargingMode") not in ("postPaid", "prePaid", 0, 1):
            raise _invalid(f"extendparam.chargingMode {ext.get('chargingMode')!r}")
        spot = ext.get("marketType") == "spot"
        if "marketType" in ext and not spot:
            raise _invalid(f"extendparam.marketType {ext['marketType']!r}")
        if "spotPrice" in ext and (not spot or not re.fullmatch(r"\d+(\.\d+)?", ext["spotPrice"])):
            raise _invalid("extendparam.spotPrice needs marketType spot and a decimal string")
        if server.get("count", 1) != 1:
            raise _invalid("count must be 1 here")
        if self.faults.sold_out.get(zone) == "sync":
            raise _ecs_error(400, "Ecs.0319", "Check capacity: Capacity is not enough.")
        alive = [s for s in self.servers.values() if s["status"] != "DELETED"]
        if self.faults.max_servers is not None and len(alive) >= self.faults.max_servers:
            raise _ecs_error(400, "Ecs.0001", "The number of ECSs is beyond the quota limit.")
        eip_quota = self.faults.max_eips
        if publicip and "eip" in publicip and eip_quota is not None and len(self.eips) >= eip_quota:
            raise _ecs_error(400, "Ecs.0013", "Insufficient EIP quota.")
        created = self._new_server(server["name"], flavor, zone, tags, spot=spot)
        created["metadata"].update(server.get("metadata", {}))
        created["security_groups"] = groups
        sid = created["id"]

        def finish() -> None:
            _set_status(created, "ACTIVE")
            if publicip:  # the EIP is assigned and bound as the job completes
                self._bind_eip(sid, publicip)

        fail = None
        if self.faults.sold_out.get(zone) == "job":
            fail = (
                "Ecs.0319",
                f"Check capacity: Capacity is not enough. flavor {flavor} in {zone}",
            )
        job = self._new_job("createServer", [sid], finish, fail)
        if token is not None:
            self._tokens[token] = (job.id, [sid])
        return 200, {"job_id": job.id, "serverIds": [sid]}

    def _new_server(
        self, name: str, flavor: str, zone: str, tags: dict[str, str], *, spot: bool
    ) -> dict[str, Any]:
        sid = str(uuid.uuid4())
        now = datetime.now(UTC)
        self.servers[sid] = server = {
            "id": sid,
            "name": name,
            "flavor": flavor,
            "zone": zone,
            "status": "BUILD",
            "task_state": "",
            "tags": dict(tags),
            "security_groups": ["default"],
            "metadata": {"charging_mode": "2" if spot else "0", "vpc_id": "vpc"},
            "ip": f"192.168.0.{len(self.servers) + 10}",
            "created": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "updated": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "launched_at": now.strftime("%Y-%m-%dT%H:%M:%S.000000"),
            "terminated_at": "",
        }
        return server

    # EIP fields: huaweicloudsdkecs PrePaidServerPublicip {id | eip, delete_on_termination},
    # PrePaidServerEip {iptype, bandwidth, extendparam}, PrePaidServerEipBandwidth {size, sharetype,
    # chargemode, id}; Huawei "Data Structure for Creating ECSs" (opentelekomcloud/docs
    # doc/source/ecs/api-reference/data-structure-for-creating-ecss.md): either id or eip, iptype
    # and bandwidth mandatory; sharetype PER (size mandatory) or WHOLE (a shared bandwidth id);
    # chargemode absent/empty (by bandwidth) or "traffic", any other value fails the create; size
    # 1..2000 Mbit/s (SDK) else Ecs.0045 "Bandwidth size %d is invalid." (ECS error table);
    # delete_on_termination defaults to false. SberCloud's iptype is 5_bgp
    # (sbercloud-terraform/terraform-provider-sbercloud docs/resources/compute_instance.md).
    EIP_TYPES = frozenset({"5_bgp"})

    def _publicip(self, publicip: Any) -> dict[str, Any]:
        _only(publicip, {"id", "eip", "delete_on_termination"})
        if ("id" in publicip) == ("eip" in publicip):
            raise _invalid("publicip takes either id or eip")
        if not isinstance(publicip.get("delete_on_termination", False), bool):
            raise _invalid("publicip.delete_on_termination must be a boolean")
        if "id" in publicip:
            eip = self.eips.get(publicip["id"])
            if eip is None or eip["server_id"] is not None:
                raise _invalid(f"publicip.id {publicip['id']}: only an EIP in DOWN state")
            return publicip
        eip = publicip["eip"]
        _only(eip, {"iptype", "bandwidth", "extendparam"})
        if eip.get("iptype") not in self.EIP_TYPES:
            raise _invalid(f"publicip.eip.iptype {eip.get('iptype')!r} is not supported")
        bandwidth = _required(eip, "bandwidth", dict)
        _only(bandwidth, {"size", "sharetype", "chargemode", "id"})
        if bandwidth.get("chargemode", "") not in ("", "traffic"):
            raise _invalid(f"bandwidth.chargemode {bandwidth['chargemode']!r}")
        share = bandwidth.get("sharetype")
        if share == "WHOLE":
            _required(bandwidth, "id", str)
        elif share == "PER":
            size = bandwidth.get("size")
            if not isinstance(size, int):
                raise _invalid("bandwidth.size is required for sharetype PER")
            if not 1 <= size <= 2000:
                raise _ecs_error(400, "Ecs.0045", f"Bandwidth size {size} is invalid.")
        else:
            raise _invalid(f"bandwidth.sharetype {share!r}")
        return publicip

    def _bind_eip(self, server_id: str, publicip: dict[str, Any]) -> None:
        if "id" in publicip:
            eip = self.eips[publicip["id"]]
        else:
            n = len(self.eips) + 10
            address = self.public_address or f"203.0.113.{n}"
            eip = {"id": str(uuid.uuid4()), "address": address, **publicip["eip"]}
            self.eips[eip["id"]] = eip
        eip.update(
            server_id=server_id,
            status="ACTIVE",
            delete_on_termination=publicip.get("delete_on_termination", False),
        )

    def _release_eips(self, server_id: str, *, delete_publicip: bool) -> None:
        """A server is gone: its EIPs go with it when so asked, else stay, unbound, billing."""
        for eip in [e for e in self.eips.values() if e["server_id"] == server_id]:
            if delete_publicip or eip["delete_on_termination"]:
                del self.eips[eip["id"]]
            else:
                eip.update(server_id=None, status="DOWN")

    def _new_job(
        self,
        job_type: str,
        server_ids: list[str],
        finish: Callable[[], None],
        fail: tuple[str, str] | None = None,
        entities: dict[str, Any] | None = None,
    ) -> _Job:
        job = _Job(
            uuid.uuid4().hex,
            job_type,
            server_ids,
            finish,
            self.faults.job_polls,
            fail,
            "RUNNING",
            entities,
        )
        self._jobs[job.id] = job
        return job

    def _advance(self, job: _Job) -> None:
        """A job moves on each time it is looked at (polled, or its volume read): time passes."""
        if job.status == "RUNNING":
            if job.polls_left > 0:
                job.polls_left -= 1
            elif job.fail:
                job.status = "FAIL"
                for sid in job.server_ids:  # ECS rolls a failed creation back
                    self.servers.pop(sid, None)
            else:
                job.status = "SUCCESS"
                job.finish()

    def _job(self, job_id: str) -> tuple[int, dict[str, Any]]:
        job = self._jobs.get(job_id)
        if job is None:
            raise _ecs_error(404, "Ecs.0000", f"job {job_id} not found")
        self._advance(job)
        code, reason = job.fail if job.status == "FAIL" else (None, None)
        sub_jobs = [
            {
                "status": job.status,
                "job_id": uuid.uuid5(uuid.NAMESPACE_OID, job.id + sid).hex,
                "job_type": job.type,
                "entities": {"server_id": sid},
                "error_code": code,
                "fail_reason": reason,
            }
            for sid in job.server_ids
        ]
        return 200, {
            "job_id": job.id,
            "job_type": job.type,
            "status": job.status,
            "entities": (
                job.entities
                if job.entities is not None
                else {"sub_jobs_total": len(sub_jobs), "sub_jobs": sub_jobs}
            ),
            "error_code": code,
            "fail_reason": reason,
            "begin_time": "2026-11-30T10:00:00.000Z",
            "end_time": "" if job.status == "RUNNING" else "2026-11-30T10:01:00.000Z",
        }

    def _action(self, body: Any) -> tuple[int, dict[str, Any]]:
        if (
            not isinstance(body, dict)
            or len(body) != 1
            or next(iter(body))
            not in (
                "os-start",
                "os-stop",
            )
        ):
            raise _invalid("expected exactly one of os-start, os-stop")
        action, opts = next(iter(body.items()))
        if action == "os-stop":
            _only(opts, {"servers", "type"})
            if opts.get("type", "SOFT") not in ("SOFT", "HARD"):
                raise _invalid(f"os-stop.type {opts.get('type')!r}")
        else:
            _only(opts, {"servers"})
        servers = [self._server(sid) for sid in _server_ids(opts)]
        status = "SHUTOFF" if action == "os-stop" else "ACTIVE"
        for s in servers:
            s["task_state"] = "powering-off" if action == "os-stop" else "powering-on"

        def finish() -> None:
            for s in servers:
                s.update(task_state="")
                _set_status(s, status)

        job = self._new_job(
            "batchStopServers" if action == "os-stop" else "batchStartServers",
            [s["id"] for s in servers],
            finish,
        )
        return 200, {"job_id": job.id}

    def _delete(self, body: Any) -> tuple[int, dict[str, Any]]:
        _only(body, {"servers", "delete_volume", "delete_publicip"})
        for flag in ("delete_volume", "delete_publicip"):
            if not isinstance(body.get(flag, False), bool):
                raise _invalid(f"{flag} must be a boolean")
        servers = [self._server(sid) for sid in _server_ids(body)]

        def finish() -> None:
            for s in servers:
                _set_status(s, "DELETED")
                # delete_publicip: "默认为false … false：删除云服务器时，
                # 仅解绑定在云服务器上的弹性IP，不删除弹性IP" — by default the EIP is
                # only unbound and kept (huaweicloudsdkecs DeleteServersRequestBody;
                # huaweicloud-sdk-go-v3 services/ecs/v2/model/model_delete_servers_request_body.go)
                self._release_eips(s["id"], delete_publicip=body.get("delete_publicip", False))
                # delete_volume: "Specifies whether to delete the data disks attached to an ECS
                # when deleting the ECS. If you set the parameter value to false, the system only
                # detaches the disks from the ECS and reserves the disks." (ECS API reference,
                # "Deleting ECSs", opentelekomcloud-docs/elastic-cloud-server)
                for volume in list(self.volumes.values()):
                    if self._attached(volume, s["id"]):
                        if body.get("delete_volume", False):
                            del self.volumes[volume["id"]]
                        else:
                            volume.update(status="available", attachments=[])

        job = self._new_job("deleteServers", [s["id"] for s in servers], finish)
        return 200, {"job_id": job.id}

    def _set_metadata(self, server: dict[str, Any], body: Any) -> tuple[int, dict[str, Any]]:
        _only(body, {"metadata"})
        meta = _required(body, "metadata", dict)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise _invalid("metadata must map strings to strings")
        server["metadata"].update(meta)
        return 200, {"metadata": dict(server["metadata"])}

    def _list(self, query: dict[str, str]) -> tuple[int, dict[str, Any]]:
        _only(query, {"tags", "limit", "offset"})
        try:
            limit = int(query.get("limit", 25))
            page = max(int(query.get("offset", 1)), 1)
        except ValueError:
            raise _invalid("limit and offset must be integers") from None
        if not 1 <= limit <= 1000:
            raise _invalid("limit must be 1..1000")
        wanted = query.get("tags")
        matched = [
            s
            for s in self.servers.values()
            if s["status"] != "DELETED"
            and (wanted is None or wanted in (f"{k}={v}" for k, v in s["tags"].items()))
        ]
        rows = matched[(page - 1) * limit : page * limit]
        return 200, {"count": len(matched), "servers": [self._detail(s) for s in rows]}

    def _server(self, sid: str) -> dict[str, Any]:
        server = self.servers.get(sid)
        if server is None:
            raise _ecs_error(404, "Ecs.0114", f"Instance[{sid}] could not be found.")
        return server

    def _detail(self, s: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": s["id"],
            "name": s["name"],
            "status": s["status"],
            "OS-EXT-STS:task_state": s["task_state"],
            "OS-EXT-STS:vm_state": s["status"].lower(),
            "OS-EXT-AZ:availability_zone": s["zone"],
            "flavor": {"id": s["flavor"], "name": s["flavor"], "vcpus": "8", "ram": "32768"},
            "addresses": {
                "vpc": [
                    {"addr": s["ip"], "version": 4, "OS-EXT-IPS:type": "fixed"},
                    *(
                        {"addr": e["address"], "version": 4, "OS-EXT-IPS:type": "floating"}
                        for e in self.eips.values()
                        if e["server_id"] == s["id"]
                    ),
                ]
            },
            "metadata": dict(s["metadata"]),
            # the system disk is not modelled: data disks only, bootIndex "-1" (huaweicloudsdkecs
            # ServerExtendVolumeAttachment: "0" the boot disk, "-1" any other)
            "os-extended-volumes:volumes_attached": [
                {
                    "id": v["id"],
                    "delete_on_termination": "false",
                    "bootIndex": "-1",
                    "device": v["attachments"][0]["device"],
                }
                for v in self.volumes.values()
                if self._attached(v, s["id"])
            ],
            "tags": [f"{k}={v}" for k, v in s["tags"].items()],
            "security_groups": [{"name": g, "id": g} for g in s["security_groups"]],
            "created": s["created"],
            "updated": s["updated"],
            "OS-SRV-USG:launched_at": s["launched_at"],
            "OS-SRV-USG:terminated_at": s["terminated_at"],
            "tenant_id": self.project_id,
        }


def _set_status(server: dict[str, Any], status: str, at: datetime | None = None) -> None:
    """A server's status changes: ``updated`` follows every change of the server (ServerDetail
    ``updated``, "弹性云服务器更新时间", e.g. 2019-05-22T03:30:52Z), and a deleted one gets
    ``OS-SRV-USG:terminated_at`` ("弹性云服务器删除时间", e.g. 2019-05-22T03:23:59.000000;
    huaweicloudsdkecs ServerDetail, "Querying Details About ECSs")."""
    when = (at or datetime.now(UTC)).astimezone(UTC)
    server.update(status=status, updated=when.strftime("%Y-%m-%dT%H:%M:%SZ"))
    if status == "DELETED":
        server["terminated_at"] = when.strftime("%Y-%m-%dT%H:%M:%S.000000")


def _only(obj: Any, allowed: set[str]) -> None:
    if not isinstance(obj, dict):
        raise _invalid(f"expected an object, got {type(obj).__name__}")
    unknown = set(obj) - allowed
    if unknown:
        raise _invalid(f"unknown field(s) {', '.join(sorted(unknown))}")


def _required(obj: dict[str, Any], key: str, kind: type) -> Any:
    if not isinstance(obj.get(key), kind):
        raise _invalid(f"{key} is required ({kind.__name__})")
    return obj[key]


# Tag rules: huaweicloudsdkecs PrePaidServerTag (key at most 36 unicode characters, not empty;
# value at most 43, may be empty; neither holds ASCII 0-31 nor = * < > \ , | and, per Huawei's
# ECS.ServerTags reference and the C++ SDK's PrePaidServerTag.h, /; keys unique per server), at
# most 10 per server. Codes and messages from the ECS error table (opentelekomcloud/docs
# doc/source/ecs/api-reference/error-code-description.md): Ecs.0905 "The number of tags cannot be
# greater than 10.", Ecs.0906 "Invalid tag attribute" ("Invalid tag key."), Ecs.0907 "Tag key [%s]
# contains invalid characters.", Ecs.0908 "The tag key cannot be duplicate.".
_TAG_FORBIDDEN = re.compile(r"[\x00-\x1f=*<>\\,|/]")
_EVS_TAG_KEY = re.compile(r"[0-9A-Za-z_-]{1,36}")  # EVS disks: see EcsEmulator._evs
_EVS_TAG_VALUE = re.compile(r"[0-9A-Za-z_-]{0,43}")


def _server_tags(tags: Any) -> dict[str, str]:
    if not isinstance(tags, list) or any(
        not isinstance(t, dict)
        or set(t) != {"key", "value"}
        or not all(isinstance(v, str) for v in t.values())
        for t in tags
    ):
        raise _invalid("server_tags must be [{key, value}] of strings")
    if len(tags) > 10:
        raise _ecs_error(400, "Ecs.0905", "The number of tags cannot be greater than 10.")
    out: dict[str, str] = {}
    for tag in tags:
        key, value = tag["key"], tag["value"]
        if not 1 <= len(key) <= 36:
            raise _ecs_error(400, "Ecs.0906", "Invalid tag key.")
        if len(value) > 43:
            raise _ecs_error(400, "Ecs.0906", "Invalid tag value.")
        for what, text in (("key", key), ("value", value)):
            if _TAG_FORBIDDEN.search(text):
                raise _ecs_error(
                    400, "Ecs.0907", f"Tag {what} [{text}] contains invalid characters."
                )
        if key in out:
            raise _ecs_error(400, "Ecs.0908", "The tag key cannot be duplicate.")
        out[key] = value
    return out


def _server_ids(opts: dict[str, Any]) -> list[str]:
    servers = _required(opts, "servers", list)
    if not servers or any(not isinstance(s, dict) or set(s) != {"id"} for s in servers):
        raise _invalid("servers must be [{id}]")
    if len(servers) > 1000:  # "A maximum of 1,000 ECSs" per batch stop/start/delete (ECS API
        # Reference, ecs_02_0303 BatchStopServers, ecs_02_0103 DeleteServers)
        raise _invalid("servers: at most 1000 a request")
    return [s["id"] for s in servers]


class _Handler(BaseHTTPRequestHandler):
    owner: EcsEmulator
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    def _serve(self) -> None:
        emu = self.owner
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        parts = urlsplit(self.path)
        rec = Recorded(
            method=self.command,
            path=parts.path,
            query=dict(parse_qsl(parts.query, keep_blank_values=True)),
            headers={k: v for k, v in self.headers.items()},
            body=None,
        )
        emu.requests.append(rec)
        try:
            emu.verify_signature(self.command, self.path, self.headers, raw)
            if raw:
                try:
                    rec.body = json.loads(raw)
                except ValueError:
                    raise _invalid("body is not JSON") from None
            status, body = emu.handle(rec)
        except _Reject as rej:
            status, body = rej.status, rej.body
        rec.status = status
        is_create = (self.command, parts.path) == ("POST", f"/v1.1/{emu.project_id}/cloudservers")
        if is_create and status == 200 and emu.faults.drop_create_responses > 0:
            emu.faults.drop_create_responses -= 1
            self.close_connection = True  # the server was made; the answer is lost
            return
        is_action = (self.command, parts.path) == (
            "POST",
            f"/v1/{emu.project_id}/cloudservers/action",
        )
        if is_action and status == 200 and emu.faults.drop_action_responses > 0:
            emu.faults.drop_action_responses -= 1
            self.close_connection = True  # the stop/start job was made; the answer is lost
            return
        is_volume_action = re.search(
            r"/cloudservers/[^/]+/(attachvolume|detachvolume/)|/cloudvolumes(/[^/]+)?$", parts.path
        ) and self.command in ("POST", "DELETE")
        if is_volume_action and status == 200 and emu.faults.drop_volume_responses > 0:
            emu.faults.drop_volume_responses -= 1
            self.close_connection = True  # the volume's job was made; the answer is lost
            return
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("X-Request-Id", uuid.uuid4().hex)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = do_PUT = _serve
