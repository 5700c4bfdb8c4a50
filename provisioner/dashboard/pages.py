"""What each page shows, read from the state database through the application's own modules:
the fleet (state, rules and heartbeats as the sweep sees them), spend (the report model of
``provisioner report``), one machine, and a plan (as ``provisioner plan``). No sums of money are
made here that the ledger or the report model does not make."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from sqlalchemy import select

from policies.calendar import Calendar
from policies.schema import Policy
from provisioner import budget, idle, ledger, reports
from provisioner.app import App
from provisioner.errors import ProvisionerError, UserError
from provisioner.jobs import sweep
from provisioner.models import ACTIVE_EXCLUDED, Event, Heartbeat, Machine, UsageInterval
from provisioner.money import Money
from provisioner.render import Fmt

SPARK_SPAN = timedelta(hours=2)  # the fleet's sparklines: the last two hours of heartbeats
SPARK_STEP = timedelta(minutes=5)
MACHINE_BEATS = timedelta(hours=24)  # a machine's page (heartbeats are kept a day)
BY = ("project", "owner", "cloud", "gpu", "machine")


# --- fleet ---------------------------------------------------------------------------------


@dataclass
class Row:
    machine: Machine
    spent: list[Money]
    beats: list[tuple[datetime, float | None]]
    why: str
    next_action: str
    next_at: datetime | None
    tz: ZoneInfo | None  # the policy calendar's: times are shown in it


@dataclass
class Fleet:
    rows: list[Row]
    projects: list[str]
    owners: list[str]
    clouds: list[str]
    filters: dict[str, str]
    total: int  # live machines before filtering
    spark_start: datetime
    at: datetime  # as of


def fleet(app: App, now: datetime, f: Fmt, filters: Mapping[str, str]) -> Fleet:
    """Every live machine (filtered by exact project, owner, cloud), with what it has cost, its
    GPU utilisation, why it is up and the next thing the scheduler will do to it."""
    chosen = {k: filters[k] for k in ("project", "owner", "cloud") if filters.get(k)}
    with app.db.session() as s:
        live = list(
            s.scalars(
                select(Machine)
                .where(Machine.status.not_in(ACTIVE_EXCLUDED))
                .order_by(Machine.project, Machine.name)
            )
        )
        machines = [m for m in live if all(getattr(m, k) == v for k, v in chosen.items())]
        ids = [m.id for m in machines]
        intervals: dict[str, list[UsageInterval]] = {}
        for i in range(0, len(ids), 500):  # bound the IN list
            for iv in s.scalars(
                select(UsageInterval).where(UsageInterval.machine_id.in_(ids[i : i + 500]))
            ):
                intervals.setdefault(iv.machine_id, []).append(iv)
    start = now - SPARK_SPAN
    beats = spark_points(app, ids, start, SPARK_STEP) if ids else {}
    rows = []
    assessed, failed = sweep.assess(app, now, machines)
    for m in machines:
        if m.id in failed:  # shown, with why the scheduler cannot judge it
            spent = ledger.spend(intervals.get(m.id, []), m.created_at, now)
            why = f"rules cannot be evaluated: {failed[m.id]}"
            rows.append(Row(m, [spent[c] for c in sorted(spent)], [], why, "", None, None))
    for a in assessed:
        m = a.machine
        spent = ledger.spend(intervals.get(m.id, []), m.created_at, now)
        why = _why_up(a, now, f)
        next_action, next_at = _next(a, now, f)
        rows.append(
            Row(
                m,
                [spent[c] for c in sorted(spent)],
                beats.get(m.id, []),
                why,
                next_action,
                next_at,
                _tz(a),
            )
        )
    return Fleet(
        rows,
        sorted({m.project for m in live}),
        sorted({m.owner for m in live}),
        sorted({m.cloud for m in live if m.cloud}),
        chosen,
        len(live),
        start,
        now,
    )


def spark_points(
    app: App, ids: list[str], start: datetime, step: timedelta
) -> dict[str, list[tuple[datetime, float | None]]]:
    """Each machine's highest GPU utilisation per ``step`` since ``start``, summed up by the
    database (a sparkline needs 24 points, not the 240 heartbeats of two hours)."""
    from sqlalchemy import Integer, cast, func

    col = Heartbeat.__table__.c.at  # the raw column: no datetime per heartbeat in Python
    secs = step.total_seconds()
    base = int(start.timestamp())
    bucket: Any
    if app.db.engine.dialect.name == "sqlite":
        import sqlite3

        # unixepoch() (SQLite 3.38) is a fifth cheaper than strftime('%s') over 240,000 rows
        fn = func.unixepoch if sqlite3.sqlite_version_info >= (3, 38) else _strftime_s
        bucket = ((cast(fn(col), Integer) - base) // int(secs)).label("bucket")  # whole seconds
    else:
        bucket = func.floor((func.extract("epoch", col) - base) / secs).label("bucket")
    machine = idle.beat_machine(app)
    q = (
        select(machine, bucket, func.max(Heartbeat.max_util))
        .where(Heartbeat.at >= start)
        .group_by(machine, bucket)
        .order_by(machine, bucket)
    )
    wanted = set(ids)
    out: dict[str, list[tuple[datetime, float | None]]] = {}
    middle: dict[int, datetime] = {}  # each bucket's time, made once, not once per machine
    with app.db.session() as s:
        for mid, k, util in s.execute(q):
            if mid in wanted:
                k = int(k)
                if k not in middle:
                    middle[k] = start + step * k + step / 2
                out.setdefault(mid, []).append((middle[k], None if util is None else float(util)))
    return out


def _strftime_s(col: Any) -> Any:
    from sqlalchemy import func

    return func.strftime("%s", col)


def _why_up(a: sweep.Assessment, now: datetime, f: Fmt) -> str:
    m = a.machine
    if m.kept_until is not None and m.kept_until > now:
        return f.t("dash_why_kept", when=when(f, m.kept_until, now, _tz(a)))
    if m.status != "running":
        try:
            return f.t(f"dash_state_{m.status}")
        except KeyError:
            return m.status
    if not a.rules.idle:
        return f.t("dash_why_no_rule")
    reasons = []
    for check, signal in a.signals.items():
        if check.calendar is not None and check.calendar.why_off(now) is None:
            reasons.append(f.t("dash_why_in_hours", policy=check.source))
        elif signal == "busy":
            reasons.append(f.t("dash_why_busy", below=f"{check.rule.gpu_util_below:g}"))
        else:
            reasons.append(f.t(f"dash_why_{signal}"))
    return "; ".join(dict.fromkeys(reasons))


def _tz(a: sweep.Assessment) -> ZoneInfo | None:
    for c in a.rules.idle:
        if c.calendar is not None:
            return c.calendar.tz
    return None


def _next(a: sweep.Assessment, now: datetime, f: Fmt) -> tuple[str, datetime | None]:
    """The scheduler's next move on this machine and when: what the sweep would do now, the
    end of a keep, the max lifetime, or the start of off hours for an idle rule."""
    m = a.machine
    act = sweep.decide(a, now)
    if act is not None and act.action in ("stop", "terminate"):
        return f.t("dash_next_now", action=f.t(f"dash_act_{act.action}"), why=act.why), now
    found: list[tuple[datetime, str]] = []
    if m.kept_until is not None and m.kept_until > now:
        found.append((m.kept_until, f.t("dash_next_keep_ends")))
    if a.rules.lifetime and m.launched_at:
        after, how, source = a.rules.lifetime
        if how == "terminate" or m.status == "running":
            how, _ = sweep._stoppable(m, how, "")
            found.append(
                (
                    max(m.launched_at + after, now),
                    f.t("dash_next_lifetime", action=f.t(f"dash_act_{how}"), source=source),
                )
            )
    anytime = None
    if m.status == "running":
        for c in a.rules.idle:
            text = f.t(
                "dash_next_idle",
                action=f.t(f"dash_act_{c.rule.action}"),
                minutes=c.rule.for_minutes,
                below=f"{c.rule.gpu_util_below:g}",
                policy=c.source,
            )
            if c.calendar is None:
                anytime = anytime or text
            elif c.calendar.why_off(now) is None and (start := off_hours_start(c.calendar, now)):
                found.append((start, text))
    if found:
        at, text = min(found, key=lambda x: x[0])
        return text, at
    return (anytime or "—"), None


def off_hours_start(cal: Calendar, now: datetime) -> datetime | None:
    """The next instant out of hours after ``now`` (within a week): a window's start or a
    day off's midnight."""
    today = cal.local(now).date()
    starts = {w.start for w in cal.spec.windows} | {time(0)}
    candidates = sorted(
        at
        for d in (today + timedelta(days=i) for i in range(9))
        for t in starts
        if (at := cal.to_instant(d, t)) > now
    )
    return next((at for at in candidates if cal.is_off(at)), None)


