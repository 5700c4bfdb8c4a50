"""Azure Virtual Machines (azure-mgmt-compute/network, imported lazily by
:mod:`providers.azure.adapter`)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from providers.limits import Limits
from providers.spec import (
    KEEPS_BILLING,
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


class AzureOptions(Options):
    subscription_id: Name | None = None  # default: $AZURE_SUBSCRIPTION_ID
    resource_group: Name = "provisioner"  # must exist
    regions: Names = ("eastus", "eastus2", "westus2", "westus3", "southcentralus", "centralus")
    # One subnet id, or {region: id}; else `vnet`/`subnet` names in the resource group, with
    # {region} filled in.
    subnet_id: Name | dict[Name, Name] | None = None
    vnet: Name = "provisioner-{region}"
    subnet: Name = "default"
    image: Name = "microsoft-dsvm:ubuntu-hpc:2204:latest"  # publisher:offer:sku:version or an id
    admin_username: Name = "provisioner"  # the login user: the same name on every cloud
    # Who may reach port 22: the inbound rule of our NSG (provisioner-ssh-<region> in the resource
    # group), created once per region, tagged as ours. SkyPilot's and dstack's default.
    ssh_cidrs: Names = ("0.0.0.0/0",)
    os_disk_type: Name = "Premium_LRS"
    endpoint: Url | None = None  # the ARM root (a sovereign cloud, an emulator)
    pricing_endpoint: Url = "https://prices.azure.com"  # the Retail Prices API
    managed_identity: bool = False  # true on an Azure VM whose identity should be used
    # azure-identity's own switch: true when AZURE_AUTHORITY_HOST names a private Microsoft
    # Entra authority (Azure Stack Hub…) that login.microsoftonline.com's instance discovery
    # does not know. The national clouds' authorities are known: they need nothing.
    disable_instance_discovery: bool = False
    poll_seconds: Wait | None = None  # between polls when ARM sends no Retry-After (SDK: 30)
    timeout_seconds: Seconds = 30  # `check`'s probe and one price page


# What one VirtualMachines.CreateOrUpdate may carry (docs/LIMITS.md has the same table).
LIMITS = Limits(
    startup_field="osProfile.customData",
    startup_max=65_535,
    startup_counts="bytes of the decoded binary array",
    envelope="gzip",
    startup_source='Compute REST API, OSProfile.customData: "The base-64 encoded string is '
    'decoded to a binary array ... The maximum length of the binary array is 65535 bytes"; ARM '
    'answers InvalidParameter "Custom data in OSProfile must be in Base64 encoding and with a '
    'maximum length of 87380 characters."',
    key_in_startup=False,  # the key is osProfile.linuxConfiguration.ssh.publicKeys
    max_tags=50,
    tag_key_max=512,
    tag_value_max=256,
    tag_rule="a tag name may not contain < > % & \\ ? /",
    tags_source='Azure Resource Manager, "Use tags to organize your Azure resources", '
    '"Limitations"',
    name_max=64,
    name_rule="Linux computer name and VM name: 1-64 characters",
    name_source='"Naming rules and restrictions for Azure resources", Microsoft.Compute '
    "virtualMachines",
)

_TAG_NAME_FORBIDDEN = re.compile(r"[<>%&\\?/]")
_TAG_NAME_RESERVED = ("microsoft", "azure", "windows")


def arm_tags(labels: Mapping[str, str]) -> dict[str, str]:
    """Our labels as ARM tags: a tag name may not contain ``< > % & \\ ? /`` nor begin with
    microsoft, azure or windows (Azure Resource Manager, "Use tags to organize your Azure
    resources", "Limitations"; SDK Set-AzTag: "Tag names created by Azure have prefixes of
    microsoft, azure, or windows. You cannot create tags with one of these prefixes"). Such a
    character becomes ``_``; such a prefix gets ``x-`` before it. Names ≤ 512 and values ≤ 256
    hold already (the experiment file allows keys ≤ 128, values ≤ 256)."""
    out = {}
    for key, value in labels.items():
        name = _TAG_NAME_FORBIDDEN.sub("_", key)
        if name.lower().startswith(_TAG_NAME_RESERVED):
            name = "x-" + name
        out[name] = value
    return out


SPEC = CloudSpec(
    name="azure",
    title="Azure",
    currency="USD",
    options=AzureOptions,
    adapter="providers.azure.adapter:AzureProvider",
    ssh_user="provisioner",
    extra="azure",
    sdk=("azure.mgmt.compute", "azure.mgmt.network", "azure.identity"),
    # Spot VMs with evictionPolicy Deallocate can be deallocated and started; billingProfile
    # takes a maxPrice.
    # restart_preempted: a Spot VM with evictionPolicy Deallocate is "deallocated/stopped" when
    # evicted (learn.microsoft.com, EvictionPolicy.Deallocate), its disks kept; starting it can
    # fail "with an allocation failure" (MicrosoftDocs/SupportArticles-docs,
    # virtual-machines/windows/restart-resize-error-troubleshooting.md).
    capabilities=Capabilities(
        stop_spot=True,
        cap_spot_price=True,
        zones=False,
        batch=False,
        why={
            "zones": "azure: prices are per region (the Retail Prices API's armRegionName); a "
            "zone is placement only",
            "batch": "azure: every virtualMachines call names one VM",
        },
    ),
    prices_from="the Retail Prices API; public, no credentials",
    catalog_rows="providers.azure.prices:catalog_rows",
    billing="providers.azure.billing:fetch",
    guest_shutdown=GuestShutdown(
        on_demand=KEEPS_BILLING,
        spot=KEEPS_BILLING,
        source='Microsoft Learn, "States and billing status of Azure Virtual Machines": '
        '"Stopped: the VM is stopped. Virtual machines in the stopped state still incur '
        'compute charges"; only "Deallocated" ends them. A shutdown from inside the OS leaves '
        "the VM Stopped, still allocated and billed: the scheduler (provisioner sweep, or "
        "scheduler run) must deallocate it through the API (virtualMachines/deallocate: "
        '"You are not billed for the compute resources that this virtual machine uses")',
    ),
    limits=LIMITS,
)
