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

Error heuristics (gRPC status of a call, or ``Operation.error``; code kept in ``.code``):
  RESOURCE_EXHAUSTED is a request-rate limit unless its message says otherwise: "rate limit",
  "too many requests", "throttl" → Throttled; "quota" (e.g. "Quota limit
  compute.instanceGpus.count exceeded") → QuotaError(scope="region": Yandex quotas are per
  cloud, and the cloud has one region); "insufficient/not enough/no available resources",
  "resources are exhausted", "capacity" → CapacityError (try another zone); anything else →
  Throttled. UNAUTHENTICATED / PERMISSION_DENIED, and UNAVAILABLE "Getting metadata from plugin
  failed" (no IAM token could be had) → AuthError. UNAVAILABLE / DEADLINE_EXCEEDED / INTERNAL /
  ABORTED → Throttled (retried, bounded). NOT_FOUND → NotFound. The rest (INVALID_ARGUMENT,
  FAILED_PRECONDITION, ALREADY_EXISTS…) → InvalidRequest.

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

from providers.spec import Capabilities, CloudSpec, Name, Names, Options, Seconds, Wait


class YandexOptions(Options):
    folder_id: Name | None = None  # default: $YC_FOLDER_ID
    zones: Names | None = None  # where to price and launch; default every zone a platform has
    subnet_ids: dict[Name, Name] = Field(default_factory=dict)  # {zone: id}
    network_id: Name | None = None  # else the folder's one subnet in the zone
    # An image id (20 characters) as it is, anything else a family in `image_folder_id`;
    # the experiment's `image` wins. None: the GPU image Yandex documents for the platform.
    image: Name | None = None
    image_folder_id: Name = "standard-images"
    disk_type: Name = "network-ssd"
    endpoint: Name = "api.cloud.yandex.net:443"
    root_certificates_file: Name | None = None  # PEM, for a private endpoint
    use_metadata_service: bool = False
    timeout_seconds: Seconds = 30  # one call
    poll_seconds: Wait = 2
    operation_timeout_seconds: Seconds = 1800


SPEC = CloudSpec(
    name="yandex",
    title="Yandex Cloud",
    currency="RUB",
    options=YandexOptions,
    adapter="providers.yandex.adapter:YandexProvider",
    ssh_user="provisioner",
    extra="yandex",
    sdk=("yandexcloud",),
    # Preemptible VMs are stopped, never deleted, and can be started again; they have a fixed
    # price (no cap); every call names one instance.
    capabilities=Capabilities(stop_spot=True, cap_spot_price=False, zones=True, batch=False),
)
