"""A local AWS for tests and benchmarks: moto in server mode behind a fault-injecting proxy.

The unmodified boto3 talks to the proxy (``endpoint_url``). The proxy parses every request
strictly, records it, and forwards it to moto unchanged except where it adds what moto lacks:

- ``ClientToken`` idempotency for RunInstances (same token → the original reservation, no new
  machine; same token with other parameters → IdempotentParameterMismatch);
- faults (:class:`Faults`): capacity exhaustion per AZ, quota errors per region, throttling,
  slow requests, lost responses, refused credentials, a small page size for DescribeInstances,
  and an unreliable network (:meth:`Faults.unreliable`) where a share of the EC2 calls fail,
  half of them after EC2 acted (the answer dropped, a 500, or too late);
- spot requests, which moto does not model for RunInstances market options (:class:`SpotRequest`):
  a one-time spot instance cannot be stopped; terminating an instance of a persistent request
  that is not cancelled makes EC2 launch a new, billed one; an instance a persistent request
  stopped on interruption is started again when capacity returns (:meth:`restore_capacity`);
  ``CancelSpotInstanceRequests`` is answered here;
- the AttachVolume rules moto lacks (:meth:`AwsEmulator._check_attach`): a volume attaches only
  to an instance in its AZ, only to one, and not while the instance is still booting
  (``Faults.boot_describes``: moto's instances run at once, EC2's are ``pending`` a while),
  under a valid device name not in use; and where the guest then sees it, NVMe on Nitro and
  ``/dev/xvdf`` on Xen (:meth:`AwsEmulator.guest_devices`, :mod:`tests.emulators.aws_devices`);
- preemption of a spot instance (:meth:`AwsEmulator.preempt`): moto stops/terminates it and the
  proxy rewrites its DescribeInstances StateReason to the spot interruption code; an instance
  terminated elsewhere long ago (:meth:`AwsEmulator.forget`) is no longer known;
- public data moto does not have: the Deep Learning AMI SSM parameter, the Price List API
  (``GetProducts``) and spot price history, served from recorded-shape fixtures.

Errors are answered in each protocol's real error shape so botocore parses the code.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import logging
import random
import re
import threading
import time
import urllib.parse
import urllib.request
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from xml.sax.saxutils import escape

from tests.emulators import aws_devices

DLAMI_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
)
SPOT_INTERRUPTION = {
    "terminate": ("Server.SpotInstanceTermination", "Spot instance termination"),
    "stop": ("Server.SpotInstanceShutdown", "Spot instance shutdown"),
}
# StateTransitionReason (wire element ``reason``; botocore's ec2 model, Instance): EC2 dates a
# stop or terminate in it, "User initiated (2020-03-05 04:45:19 GMT)" for a user's (AWS CLI
# output in lostsnow/devops-cli aws/data/sample/ec2/describe-instances.md) and "Service
# initiated (2016-04-18 21:15:09 GMT)" for EC2's own, a spot interruption among them
# (evergreen-ci/cedar cost tests, parsing real describe-instances answers).
_MOTO_REASON_TIME = re.compile(rb"(\(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) UTC\)")
_CREDENTIAL_SCOPE = re.compile(r"Credential=[^/,\s]+/\d{8}/([a-z0-9-]+)/([a-z0-9-]+)/aws4_request")
_SPOT_PARAMS = re.compile(
    r"^(Action|Version|AvailabilityZone|StartTime|EndTime|MaxResults|NextToken|DryRun"
    r"|InstanceType\.\d+|ProductDescription\.\d+)$"
)


@dataclass
class Recorded:
    """One request as received. ``params``: form fields (EC2, STS) or the JSON body."""

    service: str
    region: str
    action: str
    params: dict[str, Any]
    answer: str = "forwarded"  # or the error code / "replayed" / "dropped" / "fixture"
    seconds: float = 0.0  # how long the emulator took to answer it (benchmarks subtract it)


@dataclass
class _Throttle:
    count: int
    action: str | None
    skip: int = 0  # matching requests let through first


@dataclass
class _Slow:
    seconds: float
    action: str | None
    count: int


class Faults:
    """Faults the proxy injects. Every setter applies from the next request on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        with self._lock:
            self.capacity: dict[str, tuple[str, str | None]] = {}
            self.quota: dict[str, str] = {}
            self.auth_code: str | None = None
            self.page_size: int | None = None
            # a new instance answers `pending` to this many DescribeInstances (moto runs at once)
            self.boot_describes = 0
            self._throttles: list[_Throttle] = []
            self._slow: list[_Slow] = []
            self._drops: dict[str, int] = {}
            self._chaos: random.Random | None = None
            self._chaos_rate = 0.0
            self.late_seconds = 0.0
            self.fates: list[tuple[str, str]] = []  # (action, fate) of each unreliable call

    def no_capacity(
        self,
        zone: str,
        code: str = "InsufficientInstanceCapacity",
        instance_type: str | None = None,
    ) -> None:
        """RunInstances in ``zone`` (AZ name or id; of ``instance_type``, or any) fails with
        ``code``."""
        with self._lock:
            self.capacity[zone] = (code, instance_type)

    def quota_exceeded(self, region: str, code: str = "VcpuLimitExceeded") -> None:
        with self._lock:
            self.quota[region] = code

    def throttle(self, count: int, action: str | None = None, skip: int = 0) -> None:
        """The next ``count`` EC2 requests (of ``action``, or any) get RequestLimitExceeded,
        after ``skip`` of them are let through (e.g. a listing's second page)."""
        with self._lock:
            self._throttles.append(_Throttle(count, action, skip))

    def slow(self, seconds: float, action: str | None = None, count: int = 1) -> None:
        """The next ``count`` requests (of ``action``) wait ``seconds`` before being handled."""
        with self._lock:
            self._slow.append(_Slow(seconds, action, count))

    def drop_response(self, action: str, count: int = 1) -> None:
        """Handle the next ``count`` ``action`` requests, then close the connection unanswered."""
        with self._lock:
            self._drops[action] = self._drops.get(action, 0) + count

    def unreliable(self, rate: float, seed: int, late_seconds: float = 0.5) -> None:
        """From now on each EC2 call fails with probability ``rate`` (a seeded draw): half of
        the failures before EC2 acts (RequestLimitExceeded 503 or InternalError 500), half after
        it acted — the connection dropped unanswered, an InternalError 500 in place of the
        answer, or the answer sent ``late_seconds`` later (after the client's read timeout).
        EC2 documents the second kind: "Operations might also time out or encounter other
        server issues before they complete, even though the request has already returned a
        result" (https://docs.aws.amazon.com/ec2/latest/devguide/ec2-api-idempotency.html)."""
        with self._lock:
            self._chaos = random.Random(seed)
            self._chaos_rate = rate
            self.late_seconds = late_seconds

    def take_fate(self, action: str) -> str | None:
        """None (served), ``refused``/``error-before`` (failed before acting), or
        ``dropped``/``error-after``/``late`` (failed after acting)."""
        with self._lock:
            if self._chaos is None:
                return None
            draw = self._chaos.random()
            if draw >= self._chaos_rate:
                return None
            before = draw < self._chaos_rate / 2
            kinds = ("refused", "error-before") if before else ("dropped", "error-after", "late")
            fate = self._chaos.choice(kinds)
            self.fates.append((action, fate))
            return fate

    def reject_credentials(self, code: str = "AuthFailure") -> None:
        with self._lock:
            self.auth_code = code

    def cap_page_size(self, size: int) -> None:
        """DescribeInstances returns at most ``size`` reservations per page (as AWS may)."""
        with self._lock:
            self.page_size = size

    def take_throttle(self, action: str) -> bool:
        with self._lock:
            for t in self._throttles:
                if t.count > 0 and t.action in (None, action):
                    if t.skip > 0:
                        t.skip -= 1
                        continue
                    t.count -= 1
                    return True
            return False

    def take_slow(self, action: str) -> float:
        with self._lock:
            for s in self._slow:
                if s.count > 0 and s.action in (None, action):
                    s.count -= 1
                    return s.seconds
            return 0.0

    def take_drop(self, action: str) -> bool:
        with self._lock:
            if self._drops.get(action, 0) > 0:
                self._drops[action] -= 1
                return True
            return False


