"""catalog (GPUs and the cheapest offer per cloud), catalog refresh, check."""

from __future__ import annotations

from typing import Any

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
    from provisioner.money import Money

    application = get_app(ctx)
    rates = application.settings.money_rates
    # (gpu, count, cloud) → market → (price in the base currency, price, offer); plus any offer
    best: dict[tuple[str, int, str], dict[str, tuple]] = {}
    seen: dict[tuple[str, int, str], Any] = {}
    for o in application.offers():
        if gpu and o.gpu.upper() != gpu.upper() and not o.gpu.upper().startswith(gpu.upper() + "-"):
            continue
        key = (o.gpu, o.gpu_count, o.cloud)
        seen.setdefault(key, o)
        row = best.setdefault(key, {})
        for market, amount in (("reserved", o.price), ("spot", o.spot_price)):
            if amount is None or not rates.can_convert(o.currency):
                continue
            price = Money(amount, o.currency)
            base = rates.convert(price)
            if market not in row or base.amount < row[market][0].amount:
                row[market] = (base, price, o)
    keys = sorted(best)
    if output is Output.json:
        print_json(
            [
                {
                    "gpu": g,
                    "gpu_count": n,
                    "cloud": cl,
                    **{
                        m: {
                            "price": str(price.amount),
                            "currency": price.currency,
                            "instance_type": o.instance_type,
                            "where": o.zone or o.region,
                        }
                        for m, (_, price, o) in best[(g, n, cl)].items()
                    },
                }
                for g, n, cl in keys
            ]
        )
        return
    t = Table(title=f"GPU offers, cheapest per cloud (prices per hour; ranked in {rates.base})")
    for col in ("GPU", "count", "cloud", "on-demand", "where", "spot", "where"):
        t.add_column(col)
    for key in keys:
        row = best[key]
        cells = []
        for market, missing in (("reserved", "no public price"), ("spot", "—")):
            if market in row:
                _, price, o = row[market]
                cells += [str(price), f"{o.zone or o.region} {o.instance_type}"]
            else:
                cells += [missing, seen[key].instance_type if market == "reserved" else ""]
        t.add_row(key[0], str(key[1]), key[2], *cells)
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
    cloud: str = typer.Option(..., "--cloud", help="the cloud, as named in settings"),
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
    from rich.markup import escape

    from providers.base import CheckResult
    from provisioner.errors import OperationFailed, ProvisionerError

    application = get_app(ctx)
    results = []
    for cloud in application.settings.enabled_clouds:
        try:
            results.append(application.provider(cloud).check())
        except ProvisionerError as e:  # its SDK is not installed: the message names the extra
            results.append(CheckResult(cloud, False, str(e)))
        except Exception as e:  # a broken SDK install must not hide the other clouds
            results.append(CheckResult(cloud, False, f"cannot check: {type(e).__name__}: {e}"))
    if output is Output.json:
        print_json([r.__dict__ for r in results])
    else:
        for r in results:
            mark = "[green]ok[/]  " if r.ok else "[red]no[/]  "
            message = r.message.removeprefix(f"{r.cloud}: ")
            out.print(f"{mark}{r.cloud:<10} {escape(message)}", highlight=False, soft_wrap=True)
    if not any(r.ok for r in results):  # nothing can be launched: a script must notice
        raise OperationFailed(
            f"no cloud can be used: all {len(results)} failed the check"
            if results
            else "no cloud is enabled in settings (clouds:)"
        )
