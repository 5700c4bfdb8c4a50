"""bill: the ledger beside each cloud's own bill, with every difference's reason."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import typer

from provisioner.cli import OUTPUT, Output, app, get_app, print_json, text_table, write

REASON_TEXT = {
    "credit": "credit/discount",
    "tax": "tax",
    "unpriced": "not priced by the ledger",
    "drift": "price drift",
    "not_billed_yet": "not billed yet",
    "untagged": "untagged",
}


class BillBy(StrEnum):
    machine = "machine"
    project = "project"
    day = "day"


@app.command("bill")
def bill_command(
    ctx: typer.Context,
    period: str = typer.Option(
        None, help="2026-11, 2026-W48 or 2026-11-01..2026-11-15 (default: this month)"
    ),
    cloud: str = typer.Option(None, help="one cloud (default: every enabled cloud)"),
    by: BillBy = typer.Option(BillBy.machine, "--by", help="one row per machine, project or day"),
    output: Output = OUTPUT,
) -> None:
    """What each cloud billed against what the ledger counted: per machine, project or day,
    with the reason for every difference (credit, tax, an item the ledger does not price,
    price drift, not billed yet, untagged), and instance types whose billed price is off the
    catalog by more than 2 %."""
    from provisioner import bill  # SQLAlchemy, the clouds' SDKs: not for --help

    report = bill.bill(get_app(ctx), period, cloud, by.value)
    if output is Output.json:
        print_json(report.as_json())
        return
    _table(report)


def _table(report: Any) -> None:
    from provisioner import bill

    write(f"bill {report.period.label}, by {report.by}")
    for c in report.clouds:
        through = c.through.isoformat() if c.through else "nothing billed yet"
        write(f"\n{c.cloud}: billed by the cloud through {through} ({c.source})")
        rows = bill.rounded(c.lines)
        table = [
            [
                r["key"],
                r["billed"].text(),
                r["ledger"].text(),
                r["difference"].text(sign=True),
                "; ".join(f"{REASON_TEXT[k]} {v.text(sign=True)}" for k, v in r["reasons"].items()),
            ]
            for r in rows
        ]
        for t in bill.totals(rows).values():
            table.append(
                [
                    "total",
                    t["billed"].text(),
                    t["ledger"].text(),
                    t["difference"].text(sign=True),
                    "",
                ]
            )
        cols = [(report.by, "<", 0), ("billed", ">", 0), ("ledger", ">", 0)]
        cols += [("difference", ">", 0), ("why", "<", 0)]
        write(text_table(cols, table, max_width=10_000))
        write(f"lag: {c.lag}")
        if c.drift:
            write(
                f"price drift: {len(c.drift)} billed price(s) differ from the catalog by more "
                f"than {bill.DRIFT_PCT} % — `provisioner catalog refresh` fixes them:"
            )
            for d in c.drift:
                write(
                    f"  {d.machine}: {d.instance_type} {d.market} in {d.region}: billed "
                    f"{_unit(d.unit_price)}/h, catalog {d.catalog} {d.currency}/h "
                    f"({d.pct:+.1f} %)"
                )
        for note in c.notes:
            write(f"note: {note}")
    for cloud, why in report.unsupported.items():
        write(f"\n{cloud}: not supported: {why}")
    for cloud, why in report.skipped.items():
        write(f"{cloud}: skipped, no credentials: {why}")
    if not report.clouds and not report.unsupported and not report.skipped:
        write("no cloud that sends a bill is enabled in settings (clouds:)")


def _unit(price: Any) -> str:
    """A unit price per hour to 1/100 of a cent, its places kept (``3.2130 USD``)."""
    return f"{price.amount:.4f} {price.currency}"
