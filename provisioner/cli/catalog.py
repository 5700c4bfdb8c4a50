"""catalog (GPUs and the cheapest offer per cloud), catalog refresh, check."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import typer

from provisioner.cli import (
    OUTPUT,
    Output,
    amount,
    app,
    err,
    get_app,
    out,
    print_json,
    text_table,
    write,
)

catalog_app = typer.Typer(
    help="GPUs and their cheapest offer per cloud; refresh prices.",
    invoke_without_command=True,
    no_args_is_help=False,
)
app.add_typer(catalog_app, name="catalog")


def _known_gpu(gpu: str) -> str:
    """``--gpu`` as a known type, or exit 2 with "did you mean" (as an experiment file gets)."""
    from provisioner.errors import UserError
    from provisioner.spec import GPU_TYPES, did_you_mean

    up = gpu.strip().upper()
    if up not in GPU_TYPES:
        raise UserError(f"--gpu: unknown GPU type {gpu!r}; {did_you_mean(up, GPU_TYPES)}")
    return up


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

    if gpu is not None:
        gpu = _known_gpu(gpu)
    application = get_app(ctx)
    rates = application.settings.money_rates
    clouds = shown_clouds(application.settings)
    best, seen = _cheapest(application.offers(clouds), gpu, rates)
    keys = sorted(best)
    shown = [o for row in best.values() for _, _, o in row.values()]
    stale = cat.stale(shown, application.clock.now().date())
    if output is Output.json:
        print_json([_offer_json(k, best[k]) for k in keys])
        for line in stale:
            err.print(f"note: {line}", highlight=False, soft_wrap=True)
        return
    out.print(
        f"GPU offers, cheapest per cloud (prices per hour; ranked in {rates.base})", soft_wrap=True
    )
    rows = [_offer_row(key, best[key], seen[key]) for key in keys]
    columns = [
        ("GPU", "<", 0),
        ("count", ">", 0),
        ("cloud", "<", 0),
        ("on-demand", ">", 0),
        ("where", "<", 2),
        ("spot", ">", 0),
        ("where", "<", 1),
    ]
    write(text_table(columns, rows))
    _print_sources(application.settings, clouds, rates, stale)


def _print_sources(settings: Any, clouds: list[str], rates: Any, stale: list[str]) -> None:
    """Under the table: the exchange rates, each cloud's data, and what is stale."""
    from provisioner import catalog as cat

    sources = {cl: cat.source_of(settings, cl).name for cl in clouds}
    out.print(
        f"[dim]{rates.describe()}; data: {', '.join(f'{k}={v}' for k, v in sources.items())}[/]",
        soft_wrap=True,
    )
    for line in stale:
        out.print(f"[yellow]note[/]: {line}", highlight=False, soft_wrap=True)


Cheapest = dict[tuple[str, int, str], dict[str, tuple]]


def _cheapest(
    offers: Iterable[Any], gpu: str | None, rates: Any
) -> tuple[Cheapest, dict[tuple[str, int, str], Any]]:
    """(gpu, count, cloud) → market → (price in the base currency, price, offer), of the offers
    of ``gpu`` (and its variants; None: every GPU); plus any offer of each."""
    from provisioner.money import Money

    best: Cheapest = {}
    seen: dict[tuple[str, int, str], Any] = {}
    for o in offers:
        if gpu and o.gpu.upper() != gpu.upper() and not o.gpu.upper().startswith(gpu.upper() + "-"):
            continue
        key = (o.gpu, o.gpu_count, o.cloud)
        seen.setdefault(key, o)
        row = best.setdefault(key, {})
        for market, value in (("reserved", o.price), ("spot", o.spot_price)):
            if value is None or not rates.can_convert(o.currency):
                continue
            price = Money(value, o.currency)
            base = rates.convert(price)
            if market not in row or base.amount < row[market][0].amount:
                row[market] = (base, price, o)
    return best, seen


