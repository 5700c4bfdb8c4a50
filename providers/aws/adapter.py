"""The AWS adapter: EC2 through boto3 (imported lazily, inside methods).

Zones are AZ ids (``use1-az1``), as in the catalog: AZ names are shuffled per account, ids are
not. ``launch`` accepts either and places by the account's name for that id.

Credentials come only from boto3's default chain (environment, profile, SSO, instance role).
botocore's own retries are off (``total_max_attempts=1``) so ``Provider.call`` is the one
bounded retry. Launch is idempotent twice over: EC2 honours ``ClientToken``, and each attempt
first looks for an instance already tagged with the token (covers a lost response on a backend
that ignores the token, or a token past its expiry).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property, partial
from typing import Any

from providers.aws import LIMITS, SPEC, AWSOptions, errors
from providers.aws.instances import STOPPED_OR_GONE, instance_of, instances_of, parse_timestamp
from providers.aws.network import SshGroups, tag_list
from providers.aws.volumes import TAG_TOKEN, EbsVolumes
from providers.base import (
    TAG_MACHINE,
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    AuthError,
    Instance,
    InstanceRef,
    InvalidRequest,
    LaunchRequest,
    NotFound,
    Offer,
    Provider,
    ProviderError,
    Throttled,
)
from providers.limits import startup_payload

# Public SSM parameter of the "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)".
DEFAULT_IMAGE_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
)
# TerminateInstances takes "Up to 1000 instance IDs" a call (botocore's EC2 service model,
# TerminateInstancesRequest.InstanceIds); StopInstances states no limit, and gets the same.
BATCH_IDS = 1000
_INSTANCE_ID = re.compile(r"\bi-[0-9a-f]{8,17}\b")
NO_CREDENTIALS = (
    "aws: no credentials found (set AWS_PROFILE, or AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, or run `aws sso login`)"
)


class AWSProvider(Provider):
    """Options: :class:`providers.aws.AWSOptions`."""

    spec = SPEC
    options: AWSOptions

    def __init__(self, options: Any = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self._lock = threading.RLock()
        self._boto_session: Any = None
        self._clients: dict[tuple[str, str], Any] = {}
        self._images: dict[str, str] = {}
        self._described: dict[tuple[str, str], dict[str, Any]] = {}  # DescribeImages' answer
        self._root_devices: dict[tuple[str, str], str] = {}
        self._zone_ids: dict[str, dict[str, str]] = {}  # region → {AZ name: AZ id}
        self._network = SshGroups(self)

    @cached_property
    def volumes(self) -> EbsVolumes:
        return EbsVolumes(self)

    @property
    def regions(self) -> list[str]:
        return list(self.options.regions)

    # --- contract -------------------------------------------------------------------------

    def missing_setup(self) -> str | None:
        try:
            credentials = self._session().get_credentials()
        except Exception as exc:  # a broken profile/SSO config: say which kind, no traceback
            return f"aws: credentials could not be loaded ({type(exc).__name__})"
        return NO_CREDENTIALS if credentials is None else None

    def probe(self) -> str:
        sts = self._client("sts", self.regions[0])
        ident = self.call(sts.get_caller_identity, "verify credentials")
        return (
            f"aws: credentials OK for account {ident['Account']} ({ident['Arn']}); "
            + self.image_status(self.regions[0])
        )

    def image_status(self, region: str) -> str:
        """The image a launch in ``region`` would use, resolved as the launch resolves it (the
        DLAMI's public SSM parameter unless settings name an AMI, then DescribeImages), in
        words. Raises :class:`InvalidRequest` (code ``NoImage``) when it does not resolve."""
        try:
            image = self._image_for(region)
        except InvalidRequest as exc:
            raise InvalidRequest(str(exc), code="NoImage") from exc
        try:
            self._root_device(region, image)
        except InvalidRequest as exc:
            raise InvalidRequest(
                f"aws: image {image} not found in {region} ({exc.code}): set image, or images: "
                f"{{{region}: ami-…}}, in the aws settings to an AMI that exists there",
                code="NoImage",
            ) from exc
        found = self._described.get((region, image), {})
        name = f" ({found['Name']})" if found.get("Name") else ""
        # DescribeImages' DeprecationTime: "The date and time to deprecate the AMI" (botocore
        # ec2 model, Image); a deprecated AMI still launches by id
        when = found.get("DeprecationTime")
        return f"image {image}{name} in {region}" + (f", deprecated from {when}" if when else "")

    def refusal(self, exc: ProviderError) -> str:
        if exc.code == "NoImage":
            return str(exc.args[0])
        if isinstance(exc, AuthError):
            return f"aws: credentials were refused [{exc.code}]"
        return f"aws: credentials found but could not be verified [{exc.code}]"

    def launch(self, request: LaunchRequest) -> Instance:
        ec2 = self._client("ec2", request.region)
        zone = self._zone_name(request.region, request.zone)
        image = self._image(request)
        params = self._run_params(request, zone, image, self._root_device(request.region, image))

        def attempt() -> dict[str, Any]:
            found = self._find_by_token(ec2, request, zone)
            if found is not None:
                return found
            return ec2.run_instances(**params)["Instances"][0]

        what = f"launch {request.instance_type} in {zone}"
        try:
            raw = self.call(attempt, what)
        except InvalidRequest as exc:
            if exc.code != "InvalidGroup.NotFound" or self.options.security_group_ids:
                raise
            self._network.forget()  # our group was removed (gc) since we found it: find or make it
            params = self._run_params(
                request, zone, image, params["BlockDeviceMappings"][0]["DeviceName"]
            )
            raw = self.call(attempt, what)
        return self._instance(raw, request.region)

    def get(self, ref: InstanceRef) -> Instance:
        return self._instance(self._describe(ref), ref.region)

    def list_managed(
        self, regions: Sequence[str] | None = None, machine_id: str | None = None
    ) -> list[Instance]:
        filters = [{"Name": f"tag:{TAG_MANAGED_BY}", "Values": [TAG_MANAGED_BY_VALUE]}]
        if machine_id is not None:
            filters.append({"Name": f"tag:{TAG_MACHINE}", "Values": [machine_id]})
        found: list[Instance] = []
        for region in regions or self.regions:
            ec2 = self._client("ec2", region)
            token: str | None = None
            while True:  # page by page: a failed page is asked again, not the listing
                kw = {"Filters": filters, **({"NextToken": token} if token else {})}
                page = self.call(partial(ec2.describe_instances, **kw), "list instances")
                found.extend(self._instance(raw, region) for raw in instances_of(page))
                if not (token := page.get("NextToken")):
                    break
        return found

    def stop(self, ref: InstanceRef) -> None:
        if self._describe(ref)["State"]["Name"] in STOPPED_OR_GONE:
            return  # compute is not billed any more
        ec2 = self._client("ec2", ref.region)
        self.call(lambda: ec2.stop_instances(InstanceIds=[ref.id]), f"stop {ref.id}")

    def start(self, ref: InstanceRef) -> None:
        state = self._describe(ref)["State"]["Name"]
        if state in ("pending", "running"):
            return
        if state in ("shutting-down", "terminated"):
            raise InvalidRequest(
                f"aws: {ref.id} is terminated and cannot be started", code="IncorrectInstanceState"
            )
        ec2 = self._client("ec2", ref.region)
        self.call(lambda: ec2.start_instances(InstanceIds=[ref.id]), f"start {ref.id}")

    def terminate(self, ref: InstanceRef) -> None:
        ec2 = self._client("ec2", ref.region)
        try:
            self.call(lambda: ec2.terminate_instances(InstanceIds=[ref.id]), f"terminate {ref.id}")
        except NotFound:
            return  # already gone

    def stop_many(self, refs: Sequence[InstanceRef]) -> dict[InstanceRef, ProviderError | None]:
        """StopInstances with up to 1,000 ids a call per region, no describe per machine: the
        caller acts on what its list call showed running, and stopping a stopped instance is
        no error to EC2."""
        return self._batch(refs, "stop_instances", "stop")

    def terminate_many(
        self, refs: Sequence[InstanceRef]
    ) -> dict[InstanceRef, ProviderError | None]:
        return self._batch(refs, "terminate_instances", "terminate")

    def _batch(
        self, refs: Sequence[InstanceRef], method: str, verb: str
    ) -> dict[InstanceRef, ProviderError | None]:
        todo = list(dict.fromkeys(refs))
        by_region: dict[str, list[InstanceRef]] = {}
        for ref in todo:
            by_region.setdefault(ref.region, []).append(ref)
        out: dict[InstanceRef, ProviderError | None] = {}
        for region, group in by_region.items():
            call = getattr(self._client("ec2", region), method)
            for k in range(0, len(group), BATCH_IDS):
                out.update(self._batch_call(call, group[k : k + BATCH_IDS], verb))
        return {ref: out[ref] for ref in todo}

    def _batch_call(
        self, call: Callable[..., Any], refs: list[InstanceRef], verb: str
    ) -> dict[InstanceRef, ProviderError | None]:
        """One call for all of ``refs``. EC2 refuses a whole batch for one bad id ("If you
        specify multiple instances and the request fails (for example, because of a single
        incorrect instance ID), none of the instances are terminated", EC2 API Reference,
        TerminateInstances) and names it in the message: IncorrectInstanceState ("Instance
        'i-…' cannot be stopped as it has never reached the 'running' state",
        cloud-custodian/cloud-custodian#6014, whose c7n/resources/ec2.py Stop drops that id
        and calls again), InvalidInstanceID.NotFound
        ("The instance IDs 'i-…, i-…' do not exist"), UnsupportedOperation for a one-time
        spot instance. So the named ids get that error (a terminate of one already gone, none)
        and the call is made again without them; an error naming none of them is every id's."""
        out: dict[InstanceRef, ProviderError | None] = {}
        left = {ref.id: ref for ref in refs}
        while left:
            ids = list(left)
            what = f"{verb} {ids[0]}" if len(ids) == 1 else f"{verb} {len(ids)} instances"
            try:
                answer = self.call(partial(call, InstanceIds=ids), what)
            except ProviderError as e:
                out.update(_refused(e, left, verb))
                continue
            out.update(_answered(answer, left, verb))
        return out

    def unused_network(self, *, remove: bool = False) -> list[str]:
        return self._network.unused(remove)

    def fetch_offers(self) -> list[Offer]:
        from providers.aws.prices import fetch_offers

        # The Price List API is served from us-east-1 (also eu-central-1, ap-south-1).
        pricing = self._client("pricing", "us-east-1")
        return fetch_offers(
            self.regions,
            lambda region: self._client("ec2", region),
            self._zones,
            pricing,
            self.call,
        )

    # --- helpers --------------------------------------------------------------------------

    def map_error(self, exc: Exception, what: str) -> ProviderError | None:
        return errors.map_error(exc, what)

    def _session(self) -> Any:
        with self._lock:
            if self._boto_session is None:
                import boto3
                import botocore.session

                core = botocore.session.get_session()
                core.register_component("data_loader", _shared_loader())
                # Off EC2 the instance-metadata probe must fail fast, not hang `check`.
                core.set_config_variable("metadata_service_timeout", 1)
                core.set_config_variable("metadata_service_num_attempts", 1)
                core.get_component("response_parser_factory").set_parser_defaults(
                    timestamp_parser=parse_timestamp
                )
                self._boto_session = boto3.session.Session(botocore_session=core)
            return self._boto_session

    def _client(self, service: str, region: str) -> Any:
        with self._lock:
            client = self._clients.get((service, region))
            if client is None:
                from botocore.config import Config

                endpoint = self.options.endpoint
                if service == "pricing":
                    endpoint = self.options.pricing_endpoint or endpoint
                config = Config(
                    # Trap: botocore's "max_attempts" counts retries (1 → 2 attempts);
                    # "total_max_attempts" counts attempts.
                    retries={"total_max_attempts": 1, "mode": "standard"},
                    connect_timeout=self.options.connect_timeout_seconds,
                    read_timeout=self.options.timeout_seconds,
                    user_agent_extra="provisioner",
                )
                client = self._session().client(
                    service, region_name=region, endpoint_url=endpoint, config=config
                )
                self._clients[(service, region)] = client
            return client

    def _describe(self, ref: InstanceRef) -> dict[str, Any]:
        ec2 = self._client("ec2", ref.region)
        found = self.call(
            lambda: instances_of(ec2.describe_instances(InstanceIds=[ref.id])),
            f"describe {ref.id}",
        )
        if not found:
            raise NotFound(
                f"aws: {ref.id} not found in {ref.region}", code="InvalidInstanceID.NotFound"
            )
        return found[0]

    def _zones(self, region: str) -> dict[str, str]:
        """{AZ name: AZ id} of the region, as this account sees it."""
        if region not in self._zone_ids:
            ec2 = self._client("ec2", region)
            zones = self.call(
                lambda: ec2.describe_availability_zones()["AvailabilityZones"],
                f"describe zones of {region}",
            )
            self._zone_ids[region] = {z["ZoneName"]: z["ZoneId"] for z in zones}
        return self._zone_ids[region]

    def _zone_name(self, region: str, zone: str) -> str:
        zones = self._zones(region)
        if zone in zones:
            return zone
        for name, zone_id in zones.items():
            if zone_id == zone:
                return name
        raise InvalidRequest(f"aws: no zone {zone} in {region}", code="InvalidParameterValue")

    def _instance(self, raw: Mapping[str, Any], region: str) -> Instance:
        placement = raw.get("Placement") or {}
        name = placement.get("AvailabilityZone", "")
        zone = placement.get("AvailabilityZoneId") or self._zones(region).get(name, name)
        return instance_of(raw, region, zone)

    def _image(self, request: LaunchRequest) -> str:
        return self._image_for(request.region, request.image)

    def _image_for(self, region: str, explicit: str | None = None) -> str:
        image = explicit or self.options.images.get(region) or self.options.image
        if image:
            return str(image)
        if region not in self._images:
            ssm = self._client("ssm", region)
            try:
                value = self.call(
                    lambda: ssm.get_parameter(Name=DEFAULT_IMAGE_PARAMETER)["Parameter"]["Value"],
                    "resolve the default GPU image",
                )
            except Throttled:
                raise
            except ProviderError as exc:
                raise InvalidRequest(
                    f"aws: no default GPU image in {region}: SSM parameter "
                    f"{DEFAULT_IMAGE_PARAMETER} could not be read; set images: "
                    f"{{{region}: ami-…}} in the aws settings",
                    code=exc.code,
                ) from exc
            self._images[region] = value
        return self._images[region]

    def _root_device(self, region: str, image: str) -> str:
        """The image's root device name, so the root volume mapping resizes the right disk."""
        if (region, image) not in self._root_devices:
            ec2 = self._client("ec2", region)
            images = self.call(
                lambda: ec2.describe_images(ImageIds=[image])["Images"], f"describe {image}"
            )
            if not images:
                raise InvalidRequest(
                    f"aws: image {image} not found in {region}", code="InvalidAMIID.NotFound"
                )
            self._root_devices[(region, image)] = images[0].get("RootDeviceName") or "/dev/sda1"
            self._described[(region, image)] = images[0]
        return self._root_devices[(region, image)]

    def _subnet(self, region: str, zone: str) -> str | None:
        """The subnet set for ``zone`` (by its name or its zone id), else the one subnet set."""
        subnets = self.options.subnet_ids
        return subnets.get(zone) or subnets.get(self._zones(region)[zone]) or self.options.subnet_id

    def _run_params(
        self, request: LaunchRequest, zone: str, image: str, root_device: str
    ) -> dict[str, Any]:
        params: dict[str, Any] = {
            "ImageId": image,
            "InstanceType": request.instance_type,
            "MinCount": 1,
            "MaxCount": 1,
            "ClientToken": request.token,
            "Placement": {"AvailabilityZone": zone},
            "TagSpecifications": _tag_specs(request),
            "BlockDeviceMappings": [
                {
                    "DeviceName": root_device,
                    "Ebs": {
                        "VolumeSize": request.disk_gb,
                        "VolumeType": "gp3",
                        "DeleteOnTermination": True,
                    },
                }
            ],
        }
        # the key for our one SSH user, made by cloud-init, not the image's (ubuntu, ec2-user…)
        # gzip-compressed cloud-init (providers/aws LIMITS: 16 KB before base64)
        key = request.ssh_public_key
        if user_data := startup_payload(LIMITS, request.user_data, key, self.ssh_user):
            params["UserData"] = user_data  # botocore base64-encodes the bytes
        subnet = self._subnet(request.region, zone)
        if subnet:
            params["SubnetId"] = subnet
        params["SecurityGroupIds"] = list(
            self.options.security_group_ids or [self._network.group(request.region, subnet)]
        )
        # IMDSv2 only, one hop: the instance's credentials are not readable by a container or
        # by a plain GET from anything on the machine (clouds.md, AWS networking).
        params["MetadataOptions"] = {
            "HttpTokens": "required",
            "HttpPutResponseHopLimit": 1,
            "HttpEndpoint": "enabled",
        }
        if self.options.key_name:
            params["KeyName"] = self.options.key_name
        if profile := self.options.iam_instance_profile:
            params["IamInstanceProfile"] = (
                {"Arn": profile} if str(profile).startswith("arn:") else {"Name": profile}
            )
        # What `shutdown -h now` inside the machine does (its own guard stops it so): an
        # on-demand instance stops, compute billing ends; a one-time spot instance cannot be
        # stopped, so it terminates (SPEC.guest_shutdown). EC2 User Guide, "Change instance
        # initiated shutdown behavior": "By default, when you initiate a shutdown from an Amazon
        # EBS backed instance (using a command such as shutdown or poweroff), the instance
        # stops" — said here, not left to the default.
        params["InstanceInitiatedShutdownBehavior"] = "terminate" if request.spot else "stop"
        if request.spot:
            # One-time + terminate, as SkyPilot and dstack launch spot. A persistent request
            # (the only kind that may stop on interruption) relaunches its instance after every
            # interruption *or terminate* until it is cancelled, and restarts a stopped one when
            # capacity returns: spend that survives `down`. So an AWS spot machine is never
            # stopped (SPEC.capabilities.stop_spot is False) and `preemption_action` has nothing
            # to map to here; a preempted one is gone, and recovery launches a new one.
            spot: dict[str, Any] = {
                "SpotInstanceType": "one-time",
                "InstanceInterruptionBehavior": "terminate",
            }
            if request.max_price is not None:
                spot["MaxPrice"] = str(request.max_price)
            params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": spot}
        return params

    def _find_by_token(self, ec2: Any, request: LaunchRequest, zone: str) -> dict[str, Any] | None:
        response = ec2.describe_instances(
            Filters=[{"Name": f"tag:{TAG_TOKEN}", "Values": [request.token]}]
        )
        for raw in instances_of(response):
            where = raw.get("Placement", {}).get("AvailabilityZone")
            if raw["InstanceType"] != request.instance_type or where != zone:
                raise InvalidRequest(
                    f"aws: token {request.token} already launched {raw['InstanceId']} "
                    f"({raw['InstanceType']} in {where}) for different parameters",
                    code="IdempotentParameterMismatch",
                )
            return raw
        return None


_loader_lock = threading.Lock()
_loader: Any = None


def _shared_loader() -> Any:
    """botocore parses its JSON service models once per session (~0.2 s for EC2): every
    provider instance in the process shares one loader."""
    global _loader
    with _loader_lock:
        if _loader is None:
            from botocore.loaders import create_loader

            _loader = create_loader()
        return _loader


def _refused(
    e: ProviderError, left: dict[str, InstanceRef], verb: str
) -> dict[InstanceRef, ProviderError | None]:
    """The ids ``left`` a refusal names (all if none) leave with its error (None: gone)."""
    named = [i for i in dict.fromkeys(_INSTANCE_ID.findall(str(e))) if i in left]
    gone = verb == "terminate" and isinstance(e, NotFound)
    return {left.pop(iid): None if gone else e for iid in named or list(left)}


def _answered(
    answer: Mapping[str, Any], left: dict[str, InstanceRef], verb: str
) -> dict[InstanceRef, ProviderError | None]:
    """For every id ``left`` (emptied): None if EC2's answer lists it, else an error."""
    key = "StoppingInstances" if verb == "stop" else "TerminatingInstances"
    answered = {i.get("InstanceId") for i in answer.get(key, [])}
    out: dict[InstanceRef, ProviderError | None] = {
        ref: None
        if iid in answered
        else ProviderError(f"aws: {verb} {iid}: not in EC2's answer", code="NoResult")
        for iid, ref in left.items()
    }
    left.clear()
    return out


def _tag_specs(request: LaunchRequest) -> list[dict[str, Any]]:
    """RunInstances' tags for each piece AWS bills apart: the instance (with the launch's
    token), its root volume, its network interface (where a public IPv4 address is billed);
    "Instances, Volumes, Spot Instance requests, Network interfaces" (RunInstances'
    TagSpecifications, botocore's ec2 model)."""
    tags = {**request.labels, "Name": request.name}
    return [
        {"ResourceType": "instance", "Tags": tag_list({**tags, TAG_TOKEN: request.token})},
        {"ResourceType": "volume", "Tags": tag_list(tags)},
        {"ResourceType": "network-interface", "Tags": tag_list(tags)},
    ]
