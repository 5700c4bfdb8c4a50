"""AWS EC2 (boto3, imported lazily by :mod:`providers.aws.adapter`)."""

from __future__ import annotations

import re

from pydantic import Field

from providers.limits import Limits
from providers.spec import (
    STOPS,
    TERMINATES,
    Capabilities,
    CloudSpec,
    GuestShutdown,
    Name,
    Names,
    Options,
    Seconds,
    Url,
    Wait,
)


class AWSOptions(Options):
    regions: Names = ("us-east-1", "us-west-2")  # where machines are listed and launched
    zones: Names | None = None  # AZ ids (use1-az1) to launch in; None: every zone of `regions`
    endpoint: Url | None = None  # one URL for every AWS API used (a private endpoint, moto)
    pricing_endpoint: Url | None = None  # the Price List API; default `endpoint`
    image: Name | None = None  # one AMI everywhere; default the DLAMI with NVIDIA driver
    images: dict[Name, Name] = Field(default_factory=dict)  # {region: AMI}
    subnet_id: Name | None = None
    subnet_ids: dict[Name, Name] = Field(default_factory=dict)  # {zone id or name: subnet}
    # Groups to put machines in; none: our own group in the subnet's VPC (the default VPC),
    # created once, tagged as ours, admitting SSH from `ssh_cidrs`.
    security_group_ids: Names = ()
    ssh_cidrs: Names = ("0.0.0.0/0",)  # who may reach port 22, as SkyPilot's and dstack's default
    key_name: Name | None = None
    iam_instance_profile: Name | None = None  # a name, or an ARN
    connect_timeout_seconds: Seconds = 10
    timeout_seconds: Seconds = 60  # reading one API answer
    poll_seconds: Wait = 2  # between reads while a volume or a booting instance settles

    def allows(self, region: str, zone: str) -> bool:
        """Local Zones and Wavelength Zones (``usw2-lax1-az1``) are opt-in, with their own
        prices and limits: only when named in ``zones``."""
        if not self.zones and zone and not _REGIONAL_AZ.fullmatch(zone):
            return False
        return super().allows(region, zone)


_REGIONAL_AZ = re.compile(r"[a-z]+[0-9]+-az[0-9]+")  # use1-az1; not usw2-lax1-az1


# What one RunInstances may carry (docs/LIMITS.md has the same table).
LIMITS = Limits(
    startup_field="UserData",
    startup_max=16_384,
    startup_counts="bytes before base64",
    envelope="gzip",  # boto3 base64-encodes the bytes (botocore handlers: UserData)
    startup_source='EC2 User Guide, "Work with instance user data": "User data is limited to '
    '16 KB, in raw form, before it is base64-encoded"; EC2 answers InvalidParameterValue '
    '"User data is limited to 16384 bytes"',
    max_tags=50,
    tag_key_max=128,
    tag_value_max=256,
    tag_rule="case-sensitive; no key or value may begin with aws: (reserved)",
    tags_source='EC2 User Guide, "Tag your Amazon EC2 resources", "Tag restrictions"',
    name_max=256,
    name_rule="no instance name: the Name tag, a tag value",
    name_source='EC2 User Guide, "Tag restrictions" (value ≤ 256)',
)

SPEC = CloudSpec(
    name="aws",
    title="AWS",
    currency="USD",
    options=AWSOptions,
    adapter="providers.aws.adapter:AWSProvider",
    ssh_user="provisioner",  # made by cloud-init on every cloud: one SSH user everywhere
    extra="aws",
    sdk=("boto3",),
    # EC2 takes a MaxPrice; Stop/Start/TerminateInstances take up to 1,000 ids.
    capabilities=Capabilities(
        stop_spot=False,
        cap_spot_price=True,
        zones=True,
        batch=True,
        console_stop_of_spot=False,
        restart_preempted=False,
        why={
            # Why one-time: providers/aws/adapter.py `_run_params`.
            "stop_spot": "aws: spot machines are launched as one-time Spot requests, and EC2 "
            'stops only Spot Instances of persistent requests ("You can only stop Spot '
            'Instances associated with persistent Spot Instance requests", '
            'UnsupportedOperation; EC2 User Guide, "Stop a Spot Instance" and "Behavior of '
            'Spot Instance interruptions": the request type must be persistent)',
            "console_stop_of_spot": "aws: a one-time spot instance cannot be stopped, from the "
            "console either (UnsupportedOperation)",
            "restart_preempted": "aws: an interrupted one-time Spot Instance is terminated "
            '("The default behavior is that Amazon EC2 terminates Spot Instances when they are '
            'interrupted", EC2 User Guide, "Behavior of Spot Instance interruptions") and its '
            "root volume with it (DeleteOnTermination); volumes survive",
        },
    ),
    prices_from="the Price List API (pricing:GetProducts) and EC2 spot price history; "
    "needs AWS credentials",
    catalog_rows="providers.aws.prices:catalog_rows",
    billing="providers.aws.billing:fetch",
    # A shutdown inside the OS (how the machine's own guard stops it): the adapter launches with
    # InstanceInitiatedShutdownBehavior stop (on demand) and terminate (one-time spot).
    guest_shutdown=GuestShutdown(
        on_demand=STOPS,
        spot=TERMINATES,
        source='EC2 User Guide, "Change instance initiated shutdown behavior": "By default, '
        "when you initiate a shutdown from an Amazon EBS backed instance (using a command such "
        'as shutdown or poweroff), the instance stops"; a stopped instance is not billed for '
        'compute ("Stop and start Amazon EC2 instances"). A one-time Spot Instance cannot be '
        'stopped ("You can only stop Spot Instances associated with persistent Spot Instance '
        'requests", UnsupportedOperation): launched with terminate, it is deleted, boot disk '
        "and all (DeleteOnTermination); attached volumes survive",
    ),
    limits=LIMITS,
)
