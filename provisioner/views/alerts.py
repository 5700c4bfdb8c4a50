"""Alert history as the dashboard's Alerts page shows it: each notice delivered to a channel
(the ``deliveries`` rows :mod:`provisioner.notify` writes: sent, retrying, failed, with attempts
and the last error), and each budget notice no channel heard of (a ``budget_notices`` row
without a delivery: nobody to tell) — newest first, by budget and status, a page at a time."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING

from sqlalchemy import func, select

from provisioner.errors import UserError
from provisioner.models import Delivery, Notice
from provisioner.schema import DELIVERY_DUE, UNDELIVERED
from provisioner.schema import DeliveryStatus as D
from provisioner.schema import NoticeKind as N

if TYPE_CHECKING:
    from provisioner.app import App

UNSENT = "unsent"  # a filter, not a delivery's status: a notice no channel was given
STATUSES = (D.SENT, D.RETRYING, D.FAILED, D.PENDING, UNSENT)
THRESHOLDS = (N.ACTUAL, N.FORECAST)  # the notices of a threshold reached (their mark: percent)
PAGE = 50


@dataclass
class Alert:
    at: datetime
    policy: str | None
    what: str  # actual | forecast | exhausted | report | a notice's topic
    mark: str | None  # the threshold crossed, in per cent ("80")
    channel: str | None  # telegram | slack | webhook | email; None: nobody was told
    target: str
    status: str  # sent | retrying | failed | pending | unsent
    attempts: int = 0
    error: str | None = None
    subject: str = ""
    machine: str | None = None
    next_at: datetime | None = None


@dataclass
class Alerts:
    rows: list[Alert]
    filters: dict[str, str]
    page: int
    more: bool  # an older page follows
    budgets: list[str]  # to filter by: the policies named by notices and deliveries


def _head(key: str, kind: str) -> str:
    """The notice's key a delivery's key starts with (``…|KIND|TARGET``, or ``…|mail`` for a
    budget's mail): cut at the channel's own separator, the last, since a policy's name may
    hold ``|`` itself."""
    if key.endswith("|mail"):
        return key.removesuffix("|mail")
    at = key.rfind(f"|{kind}|")
    return key[:at] if at >= 0 else key


def _what(head: str, policy: str | None, topic: str) -> tuple[str, str | None]:
    """What a delivery told, from its notice's key (``budget:P:START:KIND:MARK``,
    ``budget:P:START:exhausted``, ``report:P:DUE``) with its policy ``P`` as stored (a name
    may hold ``:`` and ``|``): the notice's kind and threshold; the topic where the key does
    not read so (one cut short with a hash, a key of another version)."""
    prefix = f"budget:{policy}:" if policy is not None else "budget:"
    if not head.startswith(prefix):
        return topic, None
    rest = head.removeprefix(prefix)
    if rest.endswith(f":{N.EXHAUSTED}"):
        return N.EXHAUSTED, None
    parts = rest.rsplit(":", 2)
    if len(parts) == 3 and parts[1] in THRESHOLDS:
        return parts[1], _percent(parts[2])
    return topic, None


def _percent(mark: str) -> str | None:
    try:
        return format(Decimal(mark).normalize(), "f")  # "8E+1", as a mark is kept: 80
    except (InvalidOperation, ValueError):
        return None


def _notice_key(n: Notice) -> str:
    """The key head of the delivery a budget notice makes (see :mod:`provisioner.jobs`)."""
    if n.kind == N.REPORT:
        return f"report:{n.policy}:{n.mark}"
    start = n.period_start.isoformat()
    if n.kind == N.EXHAUSTED:
        return f"budget:{n.policy}:{start}:exhausted"
    return f"budget:{n.policy}:{start}:{n.kind}:{n.mark}"


def _unsent(app: App, budget: str | None) -> list[Alert]:
    """Budget notices no delivery came of: those claimed together (one pass: the same policy,
    kind, period and time) are one alert, told once for its highest threshold."""
    with app.db.session() as s:
        q = select(Notice).where(Notice.kind.in_((*THRESHOLDS, N.EXHAUSTED, N.REPORT)))
        if budget:
            q = q.where(Notice.policy == budget)
        notices = list(s.scalars(q))
        dq = select(Delivery.key, Delivery.kind).where(Delivery.policy.is_not(None))
        if budget:
            dq = dq.where(Delivery.policy == budget)
        told = {_head(k, kind) for k, kind in s.execute(dq)}
    groups: dict[tuple[str, str, datetime, datetime], list[Notice]] = {}
    for n in notices:
        groups.setdefault((n.policy, n.kind, n.period_start, n.at), []).append(n)
    out = []
    for (policy, kind, _, at), group in groups.items():
        if any(_notice_key(n) in told for n in group):
            continue
        marks = [m for n in group if (m := _percent(n.mark)) is not None]
        top = max(marks, key=Decimal) if kind in THRESHOLDS and marks else None
        out.append(Alert(at, policy, kind, top, None, "", UNSENT))
    return out


def alerts(app: App, q: dict[str, str]) -> Alerts:
    """The Alerts page's rows for its query: ``budget`` (a policy's name), ``status`` (one of
    :data:`STATUSES`), ``page`` (1 the newest)."""
    budget = q.get("budget", "").strip() or None
    status = q.get("status", "").strip() or None
    if status is not None and status not in STATUSES:
        raise UserError(f"status: use one of {', '.join(STATUSES)} (not {status[:40]!r})")
    try:
        page = int(q.get("page") or 1)
        if not 1 <= page <= 10_000:
            raise ValueError
    except ValueError:
        raise UserError(f"page: a number from 1 (not {q.get('page', '')[:40]!r})") from None
    wanted = page * PAGE + 1
    rows: list[Alert] = []
    if status != UNSENT:
        with app.db.session() as s:
            dq = select(Delivery)
            if budget:
                dq = dq.where(Delivery.policy == budget)
            if status:
                dq = dq.where(Delivery.status == status)
            for d in s.scalars(dq.order_by(Delivery.at.desc(), Delivery.id.desc()).limit(wanted)):
                what, mark = _what(_head(d.key, d.kind), d.policy, d.topic)
                rows.append(
                    Alert(
                        d.at,
                        d.policy,
                        what,
                        mark,
                        d.kind,
                        d.target,
                        d.status,
                        d.attempts,
                        d.error,
                        d.subject,
                        d.machine,
                        d.next_at if d.status in DELIVERY_DUE else None,
                    )
                )
    if status in (None, UNSENT):
        rows += _unsent(app, budget)
    rows.sort(key=lambda a: a.at, reverse=True)
    filters = {k: v for k, v in (("budget", budget), ("status", status)) if v}
    return Alerts(
        rows[(page - 1) * PAGE : page * PAGE], filters, page, len(rows) > page * PAGE, _names(app)
    )


def _names(app: App) -> list[str]:
    names = {p.name for p in app.policies if p.budget is not None}
    with app.db.session() as s:
        names.update(n for n in s.scalars(select(Delivery.policy).distinct()) if n)
    return sorted(names)


def recent(app: App, budget: str | None = None, n: int = 5) -> list[Alert]:
    """The latest ``n`` alerts (of one budget): what the Spend page shows."""
    return alerts(app, {"budget": budget or ""}).rows[:n]


def undelivered(app: App) -> int:
    """How many notices failed or are still retrying: said on the fleet's summary."""
    with app.db.session() as s:
        return (
            s.scalar(
                select(func.count()).select_from(Delivery).where(Delivery.status.in_(UNDELIVERED))
            )
            or 0
        )
