"""The dashboard's frame: pages rendered from Jinja2 templates (``provisioner/templates/
dashboard/``) with the report's own words and number formats (:mod:`provisioner.render`) in the
visitor's language, its times in the team's zone, and what several requests share (a cache by
slices of the app's clock).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any, Self
from zoneinfo import ZoneInfo

from provisioner import render
from provisioner.app import App
from provisioner.dashboard import pages, svg
from provisioner.dashboard.wsgi import Request, Response, safe_back, static_url
from provisioner.money import Money

TEMPLATES = Path(__file__).resolve().parent.parent / "templates" / "dashboard"
LANG_COOKIE = "provisioner_lang"
CACHE_ENTRIES = 64


class Site:
    """What every page of the dashboard needs: the app, its language, cache and templates."""

    def __init__(
        self, app: App, *, token: str | None, open_access: bool, hosts: Iterable[str] = ()
    ) -> None:
        self.app = app
        self.token = token
        self.open = open_access
        self.hosts = list(hosts)
        self.env = _env()
        self._cache: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def warm(self) -> Self:
        """Every template compiled and each language's words and number formats read, as a
        server does before it listens (the fleet's templates take 0.13 s, the rest 0.04 s,
        else paid by the first visitor)."""
        for name in sorted(p.name for p in TEMPLATES.glob("*.html")):
            self.env.get_template(name)
        for lang in render.LOCALES:
            render.messages(lang)
            render.Fmt(lang).money(Money(Decimal(0), self.app.settings.currency))
        return self

    @staticmethod
    def _secure(req: Request) -> str:
        return "; Secure" if req.environ.get("wsgi.url_scheme") == "https" else ""

    def language(self, req: Request) -> str:
        chosen = req.cookies.get(LANG_COOKIE) or self.app.settings.dashboard.language
        if chosen in render.LOCALES:
            return chosen
        return accept_language(req.environ.get("HTTP_ACCEPT_LANGUAGE", ""))

    def set_language(self, req: Request) -> Response:
        to = req.query.get("to", "")
        back = safe_back(req.query.get("back", "/"))
        headers = [("Location", req.root + back)]
        if to in render.LOCALES:
            headers.append(
                ("Set-Cookie", f"{LANG_COOKIE}={to}; Path={req.root or '/'}; SameSite=Strict")
            )
        return Response(status=303, headers=headers)

    def t(self, req: Request, key: str, **kw: Any) -> str:
        return render.Fmt(self.language(req)).t(key, **kw)

    # --- pages ----------------------------------------------------------------------------

    def now(self) -> datetime:
        return self.app.clock.now()

    def cached(self, key: Any, seconds: int, make: Callable[[], Any]) -> Any:
        """``make()``, shared by the requests of the same ``seconds``-long slice of the app's
        clock: a team's browsers refreshing the fleet, or the CSV after its page, cost one
        pass over the ledger, not one each."""
        k = (key, int(self.now().timestamp() // seconds))
        with self._lock:
            if k in self._cache:
                return self._cache[k]
        value = make()
        with self._lock:
            if len(self._cache) >= CACHE_ENTRIES:
                self._cache.clear()
            self._cache[k] = value
        return value

    def page(
        self, req: Request, name: str, status: int = 200, tz: ZoneInfo | None = None, **kw: Any
    ) -> Response:
        """``name`` rendered; its times in ``tz``, else the team's (:attr:`App.zone`)."""
        lang = self.language(req)
        f = render.Fmt(lang)
        here = req.path + (
            ("?" + req.environ["QUERY_STRING"]) if req.environ.get("QUERY_STRING") else ""
        )
        zone = tz or self.app.zone
        html = self.env.get_template(name).render(
            f=f,
            rate=lambda amount, currency: rate_text(f, amount, currency),
            hourly=lambda mo: f.t("per_hour", amount=f.money(mo)),  # an amount: `status`'s cents
            percent=lambda util: _percent(int(util), lang),
            t=f.t,
            lang=lang,
            req=req,
            url=req.url,
            static=lambda name: static_url(req, name),
            here=here,
            csrf=req.csrf,
            auth=not self.open or req.user is not None,  # a way out: log out
            now=self.now(),
            when=lambda at, tz=None: pages.when(f, at, self.now(), tz or zone),
            at=lambda at, tz=None: _at(pages.when(f, at, self.now(), tz or zone), at),
            utc=_utc,
            svg=svg,
            **kw,
        )
        return Response(html, status)


