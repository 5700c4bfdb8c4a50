"""``provisioner selftest --cloud C``: one small real run on a cloud, to learn before a team
relies on it that the guard works there — for a few minutes and a few cents.

Step by step (each step a :class:`Check`, said as it ends):

1. **leftovers** — machines and volumes an earlier, killed selftest left (project
   ``selftest``) are removed first.
2. **credentials** — the cloud's ``check()``.
3. **launch** — the cheapest offer of the cloud (any GPU, one of it, spot where the cloud sells
   it) with a 10 GB volume, a one-minute job, ``on_finish: stop``, ``autostop`` and a
   ``max_lifetime`` as safety nets; through the same ``up`` as every launch (policies, budget).
4. **reachable** — it runs and answers SSH; the job is started.
5. **agent** — the machine's agent is heard: a heartbeat, or a report pulled over SSH.
6. **job end** — the job's end is recorded with its exit code (0).
7. **own stop** — the machine stops itself (its guard; nobody calls stop), and the stop is
   dated by the cloud; the ledger's compute interval closes there.
8. **billing tag** — the cloud lists the instance and the volume with provisioner's tags (what
   the cloud's bill groups by).
9. **cleanup** — the machine and the volume are removed, in a ``finally``: also after a failed
   step, Ctrl-C or SIGTERM; what could not be removed is named with the command that does.
10. **cost** — what the run cost, from the ledger, per currency.
"""

from __future__ import annotations

import secrets
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from types import FrameType
from typing import Any

from sqlalchemy import func, select

from providers.base import TAG_MACHINE, TAG_MANAGED_BY
from provisioner import machines
from provisioner.app import App
from provisioner.errors import OperationFailed, ProvisionerError, UserError
from provisioner.machines import guard_stops, jobs, pull
from provisioner.machines import volumes as volumes_
from provisioner.models import Event, Heartbeat, Machine
from provisioner.money import Money
from provisioner.schema import MachineStatus as S
from provisioner.spec import Experiment
from provisioner.views.status import machine_detail

PROJECT = "selftest"
VOLUME_GB = 10
MOUNT = "/mnt/selftest"
Say = Callable[[str], None]


@dataclass
class Check:
    step: str
    ok: bool
    detail: str


@dataclass
class Result:
    cloud: str
    name: str = ""
    checks: list[Check] = field(default_factory=list)
    cost: list[Money] = field(default_factory=list)
    left: list[str] = field(default_factory=list)  # commands that remove what is left

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks) and not self.left


class StepFailed(OperationFailed):
    pass


@dataclass
class Clock:
    """Waiting, injectable: the tests' machines take their own (real) time."""

    sleep: Callable[[float], None] = time.sleep
    monotonic: Callable[[], float] = time.monotonic


def run(
    app: App,
    cloud: str,
    *,
    job_seconds: int = 60,
    timeout: timedelta = timedelta(minutes=15),
    poll: float = 5.0,
    say: Say = lambda _: None,
    clock: Clock | None = None,
) -> Result:
    """The whole selftest; never leaves anything behind it could remove."""
    if cloud not in app.settings.enabled_clouds:
        raise UserError(
            f"selftest: cloud {cloud!r} is not enabled in settings (clouds: "
            f"{', '.join(app.settings.enabled_clouds) or 'none'})"
        )
    clock = clock or Clock()
    result = Result(cloud)
    deadline = clock.monotonic() + timeout.total_seconds()

    def check(step: str, ok: bool, detail: str, fatal: bool = True) -> None:
        """Record a step; a failed ``fatal`` one ends the run (the cleanup follows)."""
        result.checks.append(Check(step, ok, detail))
        say(f"{'ok  ' if ok else 'FAIL'} {step}: {detail}")
        if not ok and fatal:
            raise StepFailed(f"selftest {cloud}: {step}: {detail}")

    with _interruptible():
        try:
            removed = cleanup(app, cloud, say)
            check("leftovers", True, f"removed {removed}" if removed else "none")
            probe = app.provider(cloud).check()
            check("credentials", probe.ok, probe.message)
        except StepFailed:
            return result
        experiment = _experiment(app, cloud, job_seconds)
        result.name = experiment.name
        try:
            _steps(app, experiment, check, say, clock, deadline, poll)
        except StepFailed:
            pass  # said and recorded: the cleanup and the cost follow
        except ProvisionerError as e:
            result.checks.append(Check("run", False, str(e)))
            say(f"FAIL run: {e}")
        finally:
            result.cost = _cost(app, experiment.name)
            result.left = _remove(app, experiment.name, say)
            if not result.left:
                result.checks.append(Check("cleanup", True, "machine and volume removed"))
                say("ok   cleanup: machine and volume removed")
    return result


