"""Yandex Cloud Compute over the ``yandexcloud`` SDK (gRPC). Importing this package imports
neither ``yandexcloud`` nor ``grpc``: the adapter does so inside its methods.

Instance types are ``<platform_id>/<gpus>g-<vcpus>c-<ramGB>gb``, e.g.
``gpu-standard-v3/8g-224c-952gb`` (8×A100 80 GB) or ``standard-v3-t4/1g-8c-32gb`` (1×T4); the
allowed shapes per platform are in :mod:`providers.yandex.prices`.

Options (settings, nothing secret): :class:`YandexOptions`.

Credentials, first found: YC_IAM_TOKEN, YC_SERVICE_ACCOUNT_KEY_FILE (authorized key JSON),
YC_TOKEN (OAuth, deprecated by Yandex), or the VM metadata service when ``use_metadata_service``
is true (never probed otherwise, so ``check()`` answers at once when nothing is set).

Launch is idempotent through the ``idempotency-key`` gRPC metadata, a UUIDv5 of the request
token; stop/start/delete send one random key reused across their own retries. Labels are folded
to Yandex's rules (lowercase ``[a-z0-9_-]``, ≤ 63). User data goes in as cloud-init with our
``provisioner`` user and the SSH key; the key is also in ``ssh-keys``.

Volumes are Compute network disks (``disk_type``), attached with the disk id as device name:
:mod:`providers.yandex.volumes` gives Yandex's rules and the sources.

Errors (gRPC status of a call, or ``Operation.error``; code kept in ``.code``). The code decides,
refined only by texts Yandex is documented or seen to send (the capacity text wins over any code
but the auth ones, since its code is not documented):
  * "Not enough resources" (any code) → CapacityError, try another zone. Yandex's Compute
    troubleshooting ("Not enough resources" error: the zone lacks hardware for the VM; checked
    again when a preemptible VM starts) and preemptible-VM docs give this text but not its gRPC
    code; the API error table lists INTERNAL as possibly "insufficient computing resources".
    [yandex-cloud/docs en/compute/qa/not-enough-resources.md,
    en/troubleshooting/compute/known-issues/not-enough-resources.md,
    en/compute/concepts/preemptible-vm.md, en/_includes/errors-handling.md]
  * RESOURCE_EXHAUSTED, documented as "The request limit exceeded" (errors-handling.md):
    "The limit on maximum number of active operations has exceeded." → Throttled: the
    concurrent-operations quota of a folder (15, en/_includes/compute-limits.md) clears as
    operations finish [log in yc-actions/yc-github-runner#700]. "The limit on maximum number of
    <GPU devices|cores|…> has exceeded." → QuotaError(scope="region": quotas are per cloud, and
    the cloud has one region); it comes at once in the answer to Create [cores: seen live by
    AlexeySetevoi/yandex-fleeting-plugin's README; GPU devices, for compute.instanceGpus.count:
    a third-party note]. Any other RESOURCE_EXHAUSTED → Throttled, as documented: retried
    ``retry_attempts`` times, then the launch of that candidate fails with Yandex's text (no
    zone or region is written off for it).
  * A ``QuotaFailure`` in the status details (``google.rpc`` or the public
    ``yandex.cloud.quota.QuotaFailure``) → QuotaError, whatever the code. Whether Compute sends
    one is not confirmed.
  * UNAUTHENTICATED / PERMISSION_DENIED, and UNAVAILABLE "Getting metadata from plugin failed"
    (no IAM token could be had) → AuthError. UNAVAILABLE / DEADLINE_EXCEEDED / INTERNAL /
    ABORTED → Throttled (retried, bounded). NOT_FOUND → NotFound. The rest (INVALID_ARGUMENT,
    FAILED_PRECONDITION — e.g. 'platform "standard-v1" is unavailable in zone
    "ru-central1-d"', seen live by the same README —, ALREADY_EXISTS…) → InvalidRequest.
  Not found anywhere: the gRPC code of "Not enough resources", whether it fails Create or its
  operation, and whether the API adds words around it (the docs quote only those words); the
  quota texts for the A100, T4 and Gen2 GPU quotas (compute.instanceA100Gpus.count, …), taken
  to follow the same "The limit on …" pattern.

States: PROVISIONING / STARTING / RESTARTING / UPDATING → pending; RUNNING; STOPPING; DELETING
or gone → terminated / NotFound; ERROR / CRASHED → stopped (reason kept). Yandex stops a
preemptible VM (after 24 h, or when capacity is short) and gives no reason field, so a STOPPED
preemptible VM is judged by its own operation history (InstanceService.ListOperations): the
latest power operation being PreemptInstance, or a create/start with no stop after it, reads
as PREEMPTED; a Stop / GuestStop (by us, the console or the guest) reads as STOPPED. Nothing
is written on the machine for this, so a stop from any tool is seen correctly.
"""

