"""SberCloud (cloud.ru Advanced), Huawei-ECS-compatible (huaweicloudsdkecs, imported lazily by
:mod:`providers.sbercloud.adapter`). Volumes are EVS disks (huaweicloudsdkevs, ``volume_type``),
attached by ECS: :mod:`providers.sbercloud.volumes` gives Huawei's rules and the sources."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from providers.limits import Limits
from providers.spec import (
    STOPS,
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

# where credentials and the project come from (the SberCloud name first, then the Huawei SDK's)
ENV_AK = ("SBERCLOUD_ACCESS_KEY", "HUAWEICLOUD_SDK_AK")
ENV_SK = ("SBERCLOUD_SECRET_KEY", "HUAWEICLOUD_SDK_SK")
ENV_PROJECT = ("SBERCLOUD_PROJECT_ID", "HUAWEICLOUD_SDK_PROJECT_ID")


def env(names: Sequence[str]) -> str | None:
    """The first of ``names`` set in the environment (the adapter's and the bill's keys)."""
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


class SberCloudOptions(Options):
    # The ECS endpoint is regional: one region per settings.
    regions: Names = Field(("ru-moscow-1",), min_length=1, max_length=1)
    zones: Names | None = None  # default <region>a, b, c
    endpoint: Url | None = None  # ECS; default https://ecs.<region>.hc.sbercloud.ru
    iam_endpoint: Url | None = None  # default https://iam.<region>.hc.sbercloud.ru/v3
    project_id: Name | None = None  # default $SBERCLOUD_PROJECT_ID, else looked up in IAM
    vpc_id: Name | None = None  # required to launch
    subnet_id: Name | None = None  # required to launch
    vpc_endpoint: Name | None = (
        None  # security groups; default https://vpc.<region>.hc.sbercloud.ru
    )
    # The security group servers join. Unset: our own, provisioner-ssh (tagged managed-by, found
    # again or created once), admitting 22/tcp from `ssh_cidrs` only, as AWS's SSH group does.
    security_group_id: Name | None = None
    evs_endpoint: Url | None = None  # volumes; default https://evs.<region>.hc.sbercloud.ru
    # `provisioner bill`: the BSS (billing) endpoint, a global service; no default is documented
    bss_endpoint: Url | None = None
    domain_id: Name | None = None  # the account's; default $SBERCLOUD_DOMAIN_ID, else from IAM
    volume_type: Name = "SSD"  # EVS type of volumes: SSD (ultra-high I/O), GPSSD, ESSD, SAS…
    ssh_cidrs: Names = ("0.0.0.0/0",)  # who may reach port 22, as SkyPilot's and dstack's default
    # A public address is an EIP made with the server and released with it
    # (publicip.delete_on_termination), so nothing of it bills after `down`.
    public_ip: bool = True
    bandwidth_mbit: int = Field(100, ge=1)  # the EIP's own (PER) bandwidth; the API takes 1..2000
    # "traffic": pay per GB sent out, the bandwidth a cap; "bandwidth": pay for the size by the hour
    bandwidth_charge: Literal["traffic", "bandwidth"] = "traffic"
    eip_type: Name = "5_bgp"  # dynamic BGP, the type cloud.ru Advanced sells
    image: Name | None = None  # no public GPU image is known: required to launch
    root_volume_type: Name = "SSD"
    page_size: int = Field(100, ge=1, le=1000)
    poll_seconds: Wait = 3
    operation_timeout_seconds: Seconds = 900  # an ECS job


# What one CreateServers may carry (docs/LIMITS.md has the same table).
LIMITS = Limits(
    startup_field="server.user_data",
    startup_max=32 * 1024,
    startup_counts="bytes before base64",
    envelope="gzip",  # "支持注入文本、文本文件或gzip文件" (text, a text file or a gzip file)
    startup_source='huaweicloudsdkecs PrePaidServer.user_data: "注入内容（编码之前的内容）最大长度'
    '32KB" (at most 32 KB before base64)',
    max_tags=10,
    tag_key_max=36,
    tag_value_max=43,
    tag_rule="no control characters nor = * < > \\ , | /",
    tags_source="huaweicloudsdkecs PrePaidServerTag; Huawei ECS API reference, ServerTags "
    "(providers/sbercloud/tags.py folds labels into them)",
    name_max=64,
    name_rule="letters, digits, _ - . (and Chinese characters), 1-64",
    name_source="huaweicloudsdkecs PrePaidServer.name",
)

SPEC = CloudSpec(
    name="sbercloud",
    title="SberCloud (cloud.ru Advanced)",
    currency="RUB",
    options=SberCloudOptions,
    adapter="providers.sbercloud.adapter:SberCloudProvider",
    ssh_user="provisioner",  # made by cloud-init on every cloud: one SSH user everywhere
    extra="sbercloud",
    sdk=("huaweicloudsdkecs", "huaweicloudsdkvpc", "huaweicloudsdkevs", "huaweicloudsdkbss"),
    # Spot servers can be stopped; extendparam takes a spot_price cap; BatchStopServers,
    # BatchStartServers and DeleteServers take many servers.
    capabilities=Capabilities(
        stop_spot=True,
        cap_spot_price=True,
        zones=True,
        batch=True,
        console_stop_of_spot=False,
        restart_preempted=False,
        why={
            "console_stop_of_spot": "sbercloud: Huawei ECS records no reason for a stop, so a "
            "spot server stopped in the console cannot be told from a preempted one",
            "restart_preempted": "sbercloud: Huawei ECS releases a spot server it takes back "
            '("If inventory resources are insufficient or the market price exceeds your expected '
            "price, your ECS resources will be automatically released and the spot instance will "
            'be reclaimed", support.huaweicloud.com/eu/price-ecs/ecs_billing_2004.html), and the '
            'disks bought with it go too ("the data disk and EIP will be released when the ECS is '
            'released", support.huaweicloud.com/intl/en-us/price-cce/cce_03_0026.html)',
        },
    ),
    prices_from="its GPU flavors (ECS ListFlavors), unpriced; needs SberCloud AK/SK",
    catalog_rows="providers.sbercloud.flavors:catalog_rows",
    billing="providers.sbercloud.billing:fetch",
    guest_shutdown=GuestShutdown(
        on_demand=STOPS,
        spot=STOPS,
        source='Huawei Cloud ECS, "How Can I Stop an ECS from Being Billed?" (support.huaweicloud'
        '.com/intl/en-us/price-ecs/ecs_billing_11106.html): "After a pay-per-use or spot ECS is '
        "stopped (excluding bare metal ECSs or ECSs with local disks or FPGAs attached), its "
        'basic resources (vCPUs, memory, image, and GPUs) will no longer be billed"; a shutdown '
        'inside the OS leaves the ECS Stopped (API status SHUTOFF, ECS user guide "Starting or '
        'Stopping an ECS")',
        # "pay-per-use or spot ECSs with local disks attached (such as disk-intensive, ultra-high
        # I/O, H2, P1, and P2 ECSs), pay-per-use or spot FPGA-based ECSs (such as Fp1 and Fp1c
        # ECSs) … will continue to be billed after they are stopped" (the same page)
        billed_flavors=r"(d\d|i\d|ir\d|h2|p1|p2|fp1c?)\.",
        flavors_why="Huawei ECS bills flavors with local disks or FPGAs (disk-intensive d*, "
        "ultra-high I/O i*, H2, P1, P2, Fp1) while they are stopped: delete them to stop it",
    ),
    limits=LIMITS,
)