def _steps(
    app: App,
    experiment: Experiment,
    check: Callable[..., None],
    say: Say,
    clock: Clock,
    deadline: float,
    poll: float,
) -> None:
    up = machines.up(app, experiment, progress=say)
    m = up.machine
    check("launch", True, f"{m.cloud} {m.zone or m.region} {m.instance_type} ({m.market})")
    m = machines.wait_ready(
        app, m.name, timeout=max(1.0, deadline - clock.monotonic()), progress=say
    )
    _start_job(app, m, experiment, say, clock, deadline, poll)
    check("reachable", m.status == S.RUNNING, f"{m.name} runs at {m.public_ip or 'no address'}")
    m, heard, ended, stopped = _watch(app, m, clock, deadline, poll)
    # each said, none ends the run: a team wants to know all that failed
    check("agent", heard, "heard from the machine's agent" if heard else "never heard", False)
    job = jobs.jobs_of(app, m).get(jobs.RUN)
    code = job.exit_code if job else None
    said = f"run exited {code}" if ended else "never ended"
    check("job end", ended and code == 0, said, False)
    check("own stop", stopped, _stop_detail(app, m) if stopped else f"still {m.status}", False)
    check("billing tag", *_tagged(app, m), False)


def _start_job(
    app: App,
    m: Machine,
    experiment: Experiment,
    say: Say,
    clock: Clock,
    deadline: float,
    poll: float,
) -> None:
    """Start the experiment's job on the ready machine, asking again each poll until it is
    taken (or the deadline passes: :class:`StepFailed`)."""
    while jobs.run_due(app, m):
        jobs.ensure_run(app, m, experiment, progress=say)
        if not jobs.run_due(app, m):
            break
        _wait(clock, deadline, poll, "the machine to take the job")


def _watch(
    app: App, m: Machine, clock: Clock, deadline: float, poll: float
) -> tuple[Machine, bool, bool, bool]:
    """Pass over the machine as the scheduler would until its agent was heard, its job ended
    and it stopped itself, or the deadline: (the machine as last read, heard, ended,
    stopped)."""
    heard = ended = stopped = False
    while True:
        if m.status == S.RUNNING:  # what a scheduler pass reads of it: heartbeats or its report
            pull.pull_all(app, [m])
            jobs.check_ended(app, m)  # its job's end recorded, not acted on: the guard acts
        machines.reconcile(app)
        m = jobs.named(app, m.name)
        heard = heard or _heard(app, m.id)
        run_job = jobs.jobs_of(app, m).get(jobs.RUN)
        ended = ended or bool(run_job and not run_job.running)
        stopped = m.status in (S.STOPPED, S.TERMINATED)
        if heard and ended and stopped:
            break
        if clock.monotonic() >= deadline:
            break
        clock.sleep(poll)
    return m, heard, ended, stopped


def _wait(clock: Clock, deadline: float, poll: float, what: str) -> None:
    if clock.monotonic() + poll > deadline:
        raise StepFailed(f"selftest: timed out waiting for {what}")
    clock.sleep(poll)


def _experiment(app: App, cloud: str, job_seconds: int) -> Experiment:
    """The cheapest offer of ``cloud``: its GPU, one of it, spot where sold."""
    from provisioner import catalog

    offers = [
        o
        for o in catalog.load(app.settings, [cloud])
        if o.gpu_count == 1 and (o.spot_price or o.price) is not None
    ]
    if not offers:
        raise UserError(f"selftest: the catalog offers no one-GPU machine on {cloud}")
    cheapest = min(offers, key=_cheapest_price)
    name = f"selftest-{secrets.token_hex(3)}"
    data: dict[str, Any] = {
        "name": name,
        "project": PROJECT,
        "resources": {
            "gpu": {"type": cheapest.gpu, "count": 1},
            "market": "any",
            "clouds": [cloud],
        },
        "volumes": [{"name": f"{name}-data", "size_gb": VOLUME_GB, "path": MOUNT}],
        "run": f"echo selftest; sleep {int(job_seconds)}; echo done",
        "lifecycle": {"on_finish": "stop", "autostop": "10m", "max_lifetime": "30m"},
    }
    return Experiment.model_validate(data, context={"actor": lambda: app.actor})


