"""The catalog's commands: each GPU's cheapest offer per cloud and market (``catalog``), one
cloud's prices rebuilt from its source (``catalog refresh``), each cloud's credentials checked
(``check``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import providers
from providers.base import AuthError, CheckResult, Offer, ProviderError
from provisioner import catalog, catalog_checks
from provisioner.app import App
from provisioner.errors import OperationFailed, ProvisionerError, UserError
from provisioner.money import Money

Market = Literal["reserved", "spot"]


@dataclass(frozen=True)
class Best:
    """A market's cheapest offer of one GPU, count and cloud."""

    price: Money  # in the offer's currency
    offer: Offer


@dataclass(frozen=True)
class Row:
    gpu: str
    gpu_count: int
    cloud: str
    best: dict[Market, Best]  # only the markets priced
    any_offer: Offer  # one offer of it, priced or not (its instance type names it)


@dataclass(frozen=True)
class Cheapest:
    rows: list[Row]  # by GPU, count, cloud
    clouds: list[str]  # the clouds shown
    sources: dict[str, str]  # cloud → its price data's name
    stale: list[str]  # notes on price data that is old
    rates: Any  # the settings' money rates: the base currency, how they convert


def cheapest(app: App, gpu: str | None = None) -> Cheapest:
    """Each GPU's (``gpu``: only that type and its variants) cheapest offer per cloud and
    market, compared in the settings' base currency."""
    rates = app.settings.money_rates
    clouds = shown_clouds(app.settings)
    best: dict[tuple[str, int, str], dict[Market, tuple[Money, Best]]] = {}
    seen: dict[tuple[str, int, str], Offer] = {}
    for o in app.offers(clouds):
        if not _wanted(o, gpu):
            continue
        key = (o.gpu, o.gpu_count, o.cloud)
        seen.setdefault(key, o)
        _consider(best.setdefault(key, {}), o, rates)
    rows = [Row(*key, {m: b for m, (_, b) in best[key].items()}, seen[key]) for key in sorted(best)]
    shown = [b.offer for r in rows for b in r.best.values()]
    return Cheapest(
        rows,
        clouds,
        {cl: catalog.source_of(app.settings, cl).name for cl in clouds},
        catalog_checks.stale(shown, app.clock.now().date()),
        rates,
    )


def _consider(row: dict[Market, tuple[Money, Best]], o: Offer, rates: Any) -> None:
    """``o`` in ``row`` in each market it is priced in, when cheaper there (in the base
    currency, kept beside it) than the offer there before."""
    market: Market
    for market, value in (("reserved", o.price), ("spot", o.spot_price)):
        if value is None or not rates.can_convert(o.currency):
            continue
        price = Money(value, o.currency)
        base = rates.convert(price)
        if market not in row or base.amount < row[market][0].amount:
            row[market] = (base, Best(price, o))


def _wanted(o: Offer, gpu: str | None) -> bool:
    """``o`` is of GPU type ``gpu`` or one of its variants (``A100-80GB`` of ``A100``)."""
    if not gpu:
        return True
    g, want = o.gpu.upper(), gpu.upper()
    return g == want or g.startswith(want + "-")


def shown_clouds(settings: Any) -> list[str]:
    """The enabled clouds; the simulated sandbox only when settings name it (it is on by
    default for the quickstart, but its prices are no market's)."""
    explicit = "clouds" in settings.model_fields_set
    return [
        c
        for c in settings.enabled_clouds
        if explicit or not (c in providers.REGISTRY and providers.spec(c).simulated)
    ]


@dataclass(frozen=True)
class Refreshed:
    cloud: str
    offers: int  # how many were written
    path: Path
    flagged: list[Any] = field(default_factory=list)  # prices the checks emptied

    @property
    def flagged_counts(self) -> dict[str, int]:
        return catalog_checks.summary(self.flagged)


def refresh(app: App, cloud: str, reading: Callable[[str], None] = lambda _: None) -> Refreshed:
    """Rebuild ``cloud``'s offers from its price source (``reading`` is told which, first);
    the old data stays if it fails (:class:`OperationFailed`, saying why)."""
    if cloud not in providers.REGISTRY:
        raise UserError(
            f"--cloud {cloud!r}: no such cloud (one of {', '.join(providers.REGISTRY)})"
        )
    source = providers.spec(cloud).prices_from
    reading(source)
    try:
        offers = app.provider(cloud).fetch_offers()
        as_of = app.clock.now().date().isoformat()
        flagged: list[Any] = []
        path = catalog.refresh(app.settings, cloud, offers, as_of=as_of, findings=flagged)
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
    return Refreshed(cloud, len(offers), path, flagged)


def check(app: App) -> list[CheckResult]:
    """Each enabled cloud's credentials checked, one result per cloud; a cloud that cannot be
    checked says why (a missing SDK names its extra), never hiding the others."""
    results = []
    for cloud in app.settings.enabled_clouds:
        try:
            results.append(app.provider(cloud).check())
        except ProvisionerError as e:  # its SDK is not installed: the message names the extra
            results.append(CheckResult(cloud, False, str(e)))
        except Exception as e:  # a broken SDK install must not hide the other clouds
            results.append(CheckResult(cloud, False, f"cannot check: {type(e).__name__}: {e}"))
    return results