class _Reply(Exception):
    """Raised inside request handling to answer at once."""

    def __init__(self, status: int, body: bytes, content_type: str, answer: str) -> None:
        super().__init__(answer)
        self.status, self.body, self.content_type, self.answer = status, body, content_type, answer


def ec2_error(code: str, message: str, status: int) -> _Reply:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error>'
        f"<Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
        f"</Error></Errors><RequestID>{uuid.uuid4()}</RequestID></Response>"
    )
    return _Reply(status, body.encode(), "text/xml;charset=UTF-8", code)


def sts_error(code: str, message: str, status: int) -> _Reply:
    body = (
        '<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><Error>'
        f"<Type>Sender</Type><Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
        f"</Error><RequestId>{uuid.uuid4()}</RequestId></ErrorResponse>"
    )
    return _Reply(status, body.encode(), "text/xml", code)


def json_error(code: str, message: str, status: int = 400) -> _Reply:
    body = json.dumps({"__type": code, "message": message}).encode()
    return _Reply(status, body, "application/x-amz-json-1.1", code)


def json_reply(payload: dict[str, Any]) -> _Reply:
    return _Reply(200, json.dumps(payload).encode(), "application/x-amz-json-1.1", "fixture")


@dataclass
class SpotRequest:
    """One spot request as EC2 keeps it (AWS EC2 User Guide, "Spot Instance requests" and
    "Behavior of Spot Instance interruptions"): a one-time request closes once its instance is
    gone; a persistent one stays open until cancelled, relaunching its instance after an
    interruption or a terminate, and is ``disabled`` while its instance is stopped."""

    id: str
    region: str
    kind: str  # one-time | persistent
    behaviour: str  # terminate | stop | hibernate
    instance_id: str
    launch: tuple[dict[str, str], bytes]  # the RunInstances it came from (headers, body)
    state: str = "active"  # active | disabled | open | closed | cancelled
    instances: list[str] = field(default_factory=list)  # every instance it ever launched


