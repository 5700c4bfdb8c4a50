"""catalog (GPUs and the cheapest offer per cloud), catalog refresh, check."""

from __future__ import annotations

from typing import Any

import typer

from provisioner.cli import (
    OUTPUT,
    Output,
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
    from provisioner.workflows import catalog as flow  # the catalog, SDK specs: not for --help

    if gpu is not None:
        gpu = _known_gpu(gpu)
    c = flow.cheapest(get_app(ctx), gpu)
    if output is Output.json:
        print_json([_row_json(r) for r in c.rows])
        for line in c.stale:
            err.print(f"note: {line}", highlight=False, soft_wrap=True)
        return
    out.print(
        f"GPU offers, cheapest per cloud (prices per hour; ranked in {c.rates.base})",
        soft_wrap=True,
    )
    write(text_table(_COLUMNS, [_row_text(r) for r in c.rows]))
    data = ", ".join(f"{k}={v}" for k, v in c.sources.items())
    out.print(
        f"[dim]{c.rates.describe()}; data: {data}[/]",
        soft_wrap=True,
    )
    for line in c.stale:
        out.print(f"[yellow]note[/]: {line}", highlight=False, soft_wrap=True)


_COLUMNS = [
    ("GPU", "<", 0),
    ("count", ">", 0),
    ("cloud", "<", 0),
    ("on-demand", ">", 0),
    ("where", "<", 2),
    ("spot", ">", 0),
    ("where", "<", 1),
]


def _row_json(r: Any) -> dict[str, Any]:
    return {
        "gpu": r.gpu,
        "gpu_count": r.gpu_count,
        "cloud": r.cloud,
        **{
            market: {
                "price_per_hour": b.price.as_json(),
                "instance_type": b.offer.instance_type,
                "where": b.offer.zone or b.offer.region,
                "as_of": b.offer.as_of or None,  # a row with no date: not known
            }
            for market, b in r.best.items()
        },
    }


def _row_text(r: Any) -> list[str]:
    cells = [r.gpu, str(r.gpu_count), r.cloud]
    for market, missing in (("reserved", "no public price"), ("spot", "—")):
        if market in r.best:
            b = r.best[market]
            cells += [str(b.price), f"{b.offer.zone or b.offer.region} {b.offer.instance_type}"]
        else:
            cells += [missing, r.any_offer.instance_type if market == "reserved" else ""]
    return cells


@catalog_app.command("refresh")
def refresh(
    ctx: typer.Context,
    cloud: str = typer.Option(..., "--cloud", help="the cloud, as named in settings"),
) -> None:
    """Rebuild one cloud's offers from its price source; the old data stays if it fails.
    AWS (Price List API) and Yandex (billing API) need the cloud's credentials, GCP an API key
    in PROVISIONER_GCP_API_KEY, SberCloud its AK/SK (flavors only, no prices); Azure's Retail
    Prices API is public."""
    from provisioner.workflows import catalog as flow  # the catalog, SDK specs: not for --help

    def reading(source: str) -> None:
        err.print(f"{cloud}: reading {source}", highlight=False, soft_wrap=True)

    done = flow.refresh(get_app(ctx), cloud, reading)
    out.print(f"{cloud}: {done.offers:,} offers written to {done.path}", soft_wrap=True)
    if done.flagged:
        counts = ", ".join(f"{k} {n}" for k, n in done.flagged_counts.items())
        err.print(
            f"{cloud}: {len(done.flagged)} prices failed the catalog checks and were emptied "
            f"({counts}), e.g. {done.flagged[0]}",
            highlight=False,
            soft_wrap=True,
        )


@app.command()
def check(ctx: typer.Context, output: Output = OUTPUT) -> None:
    """Which clouds have working credentials, and what is missing — one line per cloud."""
    from provisioner.errors import OperationFailed
    from provisioner.workflows import catalog as flow  # the SDK specs: not for --help

    results = flow.check(get_app(ctx))
    if output is Output.json:
        print_json([r.__dict__ for r in results])
    else:
        _check_text(results)
    if not any(r.ok for r in results):  # nothing can be launched: a script must notice
        raise OperationFailed(
            f"no cloud can be used: all {len(results)} failed the check"
            if results
            else "no cloud is enabled in settings (clouds:)"
        )


def _check_text(results: list[Any]) -> None:
    from rich.markup import escape

    for r in results:
        mark = "[green]ok[/]  " if r.ok else "[red]no[/]  "
        message = r.message.removeprefix(f"{r.cloud}: ")
        out.print(f"{mark}{r.cloud:<10} {escape(message)}", highlight=False, soft_wrap=True)
    if any(r.ok and r.cloud == "aws" for r in results):  # for `provisioner bill`; on
        from providers.aws.billing import ACTIVATE  # stderr: stdout is one line per cloud

        err.print(f"note: {escape(ACTIVATE)}", highlight=False, soft_wrap=True)
