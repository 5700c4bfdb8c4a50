"""Whether a deallocated Spot VM was evicted, from the subscription's Activity Log (read through
the compute client's own pipeline, so no monitor SDK is needed)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from providers.base import ProviderError, paginate

if TYPE_CHECKING:
    from providers.azure.adapter import AzureProvider

ACTIVITY_API_VERSION = "2015-04-01"


def evicted(cloud: AzureProvider, vm: Any) -> tuple[bool, str | None, datetime | None]:
    """Was this deallocated Spot VM evicted (rather than stopped by someone)? With why, and
    when: the deciding event's ``eventTimestamp`` (when ARM evicted or deallocated it).

    The instance view of an evicted VM reads exactly like a user's deallocate
    (``PowerState/deallocated``). The record that tells them apart is the Activity Log: ARM
    writes ``Microsoft.Compute/virtualMachines/evictSpotVM/action`` (caller "Azure") when it
    evicts, and ``…/deallocate/action`` or ``…/powerOff/action`` for a stop. The newer of the
    two decides. The log is read through the compute client's own pipeline (credential,
    endpoint), so no monitor SDK is needed. Limits: the log lags by minutes (a VM evicted just
    now reads STOPPED until it catches up) and keeps 90 days. If it cannot be read the VM stays
    STOPPED and the reason says why.
    """
    compute, _ = cloud._clients()
    now = cloud.clock()
    since = max(vm.time_created or now, now - timedelta(days=89)) - timedelta(minutes=5)
    query = f"eventTimestamp ge '{since:%Y-%m-%dT%H:%M:%SZ}' and resourceUri eq '{vm.id}'"
    first = (
        f"/subscriptions/{cloud._subscription_id()}/providers/Microsoft.Insights/eventtypes/"
        f"management/values?api-version={ACTIVITY_API_VERSION}&$filter={quote(query)}"
        "&$select=eventTimestamp,operationName,status"
    )

    def page(url: str | None) -> tuple[list[dict], str | None]:
        got = cloud.call(partial(_get_json, compute, url or first))
        return got.get("value", []), got.get("nextLink")

    latest: dict[str, datetime] = {}
    try:
        for event in paginate(page, first):
            if kind := _kind(event):
                at = _parse_time(event["eventTimestamp"])
                latest[kind] = max(latest.get(kind, at), at)
    except ProviderError as err:
        return False, f"activity log unreadable ({err.code or err})", None
    if "evict" in latest and latest["evict"] > latest.get("stop", datetime.min.replace(tzinfo=UTC)):
        return True, "Microsoft.Compute/virtualMachines/evictSpotVM/action", latest["evict"]
    return False, None, latest.get("stop")


def _kind(event: dict) -> str | None:
    """An Activity Log event as "evict" (evictSpotVM) or "stop" (deallocate, powerOff); None
    for any other operation, or one that failed."""
    operation = (event.get("operationName") or {}).get("value", "").lower()
    if (event.get("status") or {}).get("value", "") == "Failed":
        return None
    if operation.endswith("/evictspotvm/action"):
        return "evict"
    if operation.endswith(("/deallocate/action", "/poweroff/action")):
        return "stop"
    return None


def _get_json(compute: Any, url: str) -> dict:
    from azure.core.rest import HttpRequest

    response = compute.send_request(HttpRequest("GET", url))
    response.raise_for_status()
    return response.json()


def _parse_time(text: str) -> datetime:
    """ARM timestamps carry up to 7 fractional digits; Python takes 6."""
    text = re.sub(r"(\.\d{6})\d+", r"\1", text.replace("Z", "+00:00"))
    parsed = datetime.fromisoformat(text)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
