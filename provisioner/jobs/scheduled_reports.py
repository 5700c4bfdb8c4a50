"""Each policy's scheduled report (``budget.report.cron``), sent once per due time."""

from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from policies.schema import Policy
from provisioner import budget, mail, notify, render, reports
from provisioner.app import App
from provisioner.jobs.notices import claim, claimed
from provisioner.ledger import Period
from provisioner.schema import NoticeKind

GRACE = timedelta(days=1)  # a report due longer ago than this is skipped, not sent late


def due_time(cron: str, tz: str, now: datetime) -> datetime | None:
    """The latest time ``cron`` (read in ``tz``) fired at or before ``now``, if within grace."""
    from apscheduler.triggers.cron import CronTrigger

    trigger = CronTrigger.from_crontab(cron, timezone=ZoneInfo(tz))
    last = None
    t = trigger.get_next_fire_time(None, now - GRACE)
    while t is not None and t <= now:
        last = t
        t = trigger.get_next_fire_time(t, t + timedelta(seconds=1))
    return last


def run(app: App, now: datetime | None = None) -> list[str]:
    """Send each policy's scheduled report once per due time (the scheduler calls this every
    few minutes). Returns what was sent, or why not."""
    now = now or app.clock.now()
    out = []
    for policy in app.policies:
        due = _due(app, policy, now)
        if due is None:
            continue
        mark, period = due
        key = f"report:{policy.name}:{mark}"
        out += _tell_channels(app, policy, now, period, key, mark)
        out += _mail(app, policy, now, period, key, mark)
    return out


def _due(app: App, policy: Policy, now: datetime) -> tuple[str, Period] | None:
    """(the due time's mark, its budget period) of ``policy``'s report when one is due and not
    yet claimed, and someone would receive it; else None."""
    b = policy.budget
    if b is None or b.report is None or not (b.recipients or policy.notify):
        return None
    due = due_time(b.report.cron, policy.timezone, now)
    period = budget.period_of(policy, now)
    if due is None or period is None:
        return None
    mark = due.astimezone(ZoneInfo("UTC")).isoformat(timespec="minutes")
    if (NoticeKind.REPORT, mark) in claimed(app, policy.name, period):
        return None
    return mark, period


def _tell_channels(
    app: App, policy: Policy, now: datetime, period: Period, key: str, mark: str
) -> list[str]:
    """Queue the report's notice for the policy's notify channels, if it has any."""
    if policy.notify and (st := budget.status(app, policy, now, period=period)) is not None:
        notice = notify.Notice(
            "report",
            key,
            notify.texts(
                "report",
                policy=policy.name,
                period=period.label,
                spent=st.spent.rounded(),
                amount=st.amount,
                pct=f"{st.pct:.0f}",
                committed=st.committed.rounded(),
                forecast=st.forecast.rounded(),
            ),
            policy=policy.name,
            extra={"budget": st.as_json()},
        )
        if notify.tell_policy(app, notice, policy.name):
            return [f"report {policy.name} due {mark}: queued for its notify channels"]
    return []


def _mail(
    app: App, policy: Policy, now: datetime, period: Period, key: str, mark: str
) -> list[str]:
    """Claim the due time and mail the report to the budget's recipients (the claim alone when
    it has none), each mail recorded."""
    b = policy.budget
    assert b is not None

    def send() -> None:
        r = reports.for_budget(app, policy, now, period)
        render.email(app, r, b.recipients)

    subject = f"report {policy.name} due {mark}"
    try:
        sent = claim(
            app,
            policy.name,
            period,
            [(NoticeKind.REPORT, mark)],
            now,
            send if b.recipients else None,
        )
        if sent and b.recipients:
            notify.record_mail(
                app, key, "report", b.recipients, subject, None, retried=True,
                policy=policy.name,
            )  # fmt: skip
            return [f"{subject}: sent to {', '.join(b.recipients)}"]
    except mail.MailError as e:
        notify.record_mail(
            app, key, "report", b.recipients, subject, str(e), retried=True, policy=policy.name
        )
        return [f"{subject}: not sent: {e}"]
    return []
