"""report: spend against budget, forecast, top machines, idle waste, savings, rent or buy."""

from __future__ import annotations

import re
import sys
from enum import StrEnum
from typing import Any

import typer

from provisioner.cli import app, err, get_app, out, print_json
from provisioner.errors import UserError


class ReportOutput(StrEnum):
    table = "table"
    json = "json"
    csv = "csv"
    html = "html"


@app.command()
def report(
    ctx: typer.Context,
    period: str = typer.Option(
        None,
        help="2026-11, 2026-W48 or 2026-11-01..2026-11-15 (default: the budget's period, "
        "else this month)",
    ),
    project: str = typer.Option(None, help="one project (globs like 'nlp-*' work)"),
    owner: str = typer.Option(None, help="one owner (globs work)"),
    cloud: str = typer.Option(None),
    gpu: str = typer.Option(None, help="GPU type: A100, H100, T4…"),
    by: str = typer.Option(
        "project",
        "--by",
        help="group spend by project, owner, cloud, gpu, machine, team (settings.teams) or "
        "label:KEY (the experiment's label KEY)",
    ),
    policy: str = typer.Option(
        None,
        help="report what this policy's budget covers, against it (default: the budget of "
        "--project, against the project's spend)",
    ),
    currency: str = typer.Option(None, help="report in this currency (default: the budget's)"),
    language: str = typer.Option(None, help="en or ru (default: the budget's, else en)"),
    email: bool = typer.Option(
        False, "--email", help="mail it to the budget's recipients (or to --to)"
    ),
    to: list[str] = typer.Option(
        None, "--to", help="mail it to this address (repeat for several); implies --email"
    ),
    compare: bool = typer.Option(
        False,
        "--compare",
        help="the previous period beside it (the month, week or as many days before), per "
        "line and in total, with the change",
    ),
    output: ReportOutput = typer.Option(ReportOutput.table, "--output", "-o"),
) -> None:
    """Spend for a period: by project/owner/cloud/GPU/machine, against the budget, with the
    forecast to the period's end. Exact to the cent; amounts keep their currency until shown."""
    from provisioner.views import spend  # SQLAlchemy: not for --help

    recipients = [_address(a) for a in to or []]
    mail = email or bool(recipients)
    application = get_app(ctx)
    if mail:  # a what-if is shown, never mailed as the period's report
        from provisioner.realclock import require_real_clock

        require_real_clock(application, "report --email", "sends the report")
    if compare and output in (ReportOutput.csv, ReportOutput.html):
        raise UserError("--compare: shown in the table and in -o json, not in csv or html")
    q = spend.Query(period, project, owner, cloud, gpu, by, policy, currency, language, compare)
    v = spend.report(application, q)
    if mail:
        _mail(application, v.report, recipients or v.recipients)
    _write(v, output, table=not mail)


def _mail(application: Any, r: Any, recipients: list[str]) -> None:
    from provisioner import render

    render.email(application, r, recipients)
    err.print(f"sent “{render.subject(r)}” to {', '.join(recipients)}", highlight=False)


def _write(v: Any, output: ReportOutput, *, table: bool) -> None:
    """The report as ``output`` asks; a table only when it was not mailed instead."""
    from provisioner import render

    r = v.report
    if output is ReportOutput.json:
        print_json(v.as_json())
    elif output is not ReportOutput.table:
        sys.stdout.write(render.csv(r) if output is ReportOutput.csv else render.html_page(r))
    elif table:
        _table(r, v.previous)


_ADDRESS = re.compile(r"[^@\s<>,;\"]+@[^@\s<>,;\"]+\.[^@\s<>,;\".]+")


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _plain(text: str) -> str:
    """A name as the terminal shows it: a control character (an ANSI escape stored before
    names were checked at the spec boundary) as ``?``, never sent to a teammate's terminal."""
    return _CONTROL.sub("?", text)


def _address(text: str) -> str:
    """One email address (``ana@example.com``), else a usage error naming it."""
    if not _ADDRESS.fullmatch(text.strip()):
        raise UserError(f"--to: {text!r} is not an email address (write e.g. ana@example.com)")
    return text.strip()


def _table(r: Any, previous: Any = None) -> None:
    from provisioner import render  # as in report(): SQLAlchemy, not for --help

    f = render.fmt(r)
    _standing(r, f)
    if previous is not None:
        p = previous.report
        out.print(
            f"{f.t('previous')}: {f.period(p.period)} — {f.money(p.shown_total)}; "
            f"{f.t('change')} {previous.total.text(f)}",
            highlight=False,
        )
    out.print(_groups(r, f, previous))
    if r.top_machines:
        out.print(_top(r, f))
    saved = ", ".join(f"{f.reason(reason)} {f.money(m)}" for reason, m in r.savings) or f.t("none")
    out.print(f"{f.t('idle')}: {f.money(r.idle_waste)}", highlight=False)
    out.print(f"{f.t('savings')}: {saved}", highlight=False)
    if r.savings:
        out.print(f"  [dim]{f.t('savings_method')}[/]", highlight=False)
    if r.unpriced:
        out.print(f"{f.t('unpriced')}:", highlight=False)
        for u in r.unpriced:
            out.print("  " + render.unpriced_text(f, u), highlight=False)
    if r.answers is not None:
        _answers(r.answers, f)
    if r.rent_or_buy:
        out.print(f"[bold]{f.t('rent')}[/]")
        for o in r.rent_or_buy:
            out.print("  " + render.ownership_text(r, o), highlight=False)
        out.print(f"  [dim]{f.t('rule')}[/]")
    if r.rates:
        out.print(f"[dim]{f.t('rates')}: {r.rates}[/]", highlight=False)