def when(f: Fmt, at: datetime, now: datetime, tz: ZoneInfo | None = None) -> str:
    """``19:20 Europe/Berlin`` today, ``Tue 3 Nov 19:20 …`` another day."""
    zone = tz or ZoneInfo("UTC")
    return _when(f.locale, at, now.astimezone(zone).date(), zone)


@functools.lru_cache(maxsize=4096)
def _when(locale: str, at: datetime, today: date, zone: ZoneInfo) -> str:
    """Formatted once per instant: a fleet's machines share their next stops (19:20 …)."""
    from babel.dates import format_datetime

    local = at.astimezone(zone)
    pattern = "HH:mm" if local.date() == today else "EEE d MMM HH:mm"
    return f"{format_datetime(local, pattern, locale=locale)} {zone.key}"


# --- spend ---------------------------------------------------------------------------------


@dataclass
class Spend:
    report: reports.Report
    budgets: list[budget.Status]
    policy: Policy | None
    params: dict[str, str]
    today: int | None  # index of today in the report's days; None when the period is over


def budget_policies(app: App) -> list[Policy]:
    return [p for p in app.policies if p.budget is not None]


def standings(app: App, now: datetime, report: reports.Report | None = None) -> list[budget.Status]:
    """Each budget's standing in its running period, as :func:`budget.status` gives it (its
    spend summed by the database). A ``report`` built at ``now`` lends its sums to the budgets
    it covers (its own; all of them over the same period) instead of a pass over the ledger
    each."""
    out = []
    same = report if report is not None and report.now == now else None
    for p in budget_policies(app):
        period = budget.period_of(p, now)
        if period is None:
            continue
        lent = same.budget if same is not None else None
        if lent is not None and lent.policy is p and lent.period == period:  # its own report
            out.append(lent)
            continue
        spent = None if same is None else same.spent_by(p, period)
        st = budget.status(app, p, now, period=period, actual=spent)
        if st is not None:
            out.append(st)
    return out


