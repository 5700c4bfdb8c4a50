"""SberCloud (cloud.ru Advanced): the Huawei ECS API through ``huaweicloudsdkecs``.

Endpoints are options, so the adapter serves any cloud of the Huawei stack. The client is built
with explicit endpoints, never ``EcsRegion.value_of`` (that points at Huawei's own hosts). Without
a ``project_id`` the SDK looks the project up in IAM (``iam_endpoint``) by region name.

Preemption: Huawei reports no reason when a spot server stops or disappears. So before every stop
or delete it asks for, the adapter writes the server metadata ``provisioner_stopped_by=user``
(removed again on start). A spot server (metadata ``charging_mode == "2"``) that is SHUTOFF or
DELETED *without* that marker was taken back by the cloud and reads PREEMPTED; one that vanished
entirely raises NotFound. A spot server stopped from the console, bypassing provisioner, also
reads PREEMPTED — there is no way to tell the two apart. Huawei spot servers are released on
interruption, so ``request.preemption_action`` cannot be honoured and is ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from functools import cached_property
from typing import Any, TypeVar

from providers.base import (
    TAG_MACHINE,
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    AuthError,
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
from providers.retry import wait_until
from providers.sbercloud import (
    ENV_AK,
    ENV_PROJECT,
    ENV_SK,
    SPEC,
    SberCloudOptions,
    batch,
    env,
    errors,
    flavors,
    tags,
    userdata,
)
from providers.sbercloud.network import GONE, SshGroup
from providers.sbercloud.volumes import Volumes

T = TypeVar("T")

STOP_MARKER = "provisioner_stopped_by"
SPOT_CHARGING_MODE = "2"
_STATES = {
    "BUILD": MachineState.PENDING,
    "REBUILD": MachineState.PENDING,
    "ACTIVE": MachineState.RUNNING,
    "REBOOT": MachineState.RUNNING,
    "HARD_REBOOT": MachineState.RUNNING,
    "MIGRATING": MachineState.RUNNING,
    "RESIZE": MachineState.RUNNING,
    "VERIFY_RESIZE": MachineState.RUNNING,
    "REVERT_RESIZE": MachineState.RUNNING,
    "SHUTOFF": MachineState.STOPPED,
    "PAUSED": MachineState.STOPPED,
    "SUSPENDED": MachineState.STOPPED,
    "SHELVED": MachineState.STOPPED,
    "SHELVED_OFFLOADED": MachineState.STOPPED,
    "ERROR": MachineState.STOPPED,  # not running, not billed as running; terminate to clean up
    "DELETED": MachineState.TERMINATED,
    "SOFT_DELETED": MachineState.TERMINATED,
}


def machine_state(
    status: str, task_state: str, *, spot: bool, stopped_by_us: bool
) -> tuple[MachineState, str | None]:
    """ECS status (+ task state) → our state, and a reason when we infer one."""
    if status in ("SHUTOFF", *GONE) and spot and not stopped_by_us:
        return MachineState.PREEMPTED, f"spot server {status} without a provisioner stop"
    if status == "ACTIVE" and task_state == "powering-off":
        return MachineState.STOPPING, None
    return _STATES.get(status, MachineState.PENDING), None


def _time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _stopped_at(s: Any, status: str) -> datetime | None:
    """When the server stopped or was deleted (huaweicloudsdkecs ServerDetail; Huawei ECS
    "Querying Details About ECSs"). A deleted one carries ``OS-SRV-USG:terminated_at`` ("the
    time the ECS was deleted", UTC without an offset). ECS has no stop time: ``updated`` ("the
    time the ECS was updated") is its last change, the stop or later, so a SHUTOFF server is
    billed to it and never for less than it ran. A server ECS no longer shows has neither."""
    if status in GONE:
        return _time(s.os_srv_us_gterminated_at)
    return _time(s.updated) if status == "SHUTOFF" else None


def _fault(s: Any, status: str) -> str | None:
    """A server's fault (or its ERROR status) as the reason of its state, when it has one."""
    fault = s.fault if isinstance(s.fault, dict) else {}
    if fault.get("message") or status == "ERROR":
        return f"{status}: {fault.get('message') or 'no fault message'}"
    return None


def _addresses(s: Any) -> tuple[str | None, str | None]:
    """A server's public (floating) and private addresses: the first of each."""
    ips = [a for addrs in (s.addresses or {}).values() for a in addrs or []]
    public = next((a.addr for a in ips if a.os_ext_ip_stype == "floating"), None)
    private = next((a.addr for a in ips if a.os_ext_ip_stype != "floating"), None)
    return public, private


def _labels(server_tags: Any) -> dict[str, str]:
    """A server's ``key=value`` tags as labels (a tag without ``=`` is a key with no value)."""
    return dict(t.split("=", 1) if "=" in t else (t, "") for t in server_tags or [])


class SberCloudProvider(Provider):
    spec = SPEC
    options: SberCloudOptions

    def __init__(self, options: Any = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        o = self.options
        self.region: str = o.regions[0]
        self.ecs_endpoint: str = o.endpoint or f"https://ecs.{self.region}.hc.sbercloud.ru"
        self.iam_endpoint: str = o.iam_endpoint or f"https://iam.{self.region}.hc.sbercloud.ru/v3"
        self.vpc_endpoint: str = o.vpc_endpoint or f"https://vpc.{self.region}.hc.sbercloud.ru"
        self.zones: list[str] = list(o.zones or [f"{self.region}{z}" for z in "abc"])
        self._ecs: Any = None
        self._vpc_client: Any = None
        self._network = SshGroup(self)

    @cached_property
    def volumes(self) -> Volumes:
        return Volumes(self)

    # -- plumbing -------------------------------------------------------------------------

    def _client(self) -> Any:
        if self._ecs is None:
            from huaweicloudsdkecs.v2 import EcsClient

            self._ecs = self._build(EcsClient, self.ecs_endpoint)
        return self._ecs

    def _vpc(self) -> Any:
        if self._vpc_client is None:
            from huaweicloudsdkvpc.v2 import VpcClient

            self._vpc_client = self._build(VpcClient, self.vpc_endpoint)
        return self._vpc_client

    def _build(self, client_class: Any, endpoint: str) -> Any:
        ak, sk = env(ENV_AK), env(ENV_SK)
        if not ak or not sk:
            raise AuthError(
                "sbercloud: no credentials: set SBERCLOUD_ACCESS_KEY and SBERCLOUD_SECRET_KEY",
                code="NoCredentials",
            )
        from huaweicloudsdkcore.auth.credentials import BasicCredentials
        from huaweicloudsdkcore.exceptions.exceptions import SdkException
        from huaweicloudsdkcore.http.http_config import HttpConfig
        from huaweicloudsdkcore.region.region import Region

        config = HttpConfig.get_default_config()
        config.retry_times = 0  # Throttled is retried by Provider.call, with a bound
        config.timeout = (10, 60)
        project = self.options.project_id or env(ENV_PROJECT)
        credentials = BasicCredentials(ak, sk, project)
        builder = client_class.new_builder().with_http_config(config).with_credentials(credentials)
        if project:
            builder.with_endpoints([endpoint])
        else:  # the SDK asks IAM for the project of this region while building
            credentials.with_iam_endpoint(self.iam_endpoint)
            builder.with_region(Region(self.region, endpoint))
        try:
            return builder.build()
        except SdkException as e:
            err = self.map_error(e, f"find the project of {self.region} via IAM")
            assert err is not None  # an SdkException always maps
            raise (err if isinstance(err, Throttled) else AuthError(str(err), code=err.code)) from e

    def map_error(self, exc: Exception, what: str) -> ProviderError | None:
        return errors.map_error(exc, what)

    def _call(
        self,
        where: str,
        fn: Callable[[Any], T],
        *,
        attempts: int | None = None,
        service: str = "ecs",
    ) -> T:
        """``fn`` with the ECS (or VPC) client, through :meth:`call`."""

        def attempt() -> T:
            return fn(self._vpc() if service == "vpc" else self._client())

        return self.call(attempt, where, attempts=attempts)

    def _wait(self, job_id: str, where: str, timeout: float) -> bool:
        """Poll an ECS job: True on SUCCESS, False if still running at ``timeout``; FAIL raises."""
        from huaweicloudsdkecs.v2 import model as m

        job, finished = wait_until(
            lambda: self._call(where, lambda c: c.show_job(m.ShowJobRequest(job_id=job_id))),
            lambda j: j.status in ("SUCCESS", "FAIL"),
            timeout=timeout,
            interval=self.options.poll_seconds,
        )
        if job.status == "FAIL":
            code, reason = job.error_code, job.fail_reason
            for sub in (job.entities.sub_jobs if job.entities else None) or []:
                if sub.status == "FAIL" and not code:
                    code, reason = sub.error_code, sub.fail_reason
            raise errors.by_code(
                None, code, f"job {job_id} failed: {reason or 'no reason given'}", where=where
            )
        return finished

    def _finish(self, job_id: str, where: str) -> None:
        timeout = self.options.operation_timeout_seconds
        if not self._wait(job_id, where, timeout):
            raise Throttled(
                f"sbercloud: {where}: job {job_id} still running after {timeout:.0f} s",
                code="JobTimeout",
            )

    def _server(self, server_id: str) -> Any:
        from huaweicloudsdkecs.v2 import model as m

        return self._call(
            f"get server {server_id}",
            lambda c: c.show_server(m.ShowServerRequest(server_id=server_id)),
        ).server

    def _servers(self, **filters: Any) -> Iterator[Any]:
        """Every server of the project (matching ``filters``); ``offset`` is a page number."""
        from huaweicloudsdkecs.v2 import model as m

        limit = self.options.page_size

        def page(number: int | None) -> tuple[list[Any], int | None]:
            n = number or 1
            listed = self._call(
                "list servers",
                lambda c: c.list_servers_details(
                    m.ListServersDetailsRequest(limit=limit, offset=n, **filters)
                ),
            )
            servers = listed.servers or []
            return servers, n + 1 if servers and n * limit < (listed.count or 0) else None

        return paginate(page, 1)

    def _server_or_none(self, server_id: str) -> Any:
        try:
            return self._server(server_id)
        except NotFound:
            return None

    def _mark_stopped(self, server_id: str) -> bool:
        """Record that the next stop/delete is ours. False when the server is gone."""
        from huaweicloudsdkecs.v2 import model as m

        body = m.UpdateServerMetadataRequestBody(metadata={STOP_MARKER: "user"})
        try:
            self._call(
                f"mark server {server_id} as stopped by provisioner",
                lambda c: c.update_server_metadata(
                    m.UpdateServerMetadataRequest(server_id=server_id, body=body)
                ),
            )
        except NotFound:
            return False
        return True

    def _instance(self, s: Any) -> Instance:
        meta = s.metadata or {}
        spot = meta.get("charging_mode") == SPOT_CHARGING_MODE
        status = (s.status or "").upper()
        state, reason = machine_state(
            status,
            s.os_ext_st_stask_state or "",
            spot=spot,
            stopped_by_us=meta.get(STOP_MARKER) == "user",
        )
        public_ip, private_ip = _addresses(s)
        return Instance(
            id=s.id,
            name=s.name or "",
            region=self.region,
            zone=s.os_ext_a_zavailability_zone or "",
            instance_type=(s.flavor.id or s.flavor.name) if s.flavor else "",
            state=state,
            spot=spot,
            labels=_labels(s.tags),
            public_ip=public_ip,
            private_ip=private_ip,
            launched_at=_time(s.os_srv_us_glaunched_at) or _time(s.created),
            state_reason=reason or _fault(s, status),
            stopped_at=_stopped_at(s, status),
        )

    # -- the contract ---------------------------------------------------------------------

    def missing_setup(self) -> str | None:
        if not env(ENV_AK) or not env(ENV_SK):
            return (
                "sbercloud: no credentials found (set SBERCLOUD_ACCESS_KEY and "
                "SBERCLOUD_SECRET_KEY, or HUAWEICLOUD_SDK_AK and HUAWEICLOUD_SDK_SK)"
            )
        return None

    def probe(self) -> str:
        from huaweicloudsdkecs.v2 import model as m

        listed = self._call(
            "check credentials",
            lambda c: c.list_servers_details(m.ListServersDetailsRequest(limit=1)),
            attempts=2,
        )
        # No public image with an NVIDIA driver is documented for cloud.ru Advanced GPU flavors,
        # so an image is the user's to name, as are the network new servers join.
        unset = [k for k in ("image", "vpc_id", "subnet_id") if not getattr(self.options, k)]
        todo = (
            f"; to launch, set clouds.sbercloud.{', '.join(unset)} (image: a GPU-ready image of "
            "your project with the NVIDIA driver; no public one is documented per flavor)"
            if unset
            else ""
        )
        return (
            f"sbercloud: credentials accepted by {self.ecs_endpoint} "
            f"(region {self.region}, {listed.count or 0} servers in the project){todo}"
        )

    def refusal(self, exc: ProviderError) -> str:
        verb = "refused" if isinstance(exc, AuthError) else "failed"
        return f"sbercloud: {self.ecs_endpoint} {verb}: {exc}"

    def _image_and_network(self, request: LaunchRequest) -> str:
        """The image to launch (the request's, else the options'); InvalidRequest when there
        is none, or when the network new servers join is not set."""
        image = request.image or self.options.image
        if not image:
            raise InvalidRequest(
                "sbercloud: no image: set clouds.sbercloud.image to a GPU-ready image of your "
                "project, or name one in the spec",
                code="NoImage",
            )
        missing = [k for k in ("vpc_id", "subnet_id") if not getattr(self.options, k)]
        if missing:
            raise InvalidRequest(
                f"sbercloud: set clouds.sbercloud.{' and '.join(missing)}: the network new "
                "servers join",
                code="NoNetwork",
            )
        return image

    def _publicip(self, m: Any) -> Any:
        """The EIP a server is made with, released with it (``delete_on_termination``)."""
        # chargemode: absent means by bandwidth; "traffic" by traffic; anything else fails
        # the create (huaweicloudsdkecs PrePaidServerEipBandwidth)
        charge = "traffic" if self.options.bandwidth_charge == "traffic" else None
        return m.PrePaidServerPublicip(
            eip=m.PrePaidServerEip(
                iptype=self.options.eip_type,
                bandwidth=m.PrePaidServerEipBandwidth(
                    size=self.options.bandwidth_mbit, sharetype="PER", chargemode=charge
                ),
            ),
            delete_on_termination=True,
        )

    def launch(self, request: LaunchRequest) -> Instance:
        """One pay-per-use (or spot) server, idempotent by ``X-Client-Token``. Unless
        ``public_ip`` is off it gets its public address from an EIP made with it and released
        with it (``delete_on_termination``), so terminating leaves no address billing. Labels are
        folded into tags ECS accepts (:func:`.tags.server_tags`)."""
        image = self._image_and_network(request)
        from huaweicloudsdkecs.v2 import model as m

        extend = m.PrePaidServerExtendParam(charging_mode="postPaid")
        if request.spot:
            extend.market_type = "spot"
            if request.max_price is not None:
                extend.spot_price = format(Decimal(request.max_price), "f")
        group = self.options.security_group_id or self._network.group()
        server = m.PrePaidServer(
            image_ref=image,
            flavor_ref=request.instance_type,
            name=request.name,
            vpcid=self.options.vpc_id,
            nics=[m.PrePaidServerNic(subnet_id=self.options.subnet_id)],
            publicip=self._publicip(m) if self.options.public_ip else None,
            security_groups=[m.PrePaidServerSecurityGroup(id=group)],
            root_volume=m.PrePaidServerRootVolume(
                volumetype=self.options.root_volume_type, size=request.disk_gb
            ),
            availability_zone=request.zone or None,
            server_tags=[
                m.PrePaidServerTag(key=k, value=v)
                for k, v in tags.server_tags(request.labels).items()
            ],
            user_data=userdata.build(request.user_data, request.ssh_public_key, self.ssh_user),
            extendparam=extend,
            count=1,
        )
        create = m.CreateServersRequest(
            x_client_token=request.token, body=m.CreateServersRequestBody(server=server)
        )
        where = f"create {request.instance_type} in {request.zone or self.region}"
        created = self._call(where, lambda c: c.create_servers(create))
        if not created.server_ids:
            raise InvalidRequest(f"sbercloud: {where}: no server id in the answer", code="NoServer")
        # still running at the timeout → PENDING
        self._wait(created.job_id, where, self.options.operation_timeout_seconds)
        return self.get(
            InstanceRef(id=created.server_ids[0], region=self.region, zone=request.zone)
        )

    def get(self, ref: InstanceRef) -> Instance:
        return self._instance(self._server(ref.id))

    def list_managed(
        self, regions: Sequence[str] | None = None, machine_id: str | None = None
    ) -> list[Instance]:
        """One region per adapter (the ECS endpoint is regional). Filters server-side by the
        machine tag when a machine id is given, else by ``managed-by=provisioner``."""
        if regions is not None and self.region not in regions:
            return []
        tag = (
            f"{TAG_MACHINE}={machine_id}"
            if machine_id
            else f"{TAG_MANAGED_BY}={TAG_MANAGED_BY_VALUE}"
        )
        found = {s.id: self._instance(s) for s in self._servers(tags=tag)}
        return [
            i
            for i in found.values()
            if i.labels.get(TAG_MANAGED_BY) == TAG_MANAGED_BY_VALUE
            and (machine_id is None or i.machine_id == machine_id)
        ]

    def stop(self, ref: InstanceRef) -> None:
        """Idempotent: a stopped or vanished server is left alone."""
        from huaweicloudsdkecs.v2 import model as m

        s = self._server_or_none(ref.id)
        if s is None or s.status in ("SHUTOFF", *GONE) or not self._mark_stopped(ref.id):
            return
        option = m.BatchStopServersOption(servers=[m.ServerId(id=ref.id)], type="SOFT")
        where = f"stop server {ref.id}"
        try:
            job = self._call(
                where,
                lambda c: c.batch_stop_servers(
                    m.BatchStopServersRequest(body=m.BatchStopServersRequestBody(os_stop=option))
                ),
            )
        except NotFound:
            return
        self._finish(job.job_id, where)

    def start(self, ref: InstanceRef) -> None:
        """Idempotent; a server that is gone raises NotFound."""
        from huaweicloudsdkecs.v2 import model as m

        s = self._server(ref.id)
        if s.status in GONE:
            raise NotFound(f"sbercloud: server {ref.id} is {s.status}", code=s.status)
        where = f"start server {ref.id}"
        if s.status == "SHUTOFF":
            option = m.BatchStartServersOption(servers=[m.ServerId(id=ref.id)])
            job = self._call(
                where,
                lambda c: c.batch_start_servers(
                    m.BatchStartServersRequest(body=m.BatchStartServersRequestBody(os_start=option))
                ),
            )
            self._finish(job.job_id, where)
        if STOP_MARKER in (s.metadata or {}):
            self._call(
                where,
                lambda c: c.delete_server_metadata(
                    m.DeleteServerMetadataRequest(server_id=ref.id, key=STOP_MARKER)
                ),
            )

    def terminate(self, ref: InstanceRef) -> None:
        """Deletes the server, its disks and its EIP, our volumes detached first (they outlive
        it). Idempotent: a server already gone is fine."""
        from huaweicloudsdkecs.v2 import model as m

        s = self._server_or_none(ref.id)
        if s is None or s.status in GONE:
            return
        self.volumes.keep(s)
        if not self._mark_stopped(ref.id):
            return
        body = _delete_body(m, [m.ServerId(id=ref.id)])
        where = f"delete server {ref.id}"
        try:
            job = self._call(where, lambda c: c.delete_servers(m.DeleteServersRequest(body=body)))
        except NotFound:
            return
        self._finish(job.job_id, where)

    # -- batch forms (run by :mod:`.batch`) ------------------------------------------------

    def stop_many(self, refs: Sequence[InstanceRef]) -> dict[InstanceRef, ProviderError | None]:
        """Each server marked as stopped by us (one metadata call each: the marker is what
        tells our stops from preemptions), then one BatchStopServers job per 1,000 servers."""
        from huaweicloudsdkecs.v2 import model as m

        def call(c: Any, ids: list[str]) -> Any:
            option = m.BatchStopServersOption(servers=[m.ServerId(id=i) for i in ids], type="SOFT")
            body = m.BatchStopServersRequestBody(os_stop=option)
            return c.batch_stop_servers(m.BatchStopServersRequest(body=body))

        return batch.run(self, refs, "stop", call)

    def terminate_many(
        self, refs: Sequence[InstanceRef]
    ) -> dict[InstanceRef, ProviderError | None]:
        """As :meth:`stop_many`, with DeleteServers (disks deleted too, once our volumes are
        detached: a server whose volumes cannot be detached is not deleted)."""
        from huaweicloudsdkecs.v2 import model as m

        def call(c: Any, ids: list[str]) -> Any:
            servers = [m.ServerId(id=i) for i in ids]
            body = _delete_body(m, servers)
            return c.delete_servers(m.DeleteServersRequest(body=body))

        refused: dict[InstanceRef, ProviderError | None] = {}
        for ref in dict.fromkeys(refs):
            try:
                if (s := self._server_or_none(ref.id)) is not None:
                    self.volumes.keep(s)
            except ProviderError as e:
                refused[ref] = e
        done = batch.run(self, [r for r in refs if r not in refused], "delete", call)
        return {ref: refused[ref] if ref in refused else done[ref] for ref in dict.fromkeys(refs)}

    # -- our SSH security group ----------------------------------------------------------------

    def unused_network(self, *, remove: bool = False) -> list[str]:
        return self._network.unused(remove)

    def fetch_offers(self) -> list[Offer]:
        """GPU flavors sold in each configured zone, unpriced (see :mod:`.flavors`)."""
        from huaweicloudsdkecs.v2 import model as m

        out: list[Offer] = []
        for zone in self.zones:

            def list_flavors(c: Any, z: str = zone) -> Any:
                return c.list_flavors(m.ListFlavorsRequest(availability_zone=z))

            listed = self._call(f"list flavors in {zone}", list_flavors)
            out.extend(flavors.offers(listed.flavors or [], self.region, zone))
        return out


def _delete_body(m: Any, servers: list[Any]) -> Any:
    """DeleteServers for ``servers``, their EIPs and data disks deleted with them (our volumes
    are detached before). Both flags must be sent: huaweicloudsdkecs DeleteServersRequestBody
    (huaweicloud-sdk-go-v3 services/ecs/v2/model/model_delete_servers_request_body.go):
    ``delete_publicip`` "默认为false … false：删除云服务器时，
    仅解绑定在云服务器上的弹性IP，不删除弹性IP" (default false: the EIP is only unbound, and
    kept, billing); ``delete_volume`` likewise.
    ``delete_on_termination``, sent at create, is not relied on: a server made without it (an
    older launch, a server adopted) would otherwise leave its EIP billing."""
    return m.DeleteServersRequestBody(servers=servers, delete_publicip=True, delete_volume=True)
