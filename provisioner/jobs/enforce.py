"""Budget enforcement: alerts at each threshold once per period (actual spend and forecast), and
on an exhausted budget stop or terminate the machines in scope if the policy says so (events with
reason ``budget``). Where each budget stands is :mod:`provisioner.budget`'s to say.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from sqlalchemy import select

from policies.schema import Policy
from provisioner import notify, render, reports
from provisioner.app import App
from provisioner.budget import Status, status
from provisioner.errors import OperationFailed
from provisioner.jobs import ended
from provisioner.jobs.lease import HOLDER, leading
from provisioner.jobs.notices import claim, claimed
from provisioner.models import Machine
from provisioner.schema import MachineStatus as S
from provisioner.schema import NoticeKind

REASON = "budget"


@dataclass
class Action:
    kind: str  # alert | exhausted | stop | terminate
    policy: str
    detail: str
    machine: str | None = None
    mailed: bool = False
    error: str | None = None

    def __str__(self) -> str:
        what = f"{self.kind} {self.machine}" if self.machine else self.kind
        extra = f" (failed: {self.error})" if self.error else ""
        return f"budget {self.policy}: {what}: {self.detail}{extra}"


def _mark(t: Decimal) -> str:
    """The threshold as recorded in its notice (kept as it always was: ``8E+1`` for 80)."""
    return str(t.normalize()) if t == t.to_integral() else str(t)


def _shown(t: Decimal) -> str:
    """The threshold as a person reads it: 80, 92.5 — never 8E+1."""
    return format(t.normalize(), "f")


def run(app: App, now: datetime | None = None, *, holder: str = HOLDER) -> list[Action]:
    """Alerts once per threshold and period; on exhaustion stop/terminate per policy."""
    now = now or app.clock.now()
    actions: list[Action] = []
    stops: list[tuple[Policy, str, Status]] = []
    for policy in app.policies:
        st = status(app, policy, now) if policy.budget else None
        if st is None:
            continue
        b = policy.budget
        assert b is not None
        done = claimed(app, policy.name, st.period)
        for crossed in (
            (NoticeKind.ACTUAL, b.alerts.actual, st.pct),
            (NoticeKind.FORECAST, b.alerts.forecast, st.forecast_pct),
        ):
            actions += _alert(app, policy, st, crossed, done, now)
        if not st.exhausted:
            continue
        actions += _exhausted(app, policy, st, done, now)
        if b.on_exhausted in ("stop", "terminate"):
            stops.append((policy, b.on_exhausted, st))
    if stops:
        actions += _stop(app, stops, now, holder)
    return actions


def _alert(
    app: App,
    policy: Policy,
    st: Status,
    crossed: tuple[NoticeKind, list[Decimal], Decimal],
    done: set[tuple[NoticeKind, str]],
    now: datetime,
) -> list[Action]:
    """The alert of a budget's thresholds of ``kind`` (actual or forecast) that ``value`` has
    crossed and none has claimed yet this period: told to the policy's channels and mailed to
    its recipients; none: nothing new, or another process claimed it first."""
    kind, thresholds, value = crossed
    b = policy.budget
    assert b is not None
    new = _unclaimed(kind, thresholds, value, done)
    if not new:
        return []
    top = max(new)
    a = Action(
        "alert",
        policy.name,
        f"{kind} {st.pct if kind == NoticeKind.ACTUAL else st.forecast_pct:.0f} % "
        f"(threshold {_shown(top)} %)",
    )
    key = f"budget:{policy.name}:{st.period.start.isoformat()}:{kind}:{_mark(top)}"
    notify.tell_policy(app, _alert_notice(st, kind, top, value, key), policy.name)
    send = _mailer(app, st, kind, top, now) if b.recipients else None
    a.mailed = send is not None
    try:
        if not claim(
            app,
            policy.name,
            st.period,
            [(kind, _mark(t)) for t in new],
            now,
            send,
            {"percent": str(value)},
        ):
            return []
    except OperationFailed as e:
        a.mailed, a.error = False, str(e)
    if send is not None:  # the mail's fate is a delivery too (a failure is tried again)
        subject = f"budget {policy.name}: {a.detail}"
        notify.record_mail(
            app, key, "budget-alert", b.recipients, subject, a.error, retried=True,
            policy=policy.name, supersedes=key.rpartition(":")[0] + ":",
        )  # fmt: skip
    return [a]


def _unclaimed(
    kind: NoticeKind, thresholds: list[Decimal], value: Decimal, done: set[tuple[NoticeKind, str]]
) -> list[Decimal]:
    """The thresholds of ``kind`` that ``value`` reaches and none has claimed this period."""
    return [t for t in thresholds if value >= t and (kind, _mark(t)) not in done]


def _mailer(
    app: App, st: Status, kind: NoticeKind, top: Decimal, now: datetime
) -> Callable[[], None]:
    """What mails the alert, once its claim is made."""

    def send() -> None:
        _send_alert(app, st, kind, top, now)

    return send


def _exhausted(
    app: App, policy: Policy, st: Status, done: set[tuple[NoticeKind, str]], now: datetime
) -> list[Action]:
    """An exhausted budget, once a period: launches blocked, told to the policy's channels."""
    b = policy.budget
    assert b is not None
    if (NoticeKind.EXHAUSTED, "100") not in done and claim(
        app,
        policy.name,
        st.period,
        [(NoticeKind.EXHAUSTED, "100")],
        now,
        None,
        {"spent": str(st.spent.amount), "currency": st.spent.currency},
    ):
        notice = notify.Notice(
            "budget-exhausted",
            f"budget:{policy.name}:{st.period.start.isoformat()}:exhausted",
            notify.texts(
                "budget-exhausted",
                policy=policy.name,
                spent=st.spent,
                amount=st.amount,
                period=st.period.label,
                action=b.on_exhausted,
            ),
            policy=policy.name,
        )
        notify.tell_policy(app, notice, policy.name)
        return [Action("exhausted", policy.name, f"{st.spent} of {st.amount}; launches blocked")]
    return []