def spend_report(
    app: App,
    now: datetime,
    language: str,
    q: Mapping[str, str],
    budgets: Callable[[reports.Report], list[budget.Status]] | None = None,
) -> Spend:
    """The report ``provisioner report`` builds from the same options: ``budget`` (a policy
    name: its scope, period and standing, like ``report --policy`` over that budget's
    projects), ``period``, ``project``/``owner``/``cloud``/``gpu`` and ``by``."""
    by = q.get("by") or "project"
    if by not in BY:
        raise UserError(f"by: use one of {', '.join(BY)}")
    policies = budget_policies(app)
    policy = None
    if q.get("budget"):
        policy = next((p for p in policies if p.name == q["budget"]), None)
        if policy is None:
            raise UserError(f"budget: no policy {q['budget']!r} with a budget")
    tz = policy.timezone if policy else "UTC"
    try:
        period = ledger.Period.parse(q["period"], tz) if q.get("period") else None
    except ValueError as e:
        raise UserError(f"period: {e}") from None
    if period is None:
        period = (budget.period_of(policy, now) if policy else None) or ledger.Period.month(now, tz)
    gpu = q.get("gpu") or None
    scope = ledger.Scope(
        project=q.get("project") or None,
        owner=q.get("owner") or None,
        cloud=q.get("cloud") or None,
        gpu=gpu and gpu.upper(),
        covers=policy.applies_to.matches if policy else None,
    )
    r = reports.build(
        app,
        period,
        scope,
        by=by,
        title=policy.name if policy else q.get("project") or None,
        budget_policy=policy,
        language=language,
        now=now,
    )
    shown = standings(app, now, r) if budgets is None else budgets(r)
    local_today = now.astimezone(ZoneInfo(period.tz)).date()
    days = [d for d, _ in r.daily]
    today = days.index(local_today) if local_today in days and now < period.end else None
    if today is None and now < period.start:
        today = -1
    params = {
        k: q.get(k, "") for k in ("budget", "period", "by", "project", "owner", "cloud", "gpu")
    }
    return Spend(r, shown, policy, {k: v for k, v in params.items() if v}, today)