def _standing(r: Any, f: Any) -> None:
    """The title, the total, and the budget's standing with its forecast (else the report's)."""
    from rich.markup import escape

    title = escape(_plain(str(r.title)))
    out.print(f"[bold]{f.t('report')}: {title}[/] — {f.period(r.period)}", highlight=False)
    billed = ""
    if r.billed_differs:  # only when it says more than the total: another currency, or several
        billed = f"  ({f.t('billed')} {' + '.join(f.money(m) for m in r.native.monies())})"
    out.print(f"{f.t('spent')}: [bold]{f.money(r.shown_total)}[/]{billed}", highlight=False)
    b = r.budget
    if b is not None:
        style = "red" if b.pct >= 100 else "yellow" if b.forecast_pct >= 100 else "green"
        out.print(
            f"{f.t('budget')} {b.policy.name}: {f.money(b.amount)} — [{style}]{f.pct(b.pct)}[/] "
            f"{f.t('of_budget')}; {f.t('forecast')}: {f.money(b.forecast)} "
            f"([{style}]{f.pct(b.forecast_pct)}[/]); {f.t('left')}: {f.money(b.left)}",
            highlight=False,
        )
    elif r.shown_forecast is not None:
        out.print(f"{f.t('forecast')}: {f.money(r.shown_forecast)}", highlight=False)


def _groups(r: Any, f: Any, previous: Any = None) -> Any:
    from rich.table import Table  # rich's tables only for a table: not for --help

    t = Table(title=f.t(r.by), show_footer=True)
    t.add_column(f.t(r.by), footer=f.t("total"))
    for kind, m in r.shown_by_kind.items():
        t.add_column(f.t(kind), justify="right", footer=f.money(m))
    t.add_column(f.t("total"), justify="right", footer=f.money(r.shown_total))
    if previous is not None:
        t.add_column(f.t("previous"), justify="right", footer=f.money(previous.total.before))
        t.add_column(f.t("change"), justify="right", footer=previous.total.text(f))
    for ln in r.lines:
        c = previous.line(ln.key) if previous is not None else None
        t.add_row(
            _plain(ln.key),
            *(f.money(ln.shown_by_kind[k]) if k in ln.shown_by_kind else "—" for k in r.by_kind),
            f.money(ln.shown),
            *((f.money(c.before), c.text(f)) if c is not None else ()),
        )
    for c in previous.only_before if previous is not None else []:
        t.add_row(
            _plain(c.key), *("—" for _ in r.by_kind), f.money(c.now), f.money(c.before),
            c.text(f),
        )  # fmt: skip
    return t


def _top(r: Any, f: Any) -> Any:
    from rich.table import Table

    top = Table(title=f.t("top"), show_footer=True)
    top.add_column("#", justify="right")
    top.add_column(f.t("machine"), footer=f.t("total"))
    top.add_column(f.t("owner"))
    top.add_column(f.t("gpu"))
    top.add_column(f.t("hours"), justify="right")
    top.add_column(f.t("rate"), justify="right")
    top.add_column(f.t("busy_share"), justify="right")  # GPU efficiency: busy ÷ paid
    top.add_column(f.t("total"), justify="right", footer=f.money(r.shown_total))
    gpu_time = r.answers.efficiency.machines if r.answers else {}
    for i, m in enumerate(r.top_machines, 1):
        t = gpu_time.get(m.key)
        top.add_row(
            str(i),
            _plain(m.key),
            _plain(m.owner),
            f.machine_gpu(m),
            f.num(m.hours, 1),
            ", ".join(f.rate(x) for x in m.rates) or "—",
            f.ratio(t.ratio if t else None),
            f.money(m.shown),
        )
    if r.other_machines:
        n, rest = r.other_machines
        top.add_row("", f.t("others", n=n), "", "", "", "", "", f.money(rest))
    return top


def _answers(a: Any, f: Any) -> None:
    """GPU efficiency (the whole, per project and owner) and unusual spend, each with its rule."""
    from rich.markup import escape

    from provisioner import render

    e = a.efficiency
    out.print(f"{f.t('gpu_efficiency')}: {render.efficiency_text(f, e.total)}", highlight=False)
    for title, rows in (("project", e.projects), ("owner", e.owners), ("budget", e.budgets)):
        for key, t in sorted(rows.items()):
            line = f"{f.t(title)} {escape(_plain(key))}: {render.efficiency_text(f, t)}"
            out.print("  " + line, highlight=False)
    out.print(f"  [dim]{f.t('gpu_efficiency_method')}[/]", highlight=False)
    out.print(f"{f.t('unusual_spend')}: {'' if a.unusual else f.t('none')}", highlight=False)
    for u in a.unusual:
        out.print("  [yellow]" + escape(_plain(render.unusual_text(f, u))) + "[/]", highlight=False)
    out.print(f"  [dim]{f.t('unusual_method')}[/]", highlight=False)