def _offer_json(key: tuple[str, int, str], row: dict[str, tuple]) -> dict[str, Any]:
    g, n, cl = key
    return {
        "gpu": g,
        "gpu_count": n,
        "cloud": cl,
        **{
            m: {
                "price": amount(price.amount),
                "currency": price.currency,
                "instance_type": o.instance_type,
                "where": o.zone or o.region,
                "as_of": o.as_of,
            }
            for m, (_, price, o) in row.items()
        },
    }


def _offer_row(key: tuple[str, int, str], row: dict[str, tuple], any_offer: Any) -> list[str]:
    cells = []
    for market, missing in (("reserved", "no public price"), ("spot", "—")):
        if market in row:
            _, price, o = row[market]
            cells += [str(price), f"{o.zone or o.region} {o.instance_type}"]
        else:
            cells += [missing, any_offer.instance_type if market == "reserved" else ""]
    return [key[0], str(key[1]), key[2], *cells]


def shown_clouds(settings: Any) -> list[str]:
    """The enabled clouds; the simulated sandbox only when settings name it (it is on by
    default for the quickstart, but its prices are no market's)."""
    import providers

    explicit = "clouds" in settings.model_fields_set
    return [
        c
        for c in settings.enabled_clouds
        if explicit or not (c in providers.REGISTRY and providers.spec(c).simulated)
    ]


@catalog_app.command("refresh")
def refresh(
    ctx: typer.Context,
    cloud: str = typer.Option(..., "--cloud", help="the cloud, as named in settings"),
) -> None:
    """Rebuild one cloud's offers from its price source; the old data stays if it fails.
    AWS (Price List API) and Yandex (billing API) need the cloud's credentials, GCP an API key
    in PROVISIONER_GCP_API_KEY, SberCloud its AK/SK (flavors only, no prices); Azure's Retail
    Prices API is public."""
    import providers
    from providers.base import AuthError, ProviderError
    from provisioner import catalog as cat
    from provisioner import catalog_checks
    from provisioner.errors import OperationFailed, UserError

    application = get_app(ctx)
    if cloud not in providers.REGISTRY:
        raise UserError(
            f"--cloud {cloud!r}: no such cloud (one of {', '.join(providers.REGISTRY)})"
        )
    source = providers.spec(cloud).prices_from
    err.print(f"{cloud}: reading {source}", highlight=False, soft_wrap=True)
    try:
        offers = application.provider(cloud).fetch_offers()
        today = application.clock.now().date().isoformat()
        flagged: list[Any] = []
        path = cat.refresh(application.settings, cloud, offers, as_of=today, findings=flagged)
    except NotImplementedError:
        raise UserError(f"{cloud} has no price source to refresh: {source}") from None
    except AuthError as e:
        raise OperationFailed(
            f"{cloud}: price refresh needs credentials ({source}): {e}; the old catalog stays"
        ) from None
    except (ProviderError, ValueError, OSError) as e:
        raise OperationFailed(
            f"{cloud}: price refresh failed, keeping the old catalog: {e}"
        ) from None
    out.print(f"{cloud}: {len(offers):,} offers written to {path}", soft_wrap=True)
    if flagged:
        counts = ", ".join(f"{k} {n}" for k, n in catalog_checks.summary(flagged).items())
        err.print(
            f"{cloud}: {len(flagged)} prices failed the catalog checks and were emptied "
            f"({counts}), e.g. {flagged[0]}",
            highlight=False,
            soft_wrap=True,
        )


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
        if any(r.ok and r.cloud == "aws" for r in results):  # for `provisioner bill`; on
            from providers.aws.billing import ACTIVATE  # stderr: stdout is one line per cloud

            err.print(f"note: {escape(ACTIVATE)}", highlight=False, soft_wrap=True)
    if not any(r.ok for r in results):  # nothing can be launched: a script must notice
        raise OperationFailed(
            f"no cloud can be used: all {len(results)} failed the check"
            if results
            else "no cloud is enabled in settings (clouds:)"
        )