def month_choices(now: datetime, n: int = 4) -> list[str]:
    """This month and the ones before it, for the period picker."""
    y, m, out = now.year, now.month, []
    for _ in range(n):
        out.append(f"{y:04d}-{m:02d}")
        y, m = (y - 1, 12) if m == 1 else (y, m - 1)
    return out


def week_label(now: datetime) -> str:
    return ledger.Period.week(now).label


# --- one machine ---------------------------------------------------------------------------


@dataclass
class MachinePage:
    machine: Machine
    events: list[Event]
    intervals: list[tuple[UsageInterval, Money]]
    spent: list[Money]
    beats: list[Heartbeat]
    beats_start: datetime

    @property
    def points(self) -> list[tuple[datetime, float | None]]:
        return [(b.at, b.max_util) for b in self.beats]


def machine_page(app: App, now: datetime, key: str) -> MachinePage | None:
    """By id, else the newest machine of that name."""
    with app.db.session() as s:
        m = (
            s.get(Machine, key)
            or s.scalars(
                select(Machine).where(Machine.name == key).order_by(Machine.created_at.desc())
            ).first()
        )
        if m is None:
            return None
        events = list(
            s.scalars(select(Event).where(Event.machine_id == m.id).order_by(Event.id.desc()))
        )
        ivs = list(
            s.scalars(
                select(UsageInterval)
                .where(UsageInterval.machine_id == m.id)
                .order_by(UsageInterval.started_at.desc(), UsageInterval.kind)
            )
        )
        start = now - MACHINE_BEATS
        beats = list(
            s.scalars(
                select(Heartbeat)
                .where(Heartbeat.machine_id == m.id, Heartbeat.at >= start)
                .order_by(Heartbeat.at)
            )
        )
    end = now if m.terminated_at is None else max(m.terminated_at, now)
    costs = [(iv, Money(ledger.interval_cost(iv, iv.started_at, end), iv.currency)) for iv in ivs]
    spent = ledger.spend(ivs, m.created_at, end)
    # the sparkline spans the heartbeats kept (a day at most), not an empty day before them
    first = beats[0].at if beats else start
    return MachinePage(m, events, costs, [spent[c] for c in sorted(spent)], beats, first)


# --- plan ----------------------------------------------------------------------------------


@dataclass
class PlanPage:
    source: str
    plan: Any = None
    problems: list[str] = field(default_factory=list)


def plan_page(app: App, *, path: str | None = None, text: str | None = None) -> PlanPage:
    """``provisioner plan`` of a file or of pasted YAML; bad input is shown as the CLI says it
    (file, line, field)."""
    from policies import yamlfile
    from provisioner import planning
    from provisioner.errors import ConfigError
    from provisioner.spec import Experiment, load_experiment

    source = path or "pasted"
    try:
        if path:
            e = load_experiment(path)
        else:
            data, lines = yamlfile.load_document(source, text or "")
            e = yamlfile.validate(Experiment, data, lines, source, what="experiment file")
        return PlanPage(source, planning.plan(app, e))
    except ConfigError as err:
        return PlanPage(source, problems=[str(p) for p in err.problems])
    except ProvisionerError as err:
        return PlanPage(source, problems=[str(err)])


def experiment_files(app: App, dirs: list[str]) -> list[str]:
    """Files to pick from: the experiment files of ``dirs`` (settings) and those machines were
    launched from, when they still exist."""
    from pathlib import Path

    found: set[str] = set()
    for d in dirs:
        p = Path(d).expanduser()
        if p.is_dir():
            found.update(str(f) for f in p.glob("*.y*ml"))
        elif p.is_file():
            found.add(str(p))
    with app.db.session() as s:
        for (sp,) in s.execute(select(Machine.spec_path).where(Machine.spec_path.is_not(None))):
            if sp and Path(sp).is_file():
                found.add(str(Path(sp).resolve()))
    return sorted(found)
