"""The batch forms on Huawei ECS: each server marked as stopped by us (the marker is what
tells our stops from preemptions), then one job per 1,000 servers; a server the API names in a
refusal is answered with that error and the call made again without it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from providers.base import InstanceRef, NotFound, ProviderError, Throttled
from providers.sbercloud import errors

if TYPE_CHECKING:
    from providers.sbercloud.adapter import SberCloudProvider

# BatchStopServers: "A maximum of 1,000 ECSs can be stopped" a call; DeleteServers: "A maximum
# of 1,000 ECSs can be deleted in a batch" (Huawei Cloud ECS API Reference, ecs_02_0303 and
# ecs_02_0103, support.huaweicloud.com/intl/en-us/api-ecs/). The SDK's models state no limit.
BATCH_SERVERS = 1000


def run(
    cloud: SberCloudProvider,
    refs: Sequence[InstanceRef],
    verb: str,
    call: Callable[[Any, list[str]], Any],
) -> dict[InstanceRef, ProviderError | None]:
    """``call(client, ids)`` (BatchStopServers or DeleteServers) on every ref, per ref its
    outcome as :meth:`providers.base.Provider.stop_many` gives it; ``verb`` names the call."""
    out: dict[InstanceRef, ProviderError | None] = {}
    marked: dict[str, InstanceRef] = {}
    for ref in dict.fromkeys(refs):
        try:
            if cloud._mark_stopped(ref.id):
                marked[ref.id] = ref
            else:  # gone: a delete has nothing left to do, a stop has nothing to stop
                out[ref] = None if verb == "delete" else _gone(ref)
        except ProviderError as e:
            out[ref] = e
    ids = list(marked)
    for k in range(0, len(ids), BATCH_SERVERS):
        for iid, err in _batch_job(cloud, verb, call, ids[k : k + BATCH_SERVERS]).items():
            gone = verb == "delete" and isinstance(err, NotFound)
            out[marked[iid]] = None if gone else err
    return {ref: out[ref] for ref in dict.fromkeys(refs)}


def _gone(ref: InstanceRef) -> NotFound:
    return NotFound(f"sbercloud: server {ref.id} could not be found", code="Ecs.0114")


def _batch_job(
    cloud: SberCloudProvider, verb: str, call: Callable[[Any, list[str]], Any], ids: list[str]
) -> dict[str, ProviderError | None]:
    """One job for ``ids``. A server the API names in a refusal (``Instance[id] could not
    be found``) gets that error and the call is made again without it; a failed job's
    sub-jobs say which servers failed."""
    out: dict[str, ProviderError | None] = {}
    left = list(ids)
    while left:
        where = f"{verb} {len(left)} servers" if len(left) > 1 else f"{verb} server {left[0]}"
        try:
            job = cloud._call(where, partial(_with_ids, call, list(left)))
        except ProviderError as e:
            named = [i for i in left if i in str(e)]
            for iid in named or list(left):
                out[iid] = e
            left = [i for i in left if i not in out]
            continue
        out.update(_job_outcome(cloud, job.job_id, where, left))
        break
    return out


def _job_outcome(
    cloud: SberCloudProvider, job_id: str, where: str, ids: list[str]
) -> dict[str, ProviderError | None]:
    try:
        if cloud._wait(job_id, where, cloud.options.operation_timeout_seconds):
            return dict.fromkeys(ids)
        err: ProviderError = Throttled(
            f"sbercloud: {where}: job {job_id} still running", code="JobTimeout"
        )
    except ProviderError as e:
        err = e
        failed = _failed_sub_jobs(cloud, job_id, where)
        if failed:
            return {i: failed.get(i) for i in ids}
    return dict.fromkeys(ids, err)


def _failed_sub_jobs(cloud: SberCloudProvider, job_id: str, where: str) -> dict[str, ProviderError]:
    from huaweicloudsdkecs.v2 import model as m

    try:
        job = cloud._call(where, lambda c: c.show_job(m.ShowJobRequest(job_id=job_id)))
    except ProviderError:
        return {}
    out = {}
    for sub in (job.entities.sub_jobs if job.entities else None) or []:
        sid = (sub.entities.server_id if sub.entities else None) or ""
        if sub.status == "FAIL" and sid:
            reason = sub.fail_reason or "no reason given"
            out[sid] = errors.by_code(None, sub.error_code, reason, where=where)
    return out


def _with_ids(call: Callable[[Any, list[str]], Any], ids: list[str], client: Any) -> Any:
    return call(client, ids)