from __future__ import annotations

from pydantic import Field

from providers.limits import Limits
from providers.spec import (
    STOPS,
    Capabilities,
    CloudSpec,
    File,
    GuestShutdown,
    Name,
    Names,
    Options,
    Seconds,
    Wait,
)


class YandexOptions(Options):
    folder_id: Name | None = None  # default: $YC_FOLDER_ID
    zones: Names | None = None  # where to price and launch; default every zone a platform has
    subnet_ids: dict[Name, Name] = Field(default_factory=dict)  # {zone: id}
    network_id: Name | None = None  # else the folder's one subnet in the zone
    # An image id (20 characters) as it is, anything else a family in `image_folder_id`;
    # the experiment's `image` wins. None: the GPU image Yandex documents for the platform.
    image: Name | None = None
    image_folder_id: Name = "standard-images"
    disk_type: Name = "network-ssd"  # boot disks and volumes: network-ssd, network-hdd, …
    # Who may reach port 22. As it is by default (anywhere, as SkyPilot's and dstack's), a
    # machine joins no group of its own: the network's default security group, which Yandex
    # creates admitting 22/tcp from 0.0.0.0/0, applies. Anything else: our group
    # provisioner-ssh-<network> (22/tcp from these, all egress), created once, labelled ours.
    ssh_cidrs: Names = ("0.0.0.0/0",)
    endpoint: Name = "api.cloud.yandex.net:443"
    root_certificates_file: File | None = None  # PEM, for a private endpoint
    billing_account_id: Name | None = None  # `provisioner bill`: the account to report on
    use_metadata_service: bool = False
    timeout_seconds: Seconds = 30  # one call
    poll_seconds: Wait = 2
    operation_timeout_seconds: Seconds = 1800


# What one InstanceService.Create may carry (docs/LIMITS.md has the same table).
LIMITS = Limits(
    startup_field="metadata user-data",
    startup_max=256 * 1024,
    startup_counts="bytes (one metadata value)",
    envelope="cloud-init",  # a metadata value is a string: no gzip
    startup_source='yandex.cloud.compute.v1 CreateInstanceRequest.metadata: "The total size of '
    'all keys and values must be less than 512 KB. ... The values must be 256 KB or less."',
    metadata_total_max=512 * 1024,
    max_tags=64,
    tag_key_max=63,
    tag_value_max=63,
    tag_rule="keys [a-z][-_./\\\\@0-9a-z]*, values [-_./\\\\@0-9a-z]*",
    tags_source="yandex.cloud.compute.v1 CreateInstanceRequest.labels",
    name_max=63,
    name_rule="|[a-z]([-_a-z0-9]{0,61}[a-z0-9])?",
    name_source="yandex.cloud.compute.v1 CreateInstanceRequest.name",
)

SPEC = CloudSpec(
    name="yandex",
    title="Yandex Cloud",
    currency="RUB",
    options=YandexOptions,
    adapter="providers.yandex.adapter:YandexProvider",
    ssh_user="provisioner",
    extra="yandex",
    sdk=("yandexcloud",),
    # Preemptible VMs are stopped, never deleted, and can be started again.
    # restart_preempted: "The instance isn't deleted after it's stopped and all its data is saved.
    # When you need the instance again, start it again." (en/compute/concepts/preemptible-vm.md)
    capabilities=Capabilities(
        stop_spot=True,
        cap_spot_price=False,
        zones=True,
        batch=False,
        delete_on_preemption=False,
        why={
            "cap_spot_price": "yandex: preemptible VMs have a fixed price, with no cap to set",
            "batch": "yandex: every InstanceService call names one instance",
            "delete_on_preemption": "yandex: a preemptible VM is always stopped when taken "
            "back, never deleted (en/compute/concepts/preemptible-vm.md)",
        },
    ),
    prices_from="the billing API (SkuService.List); needs Yandex Cloud credentials",
    catalog_rows="providers.yandex.prices:catalog_rows",
    billing="providers.yandex.billing:fetch",
    guest_shutdown=GuestShutdown(
        on_demand=STOPS,
        spot=STOPS,  # a preemptible VM is stopped, not deleted, when it powers off
        source='Yandex Cloud docs, Compute Cloud "Pricing policy": computing resources (vCPU, '
        "RAM, GPU) are charged while the VM runs; a STOPPED VM is charged for its disks and a "
        'static public IP only. "VM statuses": a VM powered off becomes STOPPED. That a power-'
        "off from inside the OS leads there is what the KVM guest's ACPI power-off does; the "
        "pages found do not say it in as many words (not checked on a real account)",
    ),
    limits=LIMITS,
)
