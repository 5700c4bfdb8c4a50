"""Google Cloud Compute Engine (google-cloud-compute over REST, imported lazily by
:mod:`providers.gcp.adapter`)."""

from __future__ import annotations

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
)

# Google's Deep Learning VM image families (cloud.google.com/deep-learning-vm/docs/images, "Choose
# an image"): the base CUDA 12.8 family on Ubuntu 22.04 with the NVIDIA 570 driver. Families are
# supported about two years and a deprecated one stops resolving: `check` and every launch resolve
# it (images.getFromFamily) and say so. Was common-cu124-debian-11 (Debian 11, LTS ended 2026-08).
DEFAULT_IMAGE = (
    "projects/deeplearning-platform-release/global/images/family/"
    "common-cu128-ubuntu-2204-nvidia-570"
)


class GCPOptions(Options):
    project: Name | None = None  # default: the project of the application-default credentials
    # Where machines are planned, launched and listed: `zones`, else every zone of `regions`.
    regions: Names = ("us-central1", "us-east4", "europe-west4")
    zones: Names | None = None
    network: Name = "global/networks/default"
    subnetwork: Name | None = None
    external_ip: bool = True
    # Who may reach port 22, as SkyPilot's and dstack's default: our firewall rule on `network`
    # (provisioner-allow-ssh-<network>, created once) admits them to machines tagged
    # provisioner-ssh. The `default` network and its default-allow-ssh rule may not exist.
    ssh_cidrs: Names = ("0.0.0.0/0",)
    image: Name = DEFAULT_IMAGE
    endpoint: Url | None = None  # the Compute API root (a private endpoint, an emulator)
    pricing_endpoint: Url | None = None  # the Cloud Billing Catalog API root
    # `provisioner bill`: the Cloud Billing standard usage cost export table
    # (PROJECT.DATASET.gcp_billing_export_v1_BILLING_ACCOUNT_ID) and the BigQuery API root
    billing_table: Name | None = None
    bigquery_endpoint: Url | None = None
    anonymous: bool = False  # no credentials at all: only for a local emulator
    operation_timeout_seconds: Seconds = 900


# What one instances.insert may carry (docs/LIMITS.md has the same table).
LIMITS = Limits(
    startup_field="metadata startup-script",
    startup_max=262_144,
    startup_counts="bytes (one metadata value)",
    envelope="script",  # run by the guest environment, not by cloud-init: plain text
    startup_source='compute_v1 Items.value: "their size must be less than or equal to 262144 '
    'bytes (256 KiB)"; Metadata.items: "The total size of all keys and values must be less '
    'than 512 KB"',
    metadata_total_max=512 * 1024,
    key_in_startup=False,  # the key is the ssh-keys metadata value
    max_tags=64,
    tag_key_max=63,
    tag_value_max=63,
    tag_rule="lowercase letters, digits, _ and -; a key starts with a letter",
    tags_source='Resource Manager, "Requirements for labels" (as the compute labels docstrings '
    "say: keys [a-z][a-z0-9_-]{0,62}, values [a-z0-9_-]{0,63}, at most 64)",
    name_max=63,
    name_rule="RFC 1035: [a-z]([-a-z0-9]*[a-z0-9])?",
    name_source="compute_v1 Instance.name (RFC 1035, 1-63 characters)",
)

SPEC = CloudSpec(
    name="gcp",
    title="Google Cloud",
    currency="USD",
    options=GCPOptions,
    adapter="providers.gcp.adapter:GCPProvider",
    ssh_user="provisioner",
    extra="gcp",
    sdk=("google.cloud.compute_v1",),
    # Spot VMs with instanceTerminationAction=STOP stop and start again.
    # restart_preempted: a Spot VM launched with instanceTerminationAction STOP is stopped, not
    # deleted ("Compute Engine either stops (default) or deletes your Spot VMs depending on your
    # specified termination action", compute/docs/instances/spot), disks kept, and starts again
    # unless the zone lacks capacity "to create, restart, or update" (compute/docs/resource-error).
    capabilities=Capabilities(
        stop_spot=True,
        cap_spot_price=False,
        zones=True,
        batch=False,
        why={
            "cap_spot_price": "gcp: Spot VMs take no maximum price; they are billed at the "
            "current Spot price (compute/docs/instances/spot)",
            "batch": "gcp: every Compute Engine instances call names one instance",
        },
    ),
    prices_from="the Cloud Billing Catalog API; needs an API key in PROVISIONER_GCP_API_KEY",
    catalog_rows="providers.gcp.prices:catalog_rows",
    billing="providers.gcp.billing:fetch",
    guest_shutdown=GuestShutdown(
        on_demand=STOPS,
        spot=STOPS,  # instanceTerminationAction STOP: a spot VM stops like any other
        source='Compute Engine, "Stop or restart a Compute Engine instance": a compute instance '
        "stopped from the guest OS (e.g. sudo shutdown) transitions to TERMINATED like one "
        'stopped through the API; instances.stop: "Stopped instances do not incur VM usage '
        "charges while they are stopped. However, resources that the VM is using, such as "
        'persistent disks and static IP addresses, will continue to be charged"',
    ),
    limits=LIMITS,
)
