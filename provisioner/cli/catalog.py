"""catalog (GPUs and the cheapest offer per cloud), catalog refresh, check."""

from __future__ import annotations

import typer
from rich.table import Table

from provisioner.cli import OUTPUT, Output, app, get_app, out, print_json

catalog_app = typer.Typer(
    help="GPUs and their cheapest offer per cloud; refresh prices.",
    invoke_without_command=True,
    no_args_is_help=False,
)
app.add_typer(catalog_app, name="catalog")


@catalog_app.callback()
def catalog(
    ctx: typer.Context,
    gpu: str = typer.Option(None, help="only this GPU type (A100, H100, T4…)"),
    output: Output = OUTPUT,
) -> None:
    """GPUs and the cheapest offer per cloud (on-demand and spot), like `sky show-gpus`."""
    if ctx.invoked_subcommand:
        return
    from provisioner import catalog as cat

    application = get_app(ctx)
    rates = application.settings.money_rates
    best: dict[tuple[str, int, str], dict[str, tuple]] = {}
    for o in application.offers():
        if gpu and o.gpu.upper() != gpu.upper() and not o.gpu.upper().startswith(gpu.upper() + "-"):
            continue
        row = best.setdefault((o.gpu, o.gpu_count, o.cloud), {})
        for market, amount in (("reserved", o.price), ("spot", o.spot_price)):
            if amount is None or not rates.can_convert(o.currency):
                continue
            from provisioner.money import Money

            base = rates.convert(Money(amount, o.currency))
            if market not in row or base.amount < row[market][0].amount:
                row[market] = (base, Money(amount, o.currency), o)
        row.setdefault("_any", (None, None, o))
    keys = sorted(best, key=lambda k: (k[0], k[1], k[2]))
    if output is Output.json:
        print_json(
            [
                {
                    "gpu": g,
                    "gpu_count": n,
                    "cloud": cl,
                    **{
                        m: {
                            "price": str(best[(g, n, cl)][m][1].amount),
                            "currency": best[(g, n, cl)][m][1].currency,
                            "instance_type": best[(g, n, cl)][m][2].instance_type,
                            "where": best[(g, n, cl)][m][2].zone or best[(g, n, cl)][m][2].region,
                        }
                        for m in ("reserved", "spot")
                        if m in best[(g, n, cl)]
                    },
                }
                for g, n, cl in keys
            ]
        )
        return
    t = Table(title=f"GPU offers, cheapest per cloud (prices per hour; ranked in {rates.base})")
    for col in ("GPU", "count", "cloud", "on-demand", "where", "spot", "where"):
        t.add_column(col)
    for g, n, cl in keys:
        row = best[(g, n, cl)]
        cells = []
        for market in ("reserved", "spot"):
            if market in row:
                _, money, o = row[market]
                cells += [str(money), f"{o.zone or o.region} {o.instance_type}"]
            else:
                cells += [
                    "no public price" if market == "reserved" else "—",
                    row["_any"][2].instance_type if market == "reserved" else "",
                ]
        t.add_row(g, str(n), cl, *cells)
    out.print(t)
    sources = {
        cl: cat.source_of(application.settings, cl).name
        for cl in application.settings.enabled_clouds
    }
    out.print(
        f"[dim]{rates.describe()}; data: {', '.join(f'{k}={v}' for k, v in sources.items())}[/]"
    )


@catalog_app.command("refresh")
def refresh(
    ctx: typer.Context,
    cloud: str = typer.Option(..., "--cloud", help="aws, gcp, azure, yandex or sbercloud"),
) -> None:
    """Rebuild one cloud's offers from its public price source; the old data stays if it fails."""
    from providers.base import ProviderError
    from provisioner import catalog as cat
    from provisioner.errors import OperationFailed

    application = get_app(ctx)
    try:
        offers = application.provider(cloud).fetch_offers()
        path = cat.refresh(application.settings, cloud, offers)
    except (ProviderError, NotImplementedError, ValueError, OSError) as e:
        raise OperationFailed(
            f"{cloud}: price refresh failed, keeping the old catalog: {e}"
        ) from None
    out.print(f"{cloud}: {len(offers)} offers written to {path}")


@app.command()
def check(ctx: typer.Context, output: Output = OUTPUT) -> None:
    """Which clouds have working credentials, and what is missing — one line per cloud."""
    from providers.base import CheckResult

    application = get_app(ctx)
    results = []
    for cloud in application.settings.enabled_clouds:
        try:
            results.append(application.provider(cloud).check())
        except Exception as e:  # a broken SDK install must not hide the other clouds
            results.append(CheckResult(cloud, False, f"cannot check: {type(e).__name__}: {e}"))
    if output is Output.json:
        print_json([r.__dict__ for r in results])
        return
    for r in results:
        mark = "[green]ok[/]  " if r.ok else "[red]no[/]  "
        message = r.message.removeprefix(f"{r.cloud}: ")
        out.print(f"{mark}{r.cloud:<10} {message}", highlight=False, soft_wrap=True)
