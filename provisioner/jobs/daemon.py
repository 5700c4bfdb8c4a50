"""``provisioner scheduler run``: every job on its interval, and the heartbeat and metrics
endpoint, until SIGTERM or Ctrl-C."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from provisioner import outages
from provisioner.app import App
from provisioner.endpoint import Endpoint, WSGIApp
from provisioner.errors import UserError, database_failure
from provisioner.jobs import cycle, reload
from provisioner.jobs.lease import HOLDER
from provisioner.jobs.metrics import Metrics
from provisioner.jobs.passes import Pass, describe

log = logging.getLogger("provisioner.scheduler")


Job = tuple[str, Callable[[], Any], int]  # name, call, interval in seconds


def schedule(
    app: App, watcher: reload.Watcher | None = None, recorder: outages.Recorder | None = None
) -> list[Job]:
    """Every job ``scheduler run`` schedules, with its interval: the steps of one cycle
    (:mod:`provisioner.jobs.cycle`, which ``provisioner sweep`` runs once, in order). With a
    ``watcher``, each pass first takes up edited policy and settings files; with the
    endpoint's ``recorder``, its outages are written every few seconds and before each sweep
    (which reads them)."""
    jobs: list[Job] = []
    for name, call, every in cycle.jobs(app):
        if name == "sweep" and recorder is not None:
            call = _flushed_first(recorder, call)
        jobs.append((name, call, every))
    if recorder is not None:
        jobs.append(("endpoint.outages", recorder.flush, outages.FLUSH_SECONDS))
    if watcher is None:
        return jobs
    return [(name, _after_check(watcher, call), every) for name, call, every in jobs]


def _flushed_first(recorder: outages.Recorder, call: Callable[[], Any]) -> Callable[[], Any]:
    def job() -> Any:
        recorder.flush()
        return call()

    return job


def _after_check(watcher: reload.Watcher, call: Callable[[], Any]) -> Callable[[], Any]:
    def job() -> Any:
        watcher.check()
        return call()

    return job


def run(app: App, apps: dict[str, WSGIApp] | None = None, config: str | None = None) -> None:
    """``provisioner scheduler run``: the jobs on their intervals, and the heartbeat and
    metrics endpoint (with other WSGI ``apps`` by path prefix: the dashboard), until SIGTERM
    or Ctrl-C. Edits of the settings file (``config``, as ``--config`` names it) and of the
    policy files are taken up at each pass and on SIGHUP (:mod:`provisioner.jobs.reload`)."""
    from apscheduler.schedulers.background import BackgroundScheduler

    app.policies  # noqa: B018  (refuse to start with a bad policy rather than act on half)
    cfg = app.settings.scheduler
    host, port = cfg.host_port
    token = cfg.metrics_token.get_secret_value() if cfg.metrics_token else None
    recorder = outages.Recorder(app, HOLDER)
    watcher = reload.Watcher(app, config)
    sched = BackgroundScheduler(timezone=UTC)
    # SIGTERM only raises a flag the main thread looks at: raising from the handler could
    # unwind APScheduler (or anything) halfway through a critical section and leave a lock
    # held that a job thread then waits on forever — the process would never exit
    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    # the handler runs on the main thread, inside the scheduler's wait: the reload on its own
    signal.signal(
        signal.SIGHUP,
        lambda *_: threading.Thread(target=watcher.check, args=("SIGHUP",), daemon=True).start(),
    )
    down = recorder.started()  # the span since an endpoint last ran: heartbeats had nowhere to go
    if down is not None:
        log.warning(
            "the endpoint was down from %s: silence then does not count as idle",
            f"{down.started_at:%Y-%m-%d %H:%M:%S} UTC",
        )
    try:
        endpoint = Endpoint(
            app,
            host,
            port,
            Metrics(app),
            metrics_token=token,
            apps=apps,
            connection_limit=cfg.max_connections,
            per_address_limit=cfg.max_connections_per_address,
            on_refuse=recorder.refused,
        ).start()
    except OSError as e:  # the port is taken, the address is not this machine's…
        raise UserError(
            f"scheduler.listen: cannot listen on {cfg.listen}: {e.strerror or e}"
        ) from None
    try:
        log.info("heartbeats, /metrics%s on %s", " and the dashboard" if apps else "", endpoint.url)
        for name, call, every in schedule(app, watcher, recorder):
            sched.add_job(
                _guarded(name, call),
                "interval",
                seconds=every,
                id=name,
                name=name,
                next_run_time=datetime.now(UTC),
                coalesce=True,
                max_instances=1,
                misfire_grace_time=every,
            )
        sched.start()
        while not stopping:  # a sleep, not a timed wait: libfaketime can stall those
            time.sleep(0.2)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        if sched.running:
            sched.shutdown(wait=False)  # a pass under way finishes; no new one starts
        endpoint.stop()
        try:
            recorder.stopped()  # when it was last running, for the next start
        except Exception:
            log.exception("the endpoint's last refusals could not be recorded")


def _guarded(name: str, call: Callable[[], Any]) -> Callable[[], None]:
    def job() -> None:
        try:
            result = call()
        except Exception as e:  # a job that fails is logged and runs again next interval
            if (lost := database_failure(e)) is not None:  # one line, no traceback
                log.error("job %s failed: %s", name, lost)
            else:
                log.exception("job %s failed", name)
            return
        log_outcome(name, result)

    return job


def log_outcome(name: str, result: Any) -> None:
    """Actions and failures, not ticks: a pass that left everything alone, or was not the
    leader's, says nothing; a failed action is a warning."""
    if isinstance(result, Pass):
        for a in result.actions:
            if a.error or a.reason == "error":
                log.warning("%s: %s", name, a)
            elif a.action != "keep":
                log.info("%s: %s", name, a)
        for line in describe(replace(result, actions=[])) if result.leader else []:
            log.warning("%s: %s", name, line)
        return
    for line in describe(result):
        log.info("%s: %s", name, line)
