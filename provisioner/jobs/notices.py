"""Each budget alert, exhaustion and scheduled report is a row in ``budget_notices``, unique per
policy, period and mark: claiming the row and sending the mail happen in one transaction, so a
mail is sent once, or again only if the process died between the send and the commit.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from provisioner.app import App
from provisioner.ledger import Period
from provisioner.models import Notice
from provisioner.schema import NoticeKind


def claimed(app: App, policy: str, period: Period) -> set[tuple[NoticeKind, str]]:
    with app.db.session() as s:
        return {
            (n.kind, n.mark)
            for n in s.scalars(
                select(Notice).where(Notice.policy == policy, Notice.period_start == period.start)
            )
        }


def claim(
    app: App,
    policy: str,
    period: Period,
    marks: list[tuple[NoticeKind, str]],
    now: datetime,
    send: Callable[[], None] | None,
    detail: dict[str, Any] | None = None,
) -> bool:
    """Record ``marks`` (kind, mark) and call ``send`` in one transaction: False when another
    run recorded them first; a failing send records nothing (the next run tries again)."""
    try:
        with app.db.session() as s:
            for kind, mark in marks:
                s.add(
                    Notice(
                        policy=policy,
                        kind=kind,
                        period_start=period.start,
                        mark=mark,
                        at=now,
                        detail=detail or {},
                    )
                )
            s.flush()
            if send is not None:
                send()
        return True
    except IntegrityError:
        return False