def accept_language(header: str) -> str:
    """The first of our languages the browser asks for (by q weight), else English."""
    best, best_q = "en", -1.0
    for i, part in enumerate(header.split(",")):
        tag, _, params = part.strip().partition(";")
        q = 1.0
        if params.strip().startswith("q="):
            try:
                q = float(params.strip()[2:])
            except ValueError:
                q = 0.0
        lang = tag.strip().lower().split("-")[0]
        if lang in render.LOCALES and q - i * 1e-6 > best_q:
            best, best_q = lang, q - i * 1e-6
    return best


def _utc(at: datetime) -> str:
    return at.astimezone(ZoneInfo("UTC")).strftime("%Y-%m-%d %H:%M UTC")


def _at(text: str, at: datetime) -> Any:
    """A time in the team's zone, the same instant in UTC on hover."""
    from markupsafe import Markup, escape

    iso, utc = escape(at.isoformat()), escape(_utc(at))
    return Markup(f'<time datetime="{iso}" title="{utc}">{escape(text)}</time>')


def rate_text(f: render.Fmt, amount: Any, currency: str | None) -> str:
    """A rate per hour: to 1/100 of a cent, so a disk's 0.0068 USD/h is not shown as 0.01."""
    if amount is None or not currency:
        return "—"
    return _rate(Decimal(amount), currency, f.language)


@functools.lru_cache(maxsize=512)
def _percent(util: int, language: str) -> str:
    """A GPU's utilisation, ``87 %``: a hundred values, each formatted once."""
    return f"{render.Fmt(language).num(util)} %"


@functools.lru_cache(maxsize=1024)
def _rate(amount: Decimal, currency: str, language: str) -> str:
    """A fleet shows a handful of rates a thousand times: each is formatted once."""
    from babel.numbers import format_currency

    f = render.Fmt(language)
    d = amount.quantize(Decimal("0.0001"), ROUND_HALF_UP).normalize()
    text = format_currency(d, currency, locale=f.locale, decimal_quantization=False)
    return f.t("per_hour", amount=text)


def _reason(reason: str, t: Callable[..., str]) -> str:
    """An event reason in the page's words (the scheduler's own name when it has none)."""
    return _word(reason, t, "dash_reason_")


def _word(value: str, t: Callable[..., str], prefix: str) -> str:
    """A state, market or event name in the page's words (its own name when it has none)."""
    try:
        return t(f"{prefix}{value}")
    except KeyError:
        return value


def _code(text: str) -> Any:
    """A catalog text's `…` spans (a command to type) as ``<code>``, the rest escaped."""
    from markupsafe import Markup, escape

    parts = str(escape(text)).split("`")
    return Markup("".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts)))


def _env() -> Any:
    from jinja2 import Environment, FileSystemLoader, StrictUndefined

    env = Environment(
        loader=FileSystemLoader(TEMPLATES),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["money"] = lambda amount, currency: Money(amount, currency)
    env.filters["reason"] = _reason
    env.filters["word"] = _word
    env.filters["code"] = _code
    # the vocabularies, so a template compares a status with its member, as the code does
    from provisioner.schema import DeliveryStatus, MachineStatus
    from provisioner.views.alerts import UNSENT

    env.globals.update(S=MachineStatus, D=DeliveryStatus, UNSENT=UNSENT)
    return env