def _stop(
    app: App, stops: list[tuple[Policy, str, Status]], now: datetime, holder: str
) -> list[Action]:
    """The machines of exhausted budgets stopped or terminated under the scheduler's lease
    (alerts need none: each is claimed once), kept before each policy's; a second scheduler
    leaves them to the one that holds it."""
    out: list[Action] = []

    def undone(stop: tuple[Policy, str, Status]) -> list[Action]:
        out.append(Action(stop[1], stop[0].name, "machines in scope"))
        return out[-1:]

    with leading(app, "budget.enforce", now, holder, False) as lease:
        if lease:
            for policy, how, st in lease.each(stops, undone):
                out += _stop_in_scope(app, policy, how, st)
    return out


def _send_alert(app: App, st: Status, kind: NoticeKind, threshold: Decimal, now: datetime) -> None:
    """A threshold alert: the budget's report in the short template."""
    policy = st.policy
    r = reports.for_budget(app, policy, now, st.period)
    render.email(app, r, policy.budget.recipients, alert=(kind, threshold))  # type: ignore[union-attr]


def _alert_notice(
    st: Status, kind: NoticeKind, top: Decimal, value: Decimal, key: str
) -> notify.Notice:
    what = (
        {"en": "spent", "ru": "потрачено"}
        if kind == NoticeKind.ACTUAL
        else {"en": "forecast", "ru": "прогноз"}
    )
    return notify.Notice(
        "budget-alert",
        key,
        notify.texts(
            "budget-alert",
            policy=st.policy.name,
            what=what,
            pct=f"{value:.0f}",
            threshold=_shown(top),
            spent=st.spent.rounded(),
            amount=st.amount,
            forecast=st.forecast.rounded(),
            period=st.period.label,
        ),
        policy=st.policy.name,
        extra={"percent": str(value), "threshold": _shown(top), "kind": kind},
    )


def _stop_in_scope(app: App, policy: Policy, how: str, st: Status) -> list[Action]:
    statuses = (
        (S.PENDING, S.RUNNING) if how == "stop" else (S.PENDING, S.RUNNING, S.STOPPED, S.PREEMPTED)
    )
    with app.db.session() as s:
        covered = [
            m
            for m in s.scalars(select(Machine).where(Machine.status.in_(statuses)))
            if policy.applies_to.matches(m.project, m.owner)
        ]
    why = f"budget exhausted: {st.spent} of {st.amount}"
    # in batches, as the sweep; a job running on one ends with it, recorded, its owner told
    done = ended.act_many(app, covered, how, reason=REASON, why=f"{why} ({policy.name})")
    return [Action(how, policy.name, why, m.name, error=done[m.id].error) for m in covered]