def _cheapest_price(o: Any) -> Decimal:
    prices = [p for p in (o.spot_price, o.price) if p is not None]
    return min(prices)


def _heard(app: App, machine_id: str) -> bool:
    """A heartbeat or a pulled sample of the machine's, or a stop its agent made and recorded
    (its ``stop.json``, read back into the stop event) — not a stop reconcile inferred from
    what is recorded (its run exited, on_finish): that is said with every report refused."""
    with app.db.session() as s:
        beats = s.scalar(select(func.count()).where(Heartbeat.machine_id == machine_id))
        stops = s.scalars(
            select(Event.detail).where(
                Event.machine_id == machine_id, Event.reason.in_(guard_stops.GUARD_REASONS)
            )
        )
        return bool(beats) or any(guard_stops.said_by_guard(d) for d in stops)


def _stop_detail(app: App, m: Machine) -> str:
    with app.db.session() as s:
        ev = s.scalars(
            select(Event)
            .where(Event.machine_id == m.id, Event.kind.in_((S.STOPPED, S.TERMINATED)))
            .order_by(Event.id.desc())
        ).first()
    why = (ev.reason if ev else None) or "no reason recorded"
    at = (ev.at.isoformat() if ev else None) or "?"
    return f"{m.status} at {at} ({why})"


def _tagged(app: App, m: Machine) -> tuple[bool, str]:
    inst = app.provider(m.cloud or "").get(machines.ref(m))
    labels = dict(inst.labels or {}) if inst is not None else {}
    ok = labels.get(TAG_MACHINE) == m.id and TAG_MANAGED_BY in labels
    return ok, f"instance tags {TAG_MACHINE}={labels.get(TAG_MACHINE)}"


def _cost(app: App, name: str) -> list[Money]:
    """The machine's and its volume's spend (a volume's ledger row has the volume's id)."""
    ids = [name]
    ids += [v.volume.id for v in volumes_.listing(app, PROJECT) if v.volume.name.startswith(name)]
    total: dict[str, Money] = {}
    for key in ids:
        detail = machine_detail(app, key, by_id=key != name)
        for money in detail.spent if detail is not None else []:
            seen = total.get(money.currency)
            total[money.currency] = money if seen is None else seen + money
    return list(total.values())


def _remove(app: App, name: str, say: Say) -> list[str]:
    """Down the machine, then remove its volume; the commands for what is left."""
    left: list[str] = []
    try:
        machines.down(app, name, reason="selftest")
    except ProvisionerError as e:
        say(f"could not remove machine {name}: {e}")
        left.append(f"provisioner down {name}")
    for v in volumes_.listing(app, PROJECT):
        if not v.volume.name.startswith(name):
            continue
        try:
            volumes_.remove(app, v.volume)
        except ProvisionerError as e:
            say(f"could not remove volume {v.volume.name}: {e}")
            left.append(f"provisioner volume rm {v.volume.name} --project {PROJECT}")
    return left


def cleanup(app: App, cloud: str, say: Say) -> int:
    """What earlier selftests on ``cloud`` left (killed before their own cleanup)."""
    with app.db.session() as s:
        names = list(
            s.scalars(
                select(Machine.name).where(
                    Machine.project == PROJECT,
                    Machine.cloud == cloud,
                    Machine.status.not_in((S.TERMINATED, S.FAILED)),
                )
            )
        )
    left = []
    for name in names:
        left += _remove(app, name, say)
    if left:
        raise StepFailed("selftest: an earlier run left what cannot be removed: " + "; ".join(left))
    return len(names)


@contextmanager
def _interruptible() -> Iterator[None]:
    """SIGTERM as Ctrl-C, so the ``finally`` that removes the machine runs for both."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    try:
        before = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: nothing to install
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