class AwsEmulator:
    """moto + the proxy. Use :func:`start_aws_emulator`; :meth:`reset` between tests."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto logs every request
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._moto.start()
        host, port = self._moto.get_host_and_port()
        self.moto_url = f"http://{host}:{port}"
        self.faults = Faults()
        self.requests: list[Recorded] = []
        self.errors: list[Exception] = []  # emulator bugs met while serving
        self.price_list: list[dict[str, Any]] = []
        self.spot_history: list[dict[str, str]] = []
        self.public_parameters: dict[str, str | None] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._tokens: dict[tuple[str, str], tuple[dict[str, str], bytes]] = {}
        self._token_locks: dict[tuple[str, str], threading.Lock] = {}
        # instance id → (StateReason code, its message, when, who initiated it)
        self._preempted: dict[str, tuple[str, str, datetime, str]] = {}
        # RunInstances' InstanceInitiatedShutdownBehavior per instance (botocore's ec2 model:
        # "Indicates whether an instance stops or terminates when you initiate shutdown from
        # the instance (using the operating system command for system shutdown). Default: stop")
        self._shutdown_behavior: dict[str, str] = {}
        self._booting: dict[str, int] = {}  # instance id → DescribeInstances left as pending
        # Test infra, not EC2: every instance's public address (DescribeInstances ipAddress,
        # botocore ec2 model Instance.PublicIpAddress) read as this one, e.g. 127.0.0.1 where
        # a test's sshd listens; None: moto's own addresses.
        self.public_address: str | None = None
        self.spot_requests: dict[str, SpotRequest] = {}
        self._clients: dict[tuple[str, str], Any] = {}
        self._zone_ids: dict[str, dict[str, str]] = {}
        self._amis: dict[str, str] = {}
        self._current = threading.local()  # the request this handler thread is answering
        self._load_defaults()

        emulator = self

        class Handler(_ProxyHandler):
            owner = emulator

        self._proxy = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._proxy.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self._proxy.server_address[1]}"
        self._thread = threading.Thread(target=self._proxy.serve_forever, daemon=True)
        self._thread.start()

    # --- control surface ------------------------------------------------------------------

    def reset(self) -> None:
        """Empty moto and forget faults, recorded requests, tokens and preemptions."""
        self.wait_idle()
        req = urllib.request.Request(f"{self.moto_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=30):
            pass
        self.faults.clear()
        with self._lock:
            self.requests.clear()
            self.errors.clear()
            self._tokens.clear()
            self._token_locks.clear()
            self._preempted.clear()
            self._shutdown_behavior.clear()
            self._booting.clear()
            self.spot_requests.clear()
            self.public_address = None
        self._load_defaults()

    def stop(self) -> None:
        self._proxy.shutdown()
        self._proxy.server_close()
        self._moto.stop()

    def wait_idle(self, timeout: float = 30) -> None:
        """Wait until no request is being handled (e.g. a slow one the client gave up on)."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._in_flight == 0, timeout):
                raise TimeoutError("aws emulator: requests still in flight")

    def calls(self, action: str, service: str = "ec2") -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.action == action and r.service == service]

    @property
    def run_instances_requests(self) -> list[dict[str, Any]]:
        """Form parameters of every RunInstances received (incl. rejected ones)."""
        return [r.params for r in self.calls("RunInstances")]

    def client(self, service: str, region: str = "us-east-1") -> Any:
        """A boto3 client straight to moto: no faults, not recorded (test set-up and checks)."""
        with self._lock:
            if (service, region) not in self._clients:
                import boto3

                self._clients[(service, region)] = boto3.session.Session().client(
                    service,
                    region_name=region,
                    endpoint_url=self.moto_url,
                    aws_access_key_id="testing",
                    aws_secret_access_key="testing",
                )
            return self._clients[(service, region)]

    def zone_id(self, region: str, zone_name: str) -> str:
        """moto's AZ id for a zone name ("" if unknown); moto's mapping is fixed."""
        if region not in self._zone_ids:
            zones = self.client("ec2", region).describe_availability_zones()["AvailabilityZones"]
            self._zone_ids[region] = {z["ZoneName"]: z["ZoneId"] for z in zones}
        return self._zone_ids[region].get(zone_name, "")

    def ubuntu_ami(self, region: str) -> str:
        """An Ubuntu image moto knows in ``region`` (stands in for the Deep Learning AMI)."""
        if region not in self._amis:
            images = self.client("ec2", region).describe_images(
                Filters=[{"Name": "name", "Values": ["ubuntu/images/*"]}]
            )["Images"]
            self._amis[region] = max(images, key=lambda i: i["Name"])["ImageId"]
        return self._amis[region]

    def preempt(
        self,
        instance_id: str,
        region: str = "us-east-1",
        action: str = "terminate",
        at: datetime | None = None,
    ):
        """Take a spot instance back as AWS would: ``terminate`` or ``stop`` it, with the
        spot interruption StateReason and a StateTransitionReason dated ``at`` (default: now)
        as EC2 dates it, ``Service initiated (YYYY-MM-DD HH:MM:SS GMT)``."""
        ec2 = self.client("ec2", region)
        raw = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]
        if raw.get("InstanceLifecycle") != "spot":
            raise ValueError(f"{instance_id} is not a spot instance")
        request = self._spot_request_of(instance_id)
        if action != "terminate" and request is not None and request.kind == "one-time":
            raise ValueError(f"{instance_id}: EC2 only stops instances of persistent requests")
        if action == "terminate":
            ec2.terminate_instances(InstanceIds=[instance_id])
        else:
            ec2.stop_instances(InstanceIds=[instance_id])
        code, text = SPOT_INTERRUPTION[action]
        with self._lock:
            when = (at or datetime.now(UTC)).astimezone(UTC)
            self._preempted[instance_id] = (code, f"{code}: {text}", when, "Service initiated")
            request = self._spot_request_of(instance_id)
            if request is not None and request.state not in ("cancelled", "closed"):
                # persistent: open again, waiting for capacity; one-time: done
                request.state = "open" if request.kind == "persistent" else "closed"

    def guest_shutdown(
        self, instance_id: str, region: str = "us-east-1", at: datetime | None = None
    ) -> str:
        """The instance's OS shuts itself down (``shutdown -h now``) at ``at`` (default: now),
        as EC2 answers it; returns the state it is left in.

        - "By default, when you initiate a shutdown from an Amazon EBS backed instance (using a
          command such as shutdown or poweroff), the instance stops. You can change this
          behavior so that the instance terminates instead by changing the
          InstanceInitiatedShutdownBehavior attribute" (EC2 User Guide, "Change instance
          initiated shutdown behavior",
          https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/Using_ChangingInstanceInitiatedShutdownBehavior.html).
        - A one-time Spot Instance cannot be stopped ("You can only stop Spot Instances
          associated with persistent Spot Instance requests", EC2's own refusal above; EC2 User
          Guide, "Stop a Spot Instance"): shut down from inside, it is terminated, as
          /work/shared/reference/clouds.md records.
        - Its StateReason is ``Client.InstanceInitiatedShutdown`` ("The instance was shut down
          from the operating system of the instance", botocore's ec2 model, StateReason; its
          message "Client.InstanceInitiatedShutdown: Instance initiated shutdown" as recorded
          from EC2 in taskcluster/aws-provisioner's tests), and
          its StateTransitionReason is dated as any stop or terminate a client started, "User
          initiated (YYYY-MM-DD HH:MM:SS GMT)".
        Compute billing ends with the stop (a stopped instance is not charged for usage: EC2
        User Guide, "Stop and start Amazon EC2 instances")."""
        ec2 = self.client("ec2", region)
        request = self._spot_request_of(instance_id)
        with self._lock:
            behavior = self._shutdown_behavior.get(instance_id, "stop")
        if request is not None and request.kind == "one-time":
            behavior = "terminate"
        if behavior == "terminate":
            ec2.terminate_instances(InstanceIds=[instance_id])
        else:
            ec2.stop_instances(InstanceIds=[instance_id])
        code = "Client.InstanceInitiatedShutdown"
        with self._lock:
            when = (at or datetime.now(UTC)).astimezone(UTC)
            self._preempted[instance_id] = (
                code,
                f"{code}: Instance initiated shutdown",
                when,
                "User initiated",
            )
            if request is not None and request.state not in ("cancelled", "closed"):
                request.state = "closed" if behavior == "terminate" else "disabled"
        return "terminated" if behavior == "terminate" else "stopped"

    def restore_capacity(self) -> list[str]:
        """Capacity is back: EC2 fulfils every open persistent request again — it starts an
        instance stopped by an interruption, or launches a new one for a terminated one
        ("Behavior of Spot Instance interruptions", EC2 User Guide). Returns the instance
        ids it started or launched."""
        acted = []
        with self._lock:
            waiting = [r for r in self.spot_requests.values() if r.state == "open"]
        for request in waiting:
            iid = request.instance_id
            state = self._state(iid, request.region)
            if state == "stopped":
                self.client("ec2", request.region).start_instances(InstanceIds=[iid])
                with self._lock:
                    self._preempted.pop(iid, None)
                    request.state = "active"
            else:
                with self._lock:
                    self._relaunch(request)
            acted.append(request.instance_id)
        return acted

    def open_spot_requests(self) -> list[SpotRequest]:
        """Requests that can still launch or keep a billed instance."""
        with self._lock:
            return [
                r for r in self.spot_requests.values() if r.state in ("active", "open", "disabled")
            ]

    def billed_instances(self, region: str = "us-east-1") -> list[str]:
        """Instances that still cost money: running or starting, or stopped with their disk."""
        ec2 = self.client("ec2", region)
        return [
            i["InstanceId"]
            for r in ec2.describe_instances()["Reservations"]
            for i in r["Instances"]
            if i["State"]["Name"] in ("pending", "running", "stopping", "stopped")
        ]

    def _states(self, region: str, ids: list[str]) -> dict[str, str]:
        """The state of each of ``ids`` that moto knows (no error for unknown ones), read from
        moto's books directly (a filtered DescribeInstances of 1,000 ids takes seconds)."""
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.ec2.models import ec2_backends

        wanted = set(ids)
        backend = ec2_backends[DEFAULT_ACCOUNT_ID][region]
        return {
            i.id: str(i.state)
            for r in list(backend.reservations.values())
            for i in r.instances
            if i.id in wanted
        }

    def _check_attach(self, region: str, params: dict[str, str], rec: Recorded) -> None:
        """The AttachVolume rules moto does not keep (it attaches anything anywhere, and a second
        attach replaces the first): EC2 refuses an instance in another AZ ("InvalidVolume.
        ZoneMismatch: The volume 'vol-…' is not in the same availability zone as instance
        'i-…'", as EC2 answered in linuxkit/linuxkit#2388 and portworx/px-dev#42) and a volume
        attached already ("VolumeInUse: vol-… is already attached to an instance",
        portworx/px-dev#42; only io1/io2 volumes created with MultiAttachEnabled may be
        attached to several, botocore's ec2 model, CreateVolumeRequest.MultiAttachEnabled).
        Unknown ids are left to moto's own NotFound answers."""
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.ec2.models import ec2_backends

        backend = ec2_backends[DEFAULT_ACCOUNT_ID][region]
        vid, iid = params.get("VolumeId", ""), params.get("InstanceId", "")
        volume = backend.volumes.get(vid)
        instance = next(
            (i for r in list(backend.reservations.values()) for i in r.instances if i.id == iid),
            None,
        )
        if volume is None or instance is None:
            return
        if self._booting.get(iid, 0) > 0:
            # EC2 attaches only to a running or stopped instance: "IncorrectState ... Instance
            # 'i-…' is not 'running'." (EC2's answer quoted in ansible-collections/amazon.aws#497
            # and dstackai/dstack#3603, both attaching right after RunInstances)
            rec.answer = "IncorrectState"
            raise ec2_error("IncorrectState", f"Instance '{iid}' is not 'running'.", 400)
        if volume.attachment is not None and not volume.multi_attach_enabled:
            rec.answer = "VolumeInUse"
            raise ec2_error("VolumeInUse", f"{vid} is already attached to an instance", 400)
        if volume.zone.name != instance.availability_zone:
            rec.answer = "InvalidVolume.ZoneMismatch"
            raise ec2_error(
                "InvalidVolume.ZoneMismatch",
                f"The volume '{vid}' is not in the same availability zone as instance '{iid}'",
                400,
            )
        if refused := aws_devices.refusal(params.get("Device", ""), instance):  # cited there
            rec.answer = refused[0]
            raise ec2_error(*refused, 400)

    def guest_devices(self, instance_id: str, region: str = "us-east-1") -> dict[str, str]:
        """Each data volume's id → the path the instance's guest sees it at: the NVMe link on Nitro,
        ``/dev/xvdf``… on Xen (:mod:`tests.emulators.aws_devices`, cited there)."""
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.ec2.models import ec2_backends

        backend = ec2_backends[DEFAULT_ACCOUNT_ID][region]
        for r in list(backend.reservations.values()):
            for i in r.instances:
                if i.id == instance_id:
                    return {
                        v.id: aws_devices.guest_path(i.instance_type, v.attachment.device, v.id)
                        for v in backend.volumes.values()
                        if v.attachment is not None
                        and v.attachment.instance.id == instance_id
                        and aws_devices.VALID.fullmatch(v.attachment.device)  # not the root
                    }
        return {}

    def _state(self, instance_id: str, region: str) -> str:
        raw = self.client("ec2", region).describe_instances(InstanceIds=[instance_id])
        return str(raw["Reservations"][0]["Instances"][0]["State"]["Name"])

    def forget(self, instance_id: str, region: str = "us-east-1") -> None:
        """Someone terminated the instance elsewhere, long enough ago that EC2 no longer lists
        it (terminated instances stay visible for about an hour, then DescribeInstances answers
        InvalidInstanceID.NotFound): terminate it in moto, then drop it from moto's records."""
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.ec2.models import ec2_backends

        self.client("ec2", region).terminate_instances(InstanceIds=[instance_id])
        backend = ec2_backends[DEFAULT_ACCOUNT_ID][region]
        for rid, reservation in list(backend.reservations.items()):
            reservation.instances = [i for i in reservation.instances if i.id != instance_id]
            if not reservation.instances:
                del backend.reservations[rid]

    def _load_defaults(self) -> None:
        self.price_list = [dict(p) for p in PRICE_LIST]
        self.spot_history = [dict(s) for s in SPOT_HISTORY]
        self.public_parameters = {DLAMI_PARAMETER: None}  # None: an Ubuntu AMI moto knows

    # --- request handling -----------------------------------------------------------------

    @contextmanager
    def _busy(self) -> Iterator[None]:
        with self._lock:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def handle(self, h: _ProxyHandler) -> None:
        started = time.perf_counter()
        self._current.rec = None
        try:
            self._handle(h)
        finally:
            rec = self._current.rec
            if rec is not None:
                rec.seconds = time.perf_counter() - started

    def _handle(self, h: _ProxyHandler) -> None:
        with self._busy():
            body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
            if h.path.startswith("/moto-api"):
                status, ctype, data = self._forward(h, body)
                h.reply(status, data, ctype)
                return
            try:
                self._dispatch(h, body)
            except _Reply as reply:
                h.reply(reply.status, reply.body, reply.content_type)
            except _Dropped:
                raise
            except Exception as exc:  # an emulator bug: fail the request loudly, keep serving
                self.errors.append(exc)
                reply = ec2_error("InternalError", f"aws emulator: {exc!r}", 500)
                h.reply(reply.status, reply.body, reply.content_type)

    def _dispatch(self, h: _ProxyHandler, body: bytes) -> None:
        scope = _CREDENTIAL_SCOPE.search(h.headers.get("Authorization", ""))
        if h.command != "POST" or not scope:
            raise ec2_error("MissingAuthenticationToken", "Request must be SigV4-signed", 401)
        region, service = scope.groups()
        if service == "pricing":
            raise self._pricing(h, region, body)
        if service in ("ec2", "sts"):
            raise self._query(h, service, region, body)
        if service == "ssm":
            self._ssm(h, region, body)
        else:
            self._record(Recorded(service, region, h.headers.get("X-Amz-Target", ""), {}))
        status, ctype, data = self._forward(h, body)
        h.reply(status, data, ctype)

    def _query(self, h: _ProxyHandler, service: str, region: str, body: bytes) -> _Reply:
        """EC2/STS query protocol: strict parse, faults, then forward (or answer here)."""
        params = _parse_form(h, body)
        action = params.get("Action", "")
        rec = self._record(Recorded(service, region, action, params))
        error = ec2_error if service == "ec2" else sts_error
        if not action or "Version" not in params:
            rec.answer = "MissingAction"
            raise error("MissingAction", "Action and Version are required", 400)
        if self.faults.auth_code:
            rec.answer = self.faults.auth_code
            raise error(
                self.faults.auth_code,
                "AWS was not able to validate the provided access credentials",
                401,
            )
        if service == "sts":
            status, ctype, data = self._forward(h, body)
            return _Reply(status, data, ctype, "forwarded")
        if self.faults.take_throttle(action):
            rec.answer = "RequestLimitExceeded"
            raise ec2_error("RequestLimitExceeded", "Request limit exceeded.", 503)
        fate = self.faults.take_fate(action)
        if fate == "refused":
            rec.answer = "RequestLimitExceeded"
            raise ec2_error("RequestLimitExceeded", "Request limit exceeded.", 503)
        if fate == "error-before":
            rec.answer = "InternalError"
            raise ec2_error("InternalError", "An internal error has occurred.", 500)
        try:
            reply = self._ec2(h, region, action, params, body, rec)
        except _Reply as answered:
            reply = answered
        if reply.status != 200 or fate is None:
            return reply
        rec.answer = fate  # EC2 acted; the answer is lost
        if fate == "dropped":
            raise _Dropped
        if fate == "error-after":
            return ec2_error("InternalError", "An internal error has occurred.", 500)
        time.sleep(self.faults.late_seconds)
        return reply

    def _ec2(
        self,
        h: _ProxyHandler,
        region: str,
        action: str,
        params: dict[str, str],
        body: bytes,
        rec: Recorded,
    ) -> _Reply:
        """One EC2 action, forwarded to moto (or answered here where moto falls short)."""
        delay = self.faults.take_slow(action)
        if delay:
            time.sleep(delay)
        if action == "RunInstances":
            return self._run_instances(h, region, params, body, rec)
        if action == "CancelSpotInstanceRequests":
            return self._cancel_spot_requests(params, rec)
        ids = [v for k, v in sorted(params.items()) if k.startswith("InstanceId.")]
        if action == "StopInstances":
            states = self._states(region, ids)
            for iid in ids:
                if states.get(iid) in ("shutting-down", "terminated"):
                    # moto stops a terminated instance; EC2 refuses the whole call, naming it
                    # (the AWS CLI's answer quoted on reddit.com/r/aws, "stop-instance command
                    # fails ... This instance 'i-…' is not in a state from which it can be
                    # stopped."; Eucalyptus's EC2 API answers the same)
                    rec.answer = "IncorrectInstanceState"
                    raise ec2_error(
                        "IncorrectInstanceState",
                        f"This instance '{iid}' is not in a state from which it can be stopped.",
                        400,
                    )
                request = self._spot_request_of(iid)
                if request is not None and request.kind == "one-time":
                    # The real answer, as EC2 gives it (seen in gitlab-runner#28865, and the
                    # EC2 User Guide: "You can only stop Spot Instances associated with
                    # persistent Spot Instance requests").
                    rec.answer = "UnsupportedOperation"
                    raise ec2_error(
                        "UnsupportedOperation",
                        f"You can't stop the Spot Instance '{iid}' because it is associated "
                        "with a one-time Spot Instance request. You can only stop Spot "
                        "Instances associated with persistent Spot Instance requests.",
                        400,
                    )
        if action == "AttachVolume":
            self._check_attach(region, params, rec)
        if action == "DescribeSpotPriceHistory":
            return self._spot_history(region, params, rec)
        if action == "StartInstances":
            with self._lock:
                for key, iid in params.items():
                    if key.startswith("InstanceId."):
                        self._preempted.pop(iid, None)
        by_id = any(k.startswith("InstanceId.") for k in params)  # EC2 refuses MaxResults there
        if action == "DescribeInstances" and self.faults.page_size and not by_id:
            wanted = int(params.get("MaxResults") or 1000)
            params = {**params, "MaxResults": str(min(wanted, self.faults.page_size))}
            body = urllib.parse.urlencode(params).encode()
        status, ctype, data = self._forward(h, body)
        if status == 200 and action == "TerminateInstances":
            with self._lock:
                self._after_terminate(ids)
        if status == 200 and action == "StopInstances":
            with self._lock:
                for iid in ids:
                    if request := self._spot_request_of(iid):
                        request.state = "disabled"  # "when you stop your Spot Instance"
        if action == "DescribeInstances" and status == 200:
            # moto dates a user's stop or terminate "(… UTC)"; EC2 writes "(… GMT)"
            data = _MOTO_REASON_TIME.sub(rb"\1 GMT)", data)
            if self._preempted:
                data = self._rewrite_preempted(data)
            if self._booting:
                data = self._rewrite_booting(data)
            if self.public_address:
                data = self._rewrite_address(data, self.public_address)
        if self.faults.take_drop(action):
            rec.answer = "dropped"
            raise _Dropped
        return _Reply(status, data, ctype, "forwarded")

    def _run_instances(
        self, h: _ProxyHandler, region: str, params: dict[str, str], body: bytes, rec: Recorded
    ) -> _Reply:
        _validate_run_instances(params)
        token = params.get("ClientToken")
        if not token:
            return self._launch(h, region, params, body, rec)
        key = (region, token)
        with self._lock:
            token_lock = self._token_locks.setdefault(key, threading.Lock())
        with token_lock:
            seen = self._tokens.get(key)
            signature = {k: v for k, v in params.items() if k != "ClientToken"}
            if seen is not None:
                if seen[0] != signature:
                    rec.answer = "IdempotentParameterMismatch"
                    return ec2_error(
                        "IdempotentParameterMismatch",
                        f"The client token {token} was already used with different parameters.",
                        400,
                    )
                rec.answer = "replayed"
                return self._maybe_drop(_Reply(200, seen[1], "text/xml", "replayed"), rec)
            reply = self._launch(h, region, params, body, rec)
            if reply.status == 200:
                self._tokens[key] = (signature, reply.body)
            return self._maybe_drop(reply, rec)

    def _launch(
        self, h: _ProxyHandler, region: str, params: dict[str, str], body: bytes, rec: Recorded
    ) -> _Reply:
        zone = params.get("Placement.AvailabilityZone", "")
        itype = params["InstanceType"]
        code, only_type = self.faults.capacity.get(
            zone, self.faults.capacity.get(self.zone_id(region, zone), (None, None))
        )
        if code and only_type in (None, itype):
            rec.answer = code
            return ec2_error(
                code,
                f"We currently do not have sufficient {itype} capacity in the Availability "
                f"Zone you requested ({zone}). Our system will be working on provisioning "
                f"additional capacity.",
                500,
            )
        code = self.faults.quota.get(region)
        if code:
            rec.answer = code
            return ec2_error(
                code,
                f"You have requested more vCPU capacity than your current vCPU limit allows "
                f"for the instance bucket that the specified instance type belongs to ({code}).",
                400,
            )
        status, ctype, data = self._forward(h, body)
        rec.answer = "forwarded" if status == 200 else f"moto {status}"
        if status == 200 and params.get("InstanceMarketOptions.MarketType") == "spot":
            self._open_spot_requests(h, region, params, data)
        if status == 200:
            self._tag_interfaces(region, params, data)
        if status == 200:
            behavior = params.get("InstanceInitiatedShutdownBehavior", "stop")
            with self._lock:
                for iid in _instance_ids(data):
                    self._shutdown_behavior[iid] = behavior
        if status == 200 and self.faults.boot_describes:
            with self._lock:
                for iid in _instance_ids(data):
                    self._booting[iid] = self.faults.boot_describes
        return _Reply(status, data, ctype, rec.answer)

    def _tag_interfaces(self, region: str, params: dict[str, str], data: bytes) -> None:
        """RunInstances' ``network-interface`` TagSpecification on each new instance's network
        interfaces, as EC2 applies it (botocore ec2 model, RunInstancesRequest.TagSpecifications:
        "You can specify tags for the following resources only: Instances, Volumes, Spot
        Instance requests, Network interfaces"); moto applies only the instance and volume
        ones. EC2 bills a public IPv4 address to its interface, so these tags are what Cost
        Explorer attributes it by."""
        tags = _tag_spec(params, "network-interface")
        if not tags:
            return
        ec2 = self.client("ec2", region)
        for iid in _instance_ids(data):
            found = ec2.describe_network_interfaces(
                Filters=[{"Name": "attachment.instance-id", "Values": [iid]}]
            )["NetworkInterfaces"]
            ids = [eni["NetworkInterfaceId"] for eni in found]
            if ids:
                ec2.create_tags(
                    Resources=ids, Tags=[{"Key": k, "Value": v} for k, v in tags.items()]
                )

    def _open_spot_requests(
        self, h: _ProxyHandler, region: str, params: dict[str, str], data: bytes
    ) -> None:
        spot = "InstanceMarketOptions.SpotOptions."
        launch = {k: v for k, v in params.items() if k != "ClientToken"}
        headers = {
            k: v
            for k, v in h.headers.items()
            if k.lower() not in ("content-length", "connection", "keep-alive")
        }
        with self._lock:
            for iid in _instance_ids(data):
                rid = f"sir-{uuid.uuid4().hex[:8]}"
                self.spot_requests[rid] = SpotRequest(
                    rid,
                    region,
                    params.get(spot + "SpotInstanceType", "one-time"),
                    params.get(spot + "InstanceInterruptionBehavior", "terminate"),
                    iid,
                    (headers, urllib.parse.urlencode(launch).encode()),
                    instances=[iid],
                )

    def _spot_request_of(self, instance_id: str) -> SpotRequest | None:
        return next((r for r in self.spot_requests.values() if r.instance_id == instance_id), None)

    def _relaunch(self, request: SpotRequest) -> None:
        """EC2 fulfils the open persistent request again: a new instance, billed."""
        headers, body = request.launch
        host, port = urllib.parse.urlsplit(self.moto_url).netloc.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            conn.request(
                "POST", "/", body=body, headers={**headers, "Content-Length": str(len(body))}
            )
            data = conn.getresponse().read()
        finally:
            conn.close()
        (new,) = _instance_ids(data)
        request.instance_id, request.state = new, "active"
        request.instances.append(new)

    def _after_terminate(self, ids: list[str]) -> None:
        """A one-time request closes with its instance; a persistent one that is not cancelled
        relaunches it ("remains active until it expires or you cancel it, even if the request
        is fulfilled" — CDK SpotRequestType.PERSISTENT, EC2 User Guide)."""
        for iid in ids:
            request = self._spot_request_of(iid)
            if request is None or request.state in ("cancelled", "closed"):
                continue
            if request.kind == "persistent":
                self._relaunch(request)
            else:
                request.state = "closed"

    def _cancel_spot_requests(self, params: dict[str, str], rec: Recorded) -> _Reply:
        """CancelSpotInstanceRequests, answered here (moto keeps no request for RunInstances
        market options). Cancelling does not terminate the instance (EC2 API reference)."""
        items = []
        with self._lock:
            for key, rid in sorted(params.items()):
                if not key.startswith("SpotInstanceRequestId."):
                    continue
                request = self.spot_requests.get(rid)
                if request is None:
                    rec.answer = "InvalidSpotInstanceRequestID.NotFound"
                    return ec2_error(
                        "InvalidSpotInstanceRequestID.NotFound",
                        f"The spot instance request ID '{rid}' does not exist",
                        400,
                    )
                request.state = "cancelled"
                items.append(
                    f"<item><spotInstanceRequestId>{rid}</spotInstanceRequestId>"
                    "<state>cancelled</state></item>"
                )
        rec.answer = "answered"
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<CancelSpotInstanceRequestsResponse '
            'xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
            f"<requestId>{uuid.uuid4()}</requestId>"
            f"<spotInstanceRequestSet>{''.join(items)}</spotInstanceRequestSet>"
            "</CancelSpotInstanceRequestsResponse>"
        ).encode()
        return _Reply(200, body, "text/xml", "answered")

    def _maybe_drop(self, reply: _Reply, rec: Recorded) -> _Reply:
        if reply.status == 200 and self.faults.take_drop("RunInstances"):
            rec.answer = "dropped"
            raise _Dropped
        return reply

    def _rewrite_booting(self, data: bytes) -> bytes:
        """A booting instance reads ``pending`` (code 0, botocore's ec2 model InstanceState),
        one DescribeInstances fewer each time, as EC2's take the first seconds after launch."""
        with self._lock:
            shown = {iid for iid, left in self._booting.items() if left > 0}

        def boot(iid: str, item: ET.Element, q: Any) -> None:
            state = item.find(q("instanceState"))
            if state is None:
                return
            for tag, text in (("code", "0"), ("name", "pending")):
                node = state.find(q(tag))
                if node is not None:
                    node.text = text
            with self._lock:
                self._booting[iid] -= 1

        return _edit_instances(data, shown, boot)

    def _rewrite_address(self, data: bytes, address: str) -> bytes:
        """Every instance with a public address answers at ``address`` (the test knob)."""

        def point(iid: str, item: ET.Element, q: Any) -> None:
            node = item.find(q("ipAddress"))
            if node is not None:
                node.text = address

        return _edit_instances(data, set(_instance_ids(data)), point)

    def _rewrite_preempted(self, data: bytes) -> bytes:
        with self._lock:
            preempted = dict(self._preempted)

        def take(iid: str, item: ET.Element, q: Any) -> None:
            code, message, when, initiated = preempted[iid]
            reason = item.find(q("stateReason"))
            if reason is None:
                reason = ET.SubElement(item, q("stateReason"))
            for tag, text in (("code", code), ("message", message)):
                node = reason.find(q(tag))
                if node is None:
                    node = ET.SubElement(reason, q(tag))
                node.text = text
            transition = item.find(q("reason"))
            if transition is None:
                transition = ET.SubElement(item, q("reason"))
            transition.text = f"{initiated} ({when:%Y-%m-%d %H:%M:%S} GMT)"

        return _edit_instances(data, set(preempted), take)

    def _spot_history(self, region: str, params: dict[str, str], rec: Recorded) -> _Reply:
        unknown = [k for k in params if not _SPOT_PARAMS.match(k)]
        if unknown:
            rec.answer = "InvalidParameterValue"
            return ec2_error("InvalidParameterValue", f"unsupported parameters {unknown}", 400)
        types = {v for k, v in params.items() if k.startswith("InstanceType.")}
        products = {v for k, v in params.items() if k.startswith("ProductDescription.")}
        zone = params.get("AvailabilityZone")
        rows = [
            r
            for r in self.spot_history
            if r["availabilityZone"][: len(region)] == region
            and r["availabilityZone"][len(region) :].isalpha()
            and (not types or r["instanceType"] in types)
            and (not products or r["productDescription"] in products)
            and (not zone or r["availabilityZone"] == zone)
        ]
        start = int(params.get("NextToken") or 0)
        size = min(int(params.get("MaxResults") or 1000), self.faults.page_size or 1000)
        page, more = rows[start : start + size], start + size < len(rows)
        items = "".join(
            "<item>" + "".join(f"<{k}>{escape(v)}</{k}>" for k, v in r.items()) + "</item>"
            for r in page
        )
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<DescribeSpotPriceHistoryResponse '
            f'xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>{uuid.uuid4()}'
            f"</requestId><spotPriceHistorySet>{items}</spotPriceHistorySet>"
            f"<nextToken>{start + size if more else ''}</nextToken>"
            "</DescribeSpotPriceHistoryResponse>"
        )
        rec.answer = "fixture"
        return _Reply(200, body.encode(), "text/xml;charset=UTF-8", "fixture")

    def _pricing(self, h: _ProxyHandler, region: str, body: bytes) -> _Reply:
        target = h.headers.get("X-Amz-Target", "")
        payload = _parse_json(body)
        rec = self._record(Recorded("pricing", region, target.split(".")[-1], payload))
        if target != "AWSPriceListService.GetProducts":
            rec.answer = "UnknownOperationException"
            return json_error("UnknownOperationException", f"not emulated: {target}")
        if payload.get("ServiceCode") != "AmazonEC2":
            rec.answer = "NotFoundException"
            return json_error("NotFoundException", "only AmazonEC2 is emulated")
        filters = payload.get("Filters") or []
        for f in filters:
            if set(f) != {"Type", "Field", "Value"} or f["Type"] != "TERM_MATCH":
                rec.answer = "ValidationException"
                return json_error("ValidationException", f"malformed filter {f}")
        matches = [
            p
            for p in self.price_list
            if all(
                str(p["product"]["attributes"].get(f["Field"], "")).casefold()
                == str(f["Value"]).casefold()
                for f in filters
            )
        ]
        start = int(payload.get("NextToken") or 0)
        size = min(int(payload.get("MaxResults") or 100), 100)
        reply: dict[str, Any] = {
            "FormatVersion": payload.get("FormatVersion", "aws_v1"),
            "PriceList": [json.dumps(p) for p in matches[start : start + size]],
        }
        if start + size < len(matches):
            reply["NextToken"] = str(start + size)
        rec.answer = "fixture"
        return json_reply(reply)

    def _ssm(self, h: _ProxyHandler, region: str, body: bytes) -> None:
        target = h.headers.get("X-Amz-Target", "")
        payload = _parse_json(body)
        rec = self._record(Recorded("ssm", region, target.split(".")[-1], payload))
        name = payload.get("Name")
        if target != "AmazonSSM.GetParameter" or name not in self.public_parameters:
            return
        value = self.public_parameters[name] or self.ubuntu_ami(region)
        rec.answer = "fixture"
        raise json_reply(
            {
                "Parameter": {
                    "Name": name,
                    "Type": "String",
                    "Value": value,
                    "Version": 1,
                    "LastModifiedDate": 1764460800.0,
                    "ARN": f"arn:aws:ssm:{region}::parameter{name}",
                    "DataType": "text",
                }
            }
        )

    def _record(self, rec: Recorded) -> Recorded:
        with self._lock:
            self.requests.append(rec)
        self._current.rec = rec
        return rec

    def _forward(self, h: _ProxyHandler, body: bytes) -> tuple[int, str, bytes]:
        host, port = urllib.parse.urlsplit(self.moto_url).netloc.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            headers = {
                k: v
                for k, v in h.headers.items()
                if k.lower() not in ("content-length", "connection", "keep-alive")
            }
            headers["Content-Length"] = str(len(body))
            conn.request(h.command, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.getheader("Content-Type", "text/xml"), resp.read()
        finally:
            conn.close()


class _Dropped(Exception):
    """The response is lost: close the connection without answering."""


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms stalls
    owner: AwsEmulator

    def _serve(self) -> None:
        try:
            self.owner.handle(self)
        except (_Dropped, BrokenPipeError, ConnectionResetError):  # or the client gave up
            self.close_connection = True

    do_POST = do_GET = do_PUT = do_DELETE = _serve

    def reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _parse_form(h: BaseHTTPRequestHandler, body: bytes) -> dict[str, str]:
    if not h.headers.get("Content-Type", "").startswith("application/x-www-form-urlencoded"):
        raise ec2_error("MalformedQueryString", "expected a form-encoded body", 400)
    try:
        pairs = urllib.parse.parse_qsl(
            body.decode("ascii"), keep_blank_values=True, strict_parsing=bool(body)
        )
    except (UnicodeDecodeError, ValueError) as exc:
        raise ec2_error("MalformedQueryString", f"bad query string: {exc}", 400) from None
    params = dict(pairs)
    if len(params) != len(pairs):
        raise ec2_error("MalformedQueryString", "duplicate parameters", 400)
    return params


def _parse_json(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body or b"{}")
    except ValueError:
        raise json_error("SerializationException", "body is not JSON") from None
    if not isinstance(payload, dict):
        raise json_error("SerializationException", "body is not a JSON object")
    return payload


def _edit_instances(data: bytes, ids: set[str], edit: Any) -> bytes:
    """A DescribeInstances answer with ``edit(instance_id, item, q)`` applied to the items of
    ``ids`` (``q`` names a tag in the answer's namespace); unchanged when none is in it."""
    if not any(iid.encode() in data for iid in ids):
        return data
    root = ET.fromstring(data)
    ns = root.tag[1:].split("}")[0] if root.tag.startswith("{") else ""
    q = (lambda tag: f"{{{ns}}}{tag}") if ns else (lambda tag: tag)
    if ns:
        ET.register_namespace("", ns)
    for item in root.iter(q("item")):
        iid = item.findtext(q("instanceId"))
        if iid in ids:
            edit(iid, item, q)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def _instance_ids(data: bytes) -> list[str]:
    """The instance ids of a RunInstances answer."""
    root = ET.fromstring(data)
    ids = [e.text or "" for e in root.iter() if e.tag.rsplit("}", 1)[-1] == "instanceId"]
    return list(dict.fromkeys(ids))


def _validate_run_instances(params: dict[str, str]) -> None:
    for required in ("ImageId", "InstanceType", "MinCount", "MaxCount"):
        if not params.get(required):
            raise ec2_error("MissingParameter", f"The request must contain {required}", 400)
    token = params.get("ClientToken", "")
    if len(token) > 64 or not token.isascii():
        raise ec2_error("InvalidParameterValue", "ClientToken: at most 64 ASCII characters", 400)
    if "UserData" in params:
        try:
            raw = base64.b64decode(params["UserData"], validate=True)
        except binascii.Error:
            raise ec2_error(
                "InvalidParameterValue", "Invalid BASE64 encoding of user data", 400
            ) from None
        # "User data is limited to 16 KB, in raw form, before it is base64-encoded" (EC2 User
        # Guide, "Work with instance user data"); EC2 answers "InvalidParameterValue: User data
        # is limited to 16384 bytes" (as reported in dask/dask-cloudprovider#249 and
        # runs-on/runs-on#9). moto does not check it.
        if len(raw) > 16_384:
            raise ec2_error("InvalidParameterValue", "User data is limited to 16384 bytes", 400)
    _validate_tags(params)
    spot = "InstanceMarketOptions.SpotOptions."
    behaviour = params.get(spot + "InstanceInterruptionBehavior", "terminate")
    if behaviour in ("stop", "hibernate") and params.get(spot + "SpotInstanceType") != "persistent":
        raise ec2_error(
            "InvalidParameterCombination",
            f"InstanceInterruptionBehavior {behaviour} requires a persistent spot request",
            400,
        )


#: the resources RunInstances tags at launch (botocore ec2 model, RunInstancesRequest.
#: TagSpecifications: "Instances, Volumes, Spot Instance requests, Network interfaces"; its
#: ResourceType enum spells them so)
RUN_INSTANCES_TAGGABLE = ("instance", "volume", "spot-instances-request", "network-interface")


def _tag_spec(params: dict[str, str], resource: str) -> dict[str, str]:
    """The tags a RunInstances request's TagSpecification.N gives ``resource``."""
    out: dict[str, str] = {}
    for name, value in params.items():
        typed = name.startswith("TagSpecification.") and name.endswith(".ResourceType")
        if typed and value == resource:
            prefix = name.removesuffix("ResourceType") + "Tag."
            for i in range(1, 51):
                if f"{prefix}{i}.Key" not in params:
                    break
                out[params[f"{prefix}{i}.Key"]] = params.get(f"{prefix}{i}.Value", "")
    return out


def _validate_tags(params: dict[str, str]) -> None:
    """EC2 "Tag restrictions" (EC2 User Guide): key ≤ 128, value ≤ 256 characters, no key
    beginning with ``aws:`` — answered "InvalidParameterValue: Value ( aws:… ) for parameter key
    is invalid. Tag keys starting with 'aws:' are reserved for internal use" (as reported in
    kubernetes-sigs/cluster-api-provider-aws#5461). moto counts the 50 tags itself
    (TagLimitExceeded) but checks none of these; the wording of the length refusals is not
    documented."""
    for name, value in params.items():
        if not name.startswith("TagSpecification."):
            continue
        # EC2's words, as users report meeting them (e.g. "'instance' is not a valid taggable
        # resource type for this operation" from CreateLaunchTemplate); moto uses the same
        if name.endswith(".ResourceType") and value not in RUN_INSTANCES_TAGGABLE:
            raise ec2_error(
                "InvalidParameterValue",
                f"'{value}' is not a valid taggable resource type for this operation.",
                400,
            )
        if name.endswith(".Key"):
            if value[:4].lower() == "aws:":
                raise ec2_error(
                    "InvalidParameterValue",
                    f"Value ( {value} ) for parameter key is invalid. Tag keys starting with "
                    "'aws:' are reserved for internal use",
                    400,
                )
            if len(value) > 128:
                raise ec2_error("InvalidParameterValue", f"Tag key too long: {value}", 400)
        elif name.endswith(".Value") and len(value) > 256:
            raise ec2_error("InvalidParameterValue", f"Tag value too long: {value}", 400)


@contextmanager
def aws_emulator() -> Iterator[AwsEmulator]:
    emulator = start_aws_emulator()
    try:
        yield emulator
    finally:
        emulator.stop()


def start_aws_emulator() -> AwsEmulator:
    """Start moto and the proxy on 127.0.0.1 (ephemeral ports). Call ``.stop()`` when done."""
    return AwsEmulator()


# --- recorded-shape price fixtures ----------------------------------------------------------


def _product(
    itype: str, region: str, usd: str, vcpu: int, memory: str, gpus: int, **attrs: str
) -> dict[str, Any]:
    """One Price List item in the shape GetProducts returns (each sent as a JSON string)."""
    sku = uuid.uuid5(uuid.NAMESPACE_URL, f"{itype}/{region}/{sorted(attrs.items())}").hex[:16]
    sku = sku.upper()
    attributes = {
        "servicecode": "AmazonEC2",
        "servicename": "Amazon Elastic Compute Cloud",
        "instanceType": itype,
        "instanceFamily": "GPU instance",
        "regionCode": region,
        "location": {"us-east-1": "US East (N. Virginia)", "us-west-2": "US West (Oregon)"}[region],
        "locationType": "AWS Region",
        "vcpu": str(vcpu),
        "memory": memory,
        "gpu": str(gpus),
        "operatingSystem": "Linux",
        "tenancy": "Shared",
        "preInstalledSw": "NA",
        "capacitystatus": "Used",
        "licenseModel": "No License required",
        "marketoption": "OnDemand",
        "usagetype": f"{'USE1' if region == 'us-east-1' else 'USW2'}-BoxUsage:{itype}",
        "operation": "RunInstances",
        **attrs,
    }
    return {
        "product": {"productFamily": "Compute Instance", "attributes": attributes, "sku": sku},
        "serviceCode": "AmazonEC2",
        "terms": {
            "OnDemand": {
                f"{sku}.JRTCKXETXF": {
                    "priceDimensions": {
                        f"{sku}.JRTCKXETXF.6YS6EN2CT7": {
                            "unit": "Hrs",
                            "endRange": "Inf",
                            "description": f"${usd} per On Demand Linux {itype} Instance Hour",
                            "appliesTo": [],
                            "rateCode": f"{sku}.JRTCKXETXF.6YS6EN2CT7",
                            "beginRange": "0",
                            "pricePerUnit": {"USD": f"{usd}0000000"},
                        }
                    },
                    "sku": sku,
                    "effectiveDate": "2026-11-01T00:00:00Z",
                    "offerTermCode": "JRTCKXETXF",
                    "termAttributes": {},
                }
            }
        },
        "version": "20261127000000",
        "publicationDate": "2026-11-27T00:00:00Z",
    }


PRICE_LIST: list[dict[str, Any]] = [
    _product("p4d.24xlarge", "us-east-1", "21.9576", 96, "1152 GiB", 8),
    _product("p4d.24xlarge", "us-east-1", "26.4876", 96, "1152 GiB", 8, operatingSystem="Windows"),
    _product("p4d.24xlarge", "us-east-1", "24.1534", 96, "1152 GiB", 8, tenancy="Dedicated"),
    _product(
        "p4d.24xlarge",
        "us-east-1",
        "21.9576",
        96,
        "1152 GiB",
        8,
        capacitystatus="UnusedCapacityReservation",
    ),
    _product("p4de.24xlarge", "us-east-1", "27.4471", 96, "1152 GiB", 8),
    _product("p5.48xlarge", "us-east-1", "55.0400", 192, "2048 GiB", 8),
    _product(
        "p5.48xlarge", "us-east-1", "31.4640", 192, "2048 GiB", 8, marketoption="CapacityBlock"
    ),
    _product("g4dn.xlarge", "us-east-1", "0.5260", 4, "16 GiB", 1),
    _product("g4dn.12xlarge", "us-east-1", "3.9120", 48, "192 GiB", 4),
    _product("g5.xlarge", "us-east-1", "1.0060", 4, "16 GiB", 1),
    _product("g6.xlarge", "us-east-1", "0.8048", 4, "16 GiB", 1),
    _product("p4d.24xlarge", "us-west-2", "21.9576", 96, "1152 GiB", 8),
    _product("g4dn.xlarge", "us-west-2", "0.5260", 4, "16 GiB", 1),
]


def _spot(zone: str, itype: str, price: str, when: str) -> dict[str, str]:
    return {
        "instanceType": itype,
        "productDescription": "Linux/UNIX",
        "spotPrice": price,
        "timestamp": f"2026-11-30T{when}:00.000Z",
        "availabilityZone": zone,
    }


SPOT_HISTORY: list[dict[str, str]] = [
    _spot("us-east-1a", "p4d.24xlarge", "9.1000", "06:00"),
    _spot("us-east-1a", "p4d.24xlarge", "8.6012", "11:00"),  # latest in 1a
    _spot("us-east-1b", "p4d.24xlarge", "10.2077", "09:30"),
    _spot("us-east-1a", "p5.48xlarge", "22.3140", "10:00"),
    _spot("us-east-1a", "g4dn.xlarge", "0.2163", "08:00"),
    _spot("us-east-1b", "g4dn.xlarge", "0.1988", "10:15"),
    _spot("us-east-1c", "g4dn.xlarge", "0.2301", "07:45"),
    {**_spot("us-east-1a", "g4dn.xlarge", "0.9000", "11:30"), "productDescription": "Windows"},
    _spot("us-west-2a", "p4d.24xlarge", "7.9513", "10:00"),
    _spot("us-west-2b", "g4dn.xlarge", "0.1876", "10:00"),
]
