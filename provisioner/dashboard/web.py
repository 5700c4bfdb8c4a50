"""The dashboard as a WSGI application: routing, the login, headers, and the pages rendered
from Jinja2 templates (``provisioner/templates/dashboard/``) with the report's own words and
number formats (:mod:`provisioner.render`).

Access: on a loopback address anyone on this computer may look. Bound wider, every request
needs the token (``dashboard.token`` in settings or ``$PROVISIONER_DASHBOARD_TOKEN``): entered
once on the login form, it becomes an HttpOnly, SameSite=Strict session cookie signed with the
token (so it survives restarts and several workers, and dies when the token changes); scripts
may send it as ``Authorization: Bearer`` (a wrong one: 401). It never appears in a page or a URL.
Guessing is slowed per client (:class:`Throttle`: five wrong tokens a minute, then 429): per
address, except for a browser that has logged in before, which holds a signed device cookie and
is counted on its own, so a guesser behind a team's proxy does not lock the team out (OWASP,
https://owasp.org/www-community/Slow_Down_Online_Guessing_Attacks_with_Device_Cookies).

Against other sites and rebinding names, open or not: a request naming a host other than an IP
address, ``localhost`` or one of ``dashboard.hosts`` is refused (421: a DNS-rebinding page
names its own host); every POST must come from this site (``Origin``/``Referer``) and carry
the form's CSRF token, the double of a SameSite=Strict cookie (OWASP, https://cheatsheetseries.
owasp.org/cheatsheets/Cross-Site_Request_Forgery_Prevention_Cheat_Sheet.html), unless it
authenticates with a Bearer token (which no browser adds by itself).

Acting (a machine page's forms, :meth:`Dashboard.act`): the CLI's own calls, as the signed-in
user (:func:`provisioner.acting.acting_as`: this request's thread only), allowed to the
machine's owner and to whom a policy grants ``act_as`` over them.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import logging
import math
import mimetypes
import os
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal
from http import HTTPStatus
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit
from zoneinfo import ZoneInfo

from policies.schema import matching
from provisioner import acting, bill, budget, render, reports, tokens
from provisioner.app import App
from provisioner.dashboard import pages, svg
from provisioner.errors import ProvisionerError
from provisioner.identity import SCHEDULER, email_of, grants
from provisioner.models import Token
from provisioner.money import Money
from provisioner.views import alerts as alerts_view
from provisioner.views import fleet as fleet_view
from provisioner.views import plan as plan_view
from provisioner.views import spend as spend_view

log = logging.getLogger("provisioner.dashboard")

TEMPLATES = Path(__file__).resolve().parent.parent / "templates" / "dashboard"
STATIC = Path(__file__).resolve().parent.parent / "static" / "dashboard"
COOKIE = "provisioner_session"
SHARED = "dashboard.token"  # the user of the shared token (settings), whoever holds it
LANG_COOKIE = "provisioner_lang"
CSRF_COOKIE = "provisioner_csrf"
DEVICE_COOKIE = "provisioner_device"
FLASH_COOKIE = "provisioner_done"  # what a machine page's action did, said once on the page
SESSION_SECONDS = 12 * 3600
DEVICE_SECONDS = 90 * 24 * 3600  # a browser that logged in keeps its own guess count this long
_CSRF_RE = re.compile(r"[A-Za-z0-9_-]{32,128}")
# where /lang may send the browser back to: a path on this site. Not "//host" or "/\host"
# (a browser reads both as another host), nor a control character or space (a browser drops
# tabs and newlines from a URL, so "/\t/host" is "//host")
_BACK_RE = re.compile(r"/(?![/\\])[^\\\x00-\x20\x7f]*")
MAX_FORM = 256 * 1024  # a pasted experiment file is a few kB
FLEET_SECONDS = 15  # a fleet page serves every request within this slice of the clock
SPEND_SECONDS = 300  # spend and budget standings: a pass over a big ledger takes a while
CACHE_ENTRIES = 64
GZIP_FROM = 2048  # bytes: smaller pages are not worth compressing
#: what a machine page's forms do: the CLI's ``stop``, ``start``, ``keep --until``, ``keep
#: --cancel``, ``autostop DURATION``, ``autostop --cancel`` and ``down``
ACTS = ("stop", "start", "keep", "unkeep", "autostop", "unautostop", "down")
CONFIRM = {"stop", "down"}  # asked once more before they are done
DONE = {*ACTS, *(f"{a}-same" for a in ("stop", "start", "down", "unkeep", "unautostop"))}
HEADERS = [
    (
        "Content-Security-Policy",
        "default-src 'none'; style-src 'self'; script-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
]

StartResponse = Callable[..., Any]
Environ = dict[str, Any]


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: whatever it resolves to, treat it as wide


def host_name(header: str) -> str:
    """The name in a ``Host`` header, without port or brackets, lowercase."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:].partition("]")[0]
    if h.count(":") == 1:
        h = h.partition(":")[0]
    return h.rstrip(".")


def host_allowed(name: str, hosts: Iterable[str]) -> bool:
    """An IP address (no page can rebind a name to it: its origin is the address itself),
    ``localhost`` and its subdomains (RFC 6761 §6.3: loopback, never resolved elsewhere), or a
    configured name."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name in {h.lower().rstrip(".") for h in hosts}


def safe_back(back: str) -> str:
    """``back`` when it is a path on this site, else ``/``."""
    return back if _BACK_RE.fullmatch(back) else "/"


class TooLarge(ValueError):
    pass


class Throttle:
    """Failed logins per client address: after ``limit`` failures within ``window`` seconds
    every attempt from that address is refused (even with the right token, or guessing would
    go on) until its oldest failure is ``window`` old. Bounded: at most ``addresses`` are
    remembered, those with the oldest failures forgotten first."""

    def __init__(self, limit: int = 5, window: int = 60, addresses: int = 10_000) -> None:
        self.limit, self.window, self.addresses = limit, window, addresses
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def wait(self, who: str, now: float) -> int:
        """Seconds until ``who`` may try again (0: now)."""
        with self._lock:
            seen = self._recent(who, now)
            if len(seen) < self.limit:
                return 0
            return max(1, math.ceil(seen[0] + self.window - now))

    def failed(self, who: str, now: float) -> None:
        with self._lock:
            seen = self._recent(who, now)
            if not seen:
                if len(self._failures) >= self.addresses:
                    oldest = min(self._failures, key=lambda k: self._failures[k][-1])
                    del self._failures[oldest]
                self._failures[who] = seen
            seen.append(now)

    def _recent(self, who: str, now: float) -> deque[float]:
        seen = self._failures.get(who, deque())
        while seen and seen[0] <= now - self.window:
            seen.popleft()
        if not seen:
            self._failures.pop(who, None)
        return seen


def _trusted(client: str, networks: list[str]) -> bool:
    try:
        addr = ipaddress.ip_address(client)
    except ValueError:
        return False
    return any(addr in ipaddress.ip_network(n, strict=False) for n in networks)


def same_secret(given: str, secret: str) -> bool:
    """Constant time, whatever the lengths: the digests are compared, not the strings."""
    return hmac.compare_digest(
        hashlib.sha256(given.encode()).digest(), hashlib.sha256(secret.encode()).digest()
    )


class Response:
    def __init__(
        self,
        body: str | bytes = b"",
        status: int = 200,
        ctype: str = "text/html; charset=utf-8",
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        self.body = body.encode() if isinstance(body, str) else body
        self.status = status
        self.headers = [("Content-Type", ctype), *(headers or [])]

    def __call__(self, start_response: StartResponse, gzip: bool = False) -> Iterable[bytes]:
        """``gzip``: the client takes it; pages of text over a few kB are sent compressed
        (the fleet of 1,000 machines: 1.2 MB of HTML, about a tenth of that on the wire)."""
        phrase = HTTPStatus(self.status).phrase
        body, headers = self.body, [*self.headers, *HEADERS]
        if self.headers[0][1].startswith("text/"):
            headers.append(("Vary", "Accept-Encoding"))
            if gzip and len(body) >= GZIP_FROM:
                body = _gzip(body)
                headers.append(("Content-Encoding", "gzip"))
        headers.append(("Content-Length", str(len(body))))
        if not any(k == "Cache-Control" for k, _ in headers):
            headers.append(("Cache-Control", "no-store"))  # pages hold project names and money
        start_response(f"{self.status} {phrase}", headers)
        return [body]


def accepts_gzip(header: str) -> bool:
    """``Accept-Encoding`` names gzip (or ``*``) without ``q=0``."""
    for part in header.split(","):
        name, _, params = part.strip().partition(";")
        if name.strip().lower() in ("gzip", "*"):
            q = params.strip().removeprefix("q=")
            return not (params.strip().startswith("q=") and _zero(q))
    return False


def _zero(q: str) -> bool:
    try:
        return float(q) == 0
    except ValueError:
        return False


def _gzip(body: bytes) -> bytes:
    import gzip

    return gzip.compress(body, compresslevel=5, mtime=0)


class Request:
    def __init__(self, environ: Environ) -> None:
        self.environ = environ
        self.method = environ.get("REQUEST_METHOD", "GET")
        self.path = environ.get("PATH_INFO", "") or "/"
        self.root = environ.get("SCRIPT_NAME", "").rstrip("/")  # where we are mounted
        self.query = dict(parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True))
        # the peer as the server saw it: a proxy's X-Forwarded-For is anyone's to write
        self.client = environ.get("REMOTE_ADDR") or "?"
        cookies = SimpleCookie()
        try:
            cookies.load(environ.get("HTTP_COOKIE", ""))
        except Exception:  # a malformed cookie header is no cookie
            cookies = SimpleCookie()
        self.cookies = {k: v.value for k, v in cookies.items()}
        self._form: dict[str, str] | None = None
        self.user: str | None = None  # who is asking, when known (Dashboard.allowed)
        given = self.cookies.get(CSRF_COOKIE, "")
        self.new_csrf = not _CSRF_RE.fullmatch(given)  # to be set with this response
        self.csrf = secrets.token_urlsafe(32) if self.new_csrf else given

    @property
    def bearer(self) -> str | None:
        auth = self.environ.get("HTTP_AUTHORIZATION", "")
        return auth[7:].strip() if auth[:7].lower() == "bearer " else None

    def form(self) -> dict[str, str]:
        if self._form is None:
            try:
                n = int(self.environ.get("CONTENT_LENGTH") or 0)
            except ValueError:
                n = 0
            if not 0 <= n <= MAX_FORM:
                raise TooLarge(f"a form of at most {MAX_FORM // 1024} KiB, please")
            raw = self.environ["wsgi.input"].read(n) if n else b""
            self._form = dict(parse_qsl(raw.decode("utf-8", "replace"), keep_blank_values=True))
        return self._form

    def url(self, path: str, **query: str) -> str:
        q = {k: v for k, v in query.items() if v}
        return self.root + path + (("?" + urlencode(q)) if q else "")


class Dashboard:
    """The WSGI callable (see :func:`provisioner.dashboard.make_app`)."""

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
        self.throttle = Throttle()
        self.routes: dict[str, Callable[[Request], Response]] = {
            "/": self.fleet,
            "/spend": self.spend,
            "/spend.csv": self.spend_csv,
            "/fleet.csv": self.fleet_csv,
            "/alerts": self.alerts,
            "/plan": self.plan,
            "/login": self.login,
            "/logout": self.logout,
        }

    def warm(self) -> Dashboard:
        """Every template compiled and each language's words and number formats read, as a
        server does before it listens (the fleet's templates take 0.13 s, the rest 0.04 s,
        else paid by the first visitor)."""
        for name in sorted(p.name for p in TEMPLATES.glob("*.html")):
            self.env.get_template(name)
        for lang in render.LOCALES:
            render.messages(lang)
            render.Fmt(lang).money(Money(Decimal(0), self.app.settings.currency))
        return self

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        req = Request(environ)
        try:
            resp = self.handle(req)
        except ProvisionerError as e:  # bad input in a query: say it, like the CLI would
            resp = self.page(req, "error.html", status=400, message=str(e))
        except TooLarge as e:
            resp = Response(str(e), 413, "text/plain; charset=utf-8")
        except Exception:
            log.exception("dashboard: %s %s failed", req.method, req.path)
            resp = Response("internal error", 500, "text/plain; charset=utf-8")
        if req.new_csrf and resp.headers[0][1].startswith("text/html"):  # a page: its forms
            resp.headers.append(
                (
                    "Set-Cookie",
                    f"{CSRF_COOKIE}={req.csrf}; Path={req.root or '/'}; HttpOnly; "
                    "SameSite=Strict" + self._secure(req),
                )
            )
        return resp(start_response, accepts_gzip(environ.get("HTTP_ACCEPT_ENCODING", "")))

    def handle(self, req: Request) -> Response:
        host = host_name(req.environ.get("HTTP_HOST") or "")  # every browser sends one
        if host and not host_allowed(host, self.hosts):
            return Response(
                f"this dashboard does not answer to {host!r}: add it to dashboard.hosts in "
                "settings",
                421,
                "text/plain; charset=utf-8",
            )
        if req.path.startswith("/static/"):
            return _static(req.path.removeprefix("/static/"))
        if req.path == "/favicon.ico":  # every browser asks; no icon, and nothing secret
            return Response(status=204, headers=[("Cache-Control", "max-age=86400")])
        if req.path == "/lang":
            return self.set_language(req)
        if req.method == "POST" and (refused := self._cross_site(req)):
            return Response(refused, 403, "text/plain; charset=utf-8")
        if req.path != "/login" and (wait := self._held(req)):
            return self.too_many(req, wait)
        if req.path != "/login" and not self.allowed(req):
            if req.bearer is not None:  # RFC 6750 §3.1: a wrong token is 401, not a redirect
                return Response(
                    "wrong token",
                    401,
                    "text/plain; charset=utf-8",
                    [("WWW-Authenticate", 'Bearer error="invalid_token"')],
                )
            if req.method == "GET" and not req.path.endswith(".csv"):
                return Response(status=303, headers=[("Location", req.url("/login"))])
            return Response("authentication required", 401, "text/plain; charset=utf-8")
        if req.path.startswith("/machine/"):
            return self.machine(req, req.path.removeprefix("/machine/"))
        route = self.routes.get(req.path)
        if route is None:
            return self.page(req, "error.html", status=404, message=self.t(req, "dash_not_found"))
        return route(req)

    # --- access ---------------------------------------------------------------------------

    def _cross_site(self, req: Request) -> str | None:
        """Why a POST is refused as cross-site (None: it is not): its ``Origin`` (or, without
        one, its ``Referer``) names another host, or it lacks the form's CSRF token."""
        env = req.environ
        here = (env.get("HTTP_HOST") or "").strip().lower()
        origin = env.get("HTTP_ORIGIN")
        source = origin if origin is not None else env.get("HTTP_REFERER")
        # "null": what a browser sends for its own form under our Referrer-Policy no-referrer
        # (https://fetch.spec.whatwg.org/#serializing-a-request-origin): the token decides
        if source is not None and source.strip() != "null" and here:
            try:
                there = urlsplit(source.strip()).netloc.lower()
            except ValueError:
                there = ""
            # its own host, or a name of ours (a TLS proxy may send the dashboard another Host)
            if there != here and host_name(there) not in {h.lower() for h in self.hosts}:
                return "refused: a form sent from another site"
        if req.bearer is not None:
            return None  # a script with its token: no browser sends one by itself
        given = req.form().get("csrf", "")
        if req.new_csrf or not hmac.compare_digest(given.encode(), req.csrf.encode()):
            return "refused: the form's security token is missing or stale; reload the page"
        return None

    def _who(self, req: Request) -> str:
        """Whose wrong guesses a request counts with: its browser's own when it has logged in
        before (a valid device cookie), else its address."""
        device = req.cookies.get(DEVICE_COOKIE, "")
        exp, _, rest = device.partition(".")
        nonce, _, _ = rest.partition(".")
        if exp.isdigit() and int(exp) >= time.time() and nonce:
            mac = hmac.new(self.session_key, f"device:{exp}.{nonce}".encode(), hashlib.sha256)
            if hmac.compare_digest(device.encode(), f"{exp}.{nonce}.{mac.hexdigest()}".encode()):
                return "device:" + nonce
        return req.client

    def _device_cookie(self, req: Request) -> str:
        exp, nonce = int(time.time()) + DEVICE_SECONDS, secrets.token_urlsafe(16)
        mac = hmac.new(self.session_key, f"device:{exp}.{nonce}".encode(), hashlib.sha256)
        return (
            f"{DEVICE_COOKIE}={exp}.{nonce}.{mac.hexdigest()}; Path={req.root or '/'}; HttpOnly; "
            f"SameSite=Strict; Max-Age={DEVICE_SECONDS}" + self._secure(req)
        )

    @staticmethod
    def _secure(req: Request) -> str:
        return "; Secure" if req.environ.get("wsgi.url_scheme") == "https" else ""

    def allowed(self, req: Request) -> bool:
        """Whether ``req`` may look, and who asks (``req.user``): a trusted proxy's header, a
        personal token (Bearer or its session cookie), or the shared ``dashboard.token``
        (user :data:`SHARED`). On loopback anyone may look; a credential still names them."""
        req.user = self._proxy_user(req)
        if req.user is not None:
            return True
        if req.bearer is not None:  # a script's token: its guesses count as a form's
            req.user = self._token_user(req.bearer)
            if req.user is None and not self.open:
                self.throttle.failed(self._who(req), self.now().timestamp())
                return False
        else:
            req.user = self._session_user(req.cookies.get(COOKIE, ""))
        return self.open or req.user is not None

    def viewer(self, req: Request) -> Callable[[], str]:
        """Who a plan without ``owner`` is for: the signed-in user, else who serves this."""
        return lambda: req.user if req.user and "@" in req.user else self.app.actor

    def _token_user(self, given: str) -> str | None:
        """The user a token names: the shared token's, or a live personal token's."""
        if self.token and same_secret(given, self.token):
            return SHARED
        if given.startswith(tokens.PREFIX):
            t = tokens.verify(self.app, given)
            return t.user if t is not None else None
        return None

    def _proxy_user(self, req: Request) -> str | None:
        """The user an authenticating proxy names in ``identity.proxy_header``, believed only
        from an address in ``identity.trusted_proxies`` (anyone else may write the header)."""
        ident = self.app.settings.identity
        key = "HTTP_" + ident.proxy_header.upper().replace("-", "_")
        value = req.environ.get(key, "").strip()
        if (
            not value
            or not ident.trusted_proxies
            or not _trusted(req.client, ident.trusted_proxies)
        ):
            return None
        if len(value) > 128 or not value.isprintable() or " " in value:
            return None
        return value if "@" in value else email_of(self.app.settings, value)

    def _held(self, req: Request) -> int:
        """Seconds a request offering a token must wait (0: none), when its address has
        guessed wrong too often."""
        if self.open or req.bearer is None:
            return 0
        return self.throttle.wait(self._who(req), self.now().timestamp())

    @functools.cached_property
    def session_key(self) -> bytes:
        """What signs the sessions of personal tokens: a random key in a 0600 file in the
        home, made once (sessions survive restarts and several workers). Never in the state:
        every member may read the database, and must not be able to forge a session."""
        path = self.app.settings.home / "dashboard-session.key"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return path.read_bytes()
        with os.fdopen(fd, "wb") as f:
            key = secrets.token_bytes(32)
            f.write(key)
        return key

    def _sign(self, expires: int, token: Token | None = None) -> str:
        """A session cookie's value: signed with the shared token, or for a personal
        ``token`` with :attr:`session_key` over its id and stored hash (revoking the token
        ends its sessions)."""
        if token is not None:
            msg = f"session:{expires}:{token.id}:{token.hash}".encode()
            mac = hmac.new(self.session_key, msg, hashlib.sha256)
            return f"{expires}.{token.id}.{mac.hexdigest()}"
        assert self.token
        mac = hmac.new(self.token.encode(), f"session:{expires}".encode(), hashlib.sha256)
        return f"{expires}.{mac.hexdigest()}"

    def _session_user(self, value: str) -> str | None:
        exp, _, rest = value.partition(".")
        if not exp.isdigit() or int(exp) < time.time():
            return None
        token_id, dot, _ = rest.partition(".")
        if dot:  # a personal token's session
            t = tokens.by_id(self.app, token_id)
            if t is None:
                return None
            good = hmac.compare_digest(value.encode(), self._sign(int(exp), t).encode())
            return t.user if good else None
        if not self.token:
            return None
        good = hmac.compare_digest(value.encode(), self._sign(int(exp)).encode())
        return SHARED if good else None

    def login(self, req: Request) -> Response:
        if self.open:
            return Response(status=303, headers=[("Location", req.url("/"))])
        if req.method == "POST":
            now, who = self.now().timestamp(), self._who(req)
            if wait := self.throttle.wait(who, now):
                return self.too_many(req, wait)
            given = req.form().get("token", "").strip()
            personal = tokens.verify(self.app, given) if given.startswith(tokens.PREFIX) else None
            if personal is not None or (self.token and same_secret(given, self.token)):
                value = self._sign(int(time.time()) + SESSION_SECONDS, personal)
                cookie = (
                    f"{COOKIE}={value}; Path={req.root or '/'}; HttpOnly; SameSite=Strict; "
                    f"Max-Age={SESSION_SECONDS}"
                )
                cookie += self._secure(req)
                return Response(
                    status=303,
                    headers=[
                        ("Location", req.url("/")),
                        ("Set-Cookie", cookie),
                        ("Set-Cookie", self._device_cookie(req)),
                    ],
                )
            self.throttle.failed(who, now)
            return self.page(req, "login.html", status=401, failed=True, configured=self.configured)
        return self.page(req, "login.html", failed=False, configured=self.configured)

    @property
    def configured(self) -> bool:
        """Whether any token can log in: the shared one, or a personal one."""
        return bool(self.token) or tokens.any_usable(self.app)

    def too_many(self, req: Request, wait: int) -> Response:
        """429 with ``Retry-After``: the form says how long; a script gets it in plain text."""
        if req.path == "/login":
            resp = self.page(
                req, "login.html", status=429, failed=False, configured=self.configured, wait=wait
            )
        else:
            resp = Response(
                f"too many failed logins: try again in {wait} s",
                429,
                "text/plain; charset=utf-8",
            )
        resp.headers.append(("Retry-After", str(wait)))
        return resp

    def logout(self, req: Request) -> Response:
        cookie = f"{COOKIE}=; Path={req.root or '/'}; HttpOnly; SameSite=Strict; Max-Age=0"
        return Response(
            status=303, headers=[("Location", req.url("/login")), ("Set-Cookie", cookie)]
        )

    # --- language -------------------------------------------------------------------------

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
        """``name`` rendered; its times in ``tz`` (a machine's policy calendar), else the
        team's (``timezone`` in settings)."""
        lang = self.language(req)
        f = render.Fmt(lang)
        here = req.path + (
            ("?" + req.environ["QUERY_STRING"]) if req.environ.get("QUERY_STRING") else ""
        )
        zone = tz or ZoneInfo(self.app.settings.timezone)
        html = self.env.get_template(name).render(
            f=f,
            rate=lambda amount, currency: rate_text(f, amount, currency),
            percent=lambda util: _percent(int(util), lang),
            t=f.t,
            lang=lang,
            req=req,
            url=req.url,
            here=here,
            csrf=req.csrf,
            auth=not self.open,
            now=self.now(),
            when=lambda at, tz=None: pages.when(f, at, self.now(), tz or zone),
            at=lambda at, tz=None: _at(pages.when(f, at, self.now(), tz or zone), at),
            utc=_utc,
            svg=svg,
            **kw,
        )
        return Response(html, status)

    def _fleet(self, req: Request, paged: bool = True) -> fleet_view.Fleet:
        now = self.now()
        f = render.Fmt(self.language(req))
        key = ("fleet", f.language, paged, tuple(sorted(req.query.items())))
        return self.cached(
            key,
            FLEET_SECONDS,
            lambda: fleet_view.fleet(self.app, now, f, req.query, paged, self._standings),
        )

    def _standings(self) -> list[budget.Status]:
        """Every budget's standing, shared by the pages of the same slice (the spend page's
        and the fleet's summary: one forecast per budget)."""
        now = self.now()
        return self.cached("standings", SPEND_SECONDS, lambda: spend_view.standings(self.app, now))

    def fleet(self, req: Request) -> Response:
        data = self._fleet(req)
        # what a row's act button just did (set by :meth:`act`, as on a machine page)
        mid, _, done = req.cookies.get(FLASH_COOKIE, "").partition(".")
        flash = None
        if done in DONE and mid:
            name = next((r.machine.name for r in data.rows if r.machine.id == mid), None)
            flash = self.t(req, f"dash_done_{done}", name=name or self._name(mid))
        resp = self.page(
            req,
            "fleet.html",
            fleet=data,
            spark_step=fleet_view.SPARK_STEP,
            section="fleet",
            states=fleet_view.STATES,
            may_act=lambda m: self.may_act(req, m),
            done=flash,
            undelivered=alerts_view.undelivered(self.app),
        )
        if FLASH_COOKIE in req.cookies:  # said once
            resp.headers.append(("Set-Cookie", self._flash(req, "", 0)))
        return resp

    def _name(self, mid: str) -> str:
        from provisioner.models import Machine

        with self.app.db.session() as s:
            m = s.get(Machine, mid)
            return m.name if m is not None else mid

    def fleet_csv(self, req: Request) -> Response:
        """The fleet page's rows, filtered and sorted as the page is, over every page: one line
        per machine and currency, amounts as exact numbers (what a spreadsheet sums)."""
        data = self._fleet(req, paged=False)
        lines = []
        for r in data.rows:
            m = r.machine
            currencies = sorted(
                {mo.currency for mo in r.spent} | ({r.burn.currency} if r.burn else set())
            )
            for c in currencies or [m.currency or ""]:
                cost = next((mo.amount for mo in r.spent if mo.currency == c), None)
                per_hour = r.burn.amount if r.burn is not None and r.burn.currency == c else None
                lines.append(
                    [
                        m.name,
                        m.project,
                        m.owner,
                        m.cloud,
                        m.zone or m.region,
                        m.gpu,
                        m.gpu_count if m.gpu else None,
                        m.market,
                        m.status,
                        r.idle.since.isoformat() if r.idle else None,
                        c,
                        cost,
                        per_hour,
                        r.move.action if r.move else None,
                        r.next_at.isoformat() if r.next_at else None,
                    ]
                )
        header = [
            "machine", "project", "owner", "cloud", "where", "gpu", "gpu_count", "market",
            "state", "idle_since", "currency", "cost", "per_hour", "next_action", "next_at",
        ]  # fmt: skip
        return Response(
            render.csv_table(header, lines),
            ctype="text/csv; charset=utf-8",
            headers=[("Content-Disposition", 'attachment; filename="fleet.csv"')],
        )

    def _spend(self, req: Request) -> spend_view.Spend:
        now, lang = self.now(), self.language(req)

        def budgets(r: reports.Report) -> list[budget.Status]:  # shared by every spend page
            return self.cached(
                "standings", SPEND_SECONDS, lambda: spend_view.standings(self.app, now, r)
            )

        key = ("spend", lang, tuple(sorted((k, v) for k, v in req.query.items() if v)))
        return self.cached(
            key,
            SPEND_SECONDS,
            lambda: spend_view.spend(self.app, now, lang, req.query, budgets),
        )

    def spend(self, req: Request) -> Response:
        data = self._spend(req)
        f = render.Fmt(self.language(req))
        r = data.report
        return self.page(
            req,
            "spend.html",
            s=data,
            r=r,
            prev=data.previous,
            days=(
                r.period.start.astimezone(ZoneInfo(r.period.tz)).date(),
                r.period.days()[-1],
            ),
            section="spend",
            by_choices=pages.BY,
            budget_names=[p.name for p in pages.budget_policies(self.app)],
            ownership=lambda o: render.ownership_text(r, o),
            chart=_burndown(data, f),
            billed=bill.last_fetch(self.app, r.period.label),
            notices=alerts_view.recent(self.app, data.params.get("budget")),
        )

    def alerts(self, req: Request) -> Response:
        data = alerts_view.alerts(self.app, req.query)
        return self.page(
            req, "alerts.html", a=data, statuses=alerts_view.STATUSES, section="alerts"
        )

    def spend_csv(self, req: Request) -> Response:
        r = self._spend(req).report
        name = f"spend-{render._slug(r.title)}-{r.period.label}.csv"
        return Response(
            render.csv(r),
            ctype="text/csv; charset=utf-8",
            headers=[("Content-Disposition", f'attachment; filename="{name}"')],
        )

    def machine(
        self, req: Request, key: str, *, status: int = 200, refused: str | None = None
    ) -> Response:
        data = fleet_view.machine_page(self.app, self.now(), key)
        if data is None:
            return self.page(req, "error.html", status=404, message=self.t(req, "dash_not_found"))
        if req.method == "POST" and refused is None:
            return self.act(req, data.machine)
        # what the action just done did: from a cookie only this site sets (a link to
        # ?done=… from elsewhere could otherwise claim a stop that never happened)
        mid, _, done = req.cookies.get(FLASH_COOKIE, "").partition(".")
        zone = _calendar_zone(self.app, data.machine)
        resp = self.page(
            req,
            "machine.html",
            status=status,
            m=data.machine,
            d=data,
            section="fleet",
            may_act=self.may_act(req, data.machine),
            budgets=[
                p.name
                for p in pages.budget_policies(self.app)
                if p.applies_to.matches(data.machine.project, data.machine.owner)
            ],
            back=_back(req),
            done=done if done in DONE and mid == data.machine.id else None,
            refused=refused,
            tz=zone,
        )
        if FLASH_COOKIE in req.cookies:  # said once
            resp.headers.append(("Set-Cookie", self._flash(req, "", 0)))
        return resp

    def _flash(self, req: Request, value: str, seconds: int) -> str:
        return (
            f"{FLASH_COOKIE}={value}; Path={req.root or '/'}; HttpOnly; SameSite=Strict; "
            f"Max-Age={seconds}" + self._secure(req)
        )

    # --- acting on a machine ----------------------------------------------------------------

    def acting_user(self, req: Request) -> str | None:
        """Who a POST acts as: the signed-in user; on loopback without a credential, who
        serves this (the OS user or database role, as at the terminal) — not the scheduler
        daemon's own actor: what a page does is a person's doing."""
        if req.user is not None:
            return req.user
        if not self.open or self.app.actor == SCHEDULER:
            return None
        return self.app.actor

    def may_act(self, req: Request, m: Any) -> bool:
        """The machine's owner may act on it, and whom a policy that applies to it grants
        ``act_as`` its owner (:func:`provisioner.identity.grants`)."""
        who = self.acting_user(req)
        if who is None:
            return False
        if who == m.owner:
            return True
        return grants(matching(self.app.policies, m.project, m.owner), who, m.owner)

    def act(self, req: Request, m: Any) -> Response:
        """A form's action on machine ``m``, as the signed-in user (every event it writes
        records them); then back to the machine's page (303), or to the page the form names in
        ``back`` (a fleet row's: the list with its filters and sort), which says what was done.
        Stop and down ask first: a page whose form sends ``confirm=yes``. A refusal (policy,
        budget, state) is the CLI's own words on the machine's page: 409; not the owner: 403."""
        form = req.form()
        do = form.get("do", "")
        if do not in ACTS:
            return self.machine(
                req, m.id, status=400, refused=self.t(req, "dash_do_unknown", do=do[:40])
            )
        who = self.acting_user(req)
        if who is None:
            return self.machine(req, m.id, status=403, refused=self.t(req, "dash_do_sign_in"))
        if not self.may_act(req, m):
            words = self.t(req, "dash_do_forbidden", who=who, owner=m.owner or "?")
            return self.machine(req, m.id, status=403, refused=words)
        back = _back(req)
        if do in CONFIRM and form.get("confirm") != "yes":
            return self.page(req, "confirm.html", m=m, do=do, section="fleet", back=back)
        try:
            with acting.acting_as(who):
                done = self._do(do, m.name, form)
        except ProvisionerError as e:
            log.info("dashboard: %s %s by %s refused: %s", do, m.name, who, e)
            status = 409 if e.exit_code == 2 else 502
            return self.machine(req, m.id, status=status, refused=str(e))
        with self._lock:
            self._cache.clear()  # the fleet shows what was just done
        log.info("dashboard: %s %s by %s: %s", do, m.name, who, done)
        return Response(
            status=303,
            headers=[
                ("Location", req.root + back if back else req.url(f"/machine/{m.id}")),
                ("Set-Cookie", self._flash(req, f"{m.id}.{done}", 60)),
            ],
        )

    def _do(self, do: str, name: str, form: dict[str, str]) -> str:
        """The CLI's own call for ``do`` (``provisioner stop``, ``keep``, ``autostop``…);
        what happened, a key of :data:`DONE`."""
        from provisioner import machines
        from provisioner.jobs import autostop, sweep

        a = self.app
        if do in ("stop", "start", "down"):
            _, changed = getattr(machines, do)(a, name)
            return do if changed else f"{do}-same"
        if do == "keep":
            sweep.keep(a, name, form.get("until", "").strip())
            return do
        if do == "unkeep":
            return do if sweep.unkeep(a, name)[1] else "unkeep-same"
        if do == "autostop":
            m, st = autostop.set_autostop(a, name, form.get("duration", "").strip())
            autostop.tell_machine(a, m, st)
            return do
        m, st, had = autostop.cancel_autostop(a, name)
        autostop.tell_machine(a, m, st)  # the machine's own guard: best effort, as the CLI
        return do if had else "unautostop-same"

    def plan(self, req: Request) -> Response:
        files = pages.experiment_files(self.app, self.app.settings.dashboard.experiments)
        result = None
        text = ""
        if req.method == "POST":
            form = req.form()
            text = form.get("text", "")
            picked = form.get("file", "")
            if picked and picked not in files:  # only the files offered, never any path
                result = plan_view.PlanPage(
                    picked, problems=[self.t(req, "dash_plan_unknown_file")]
                )
            elif picked:
                result = plan_view.plan_page(self.app, path=picked, owner=self.viewer(req))
            elif text.strip():
                result = plan_view.plan_page(self.app, text=text, owner=self.viewer(req))
        return self.page(req, "plan.html", files=files, result=result, text=text, section="plan")


def _back(req: Request) -> str | None:
    """Where an act form sends the user when done: the page it was on (the fleet, with its
    filters and sort), a path on this site; None: the machine's page."""
    back = (req.form() if req.method == "POST" else req.query).get("back", "")
    return safe_back(back) if back else None


def _burndown(data: spend_view.Spend, f: render.Fmt) -> Any:
    """The spend chart: against the budget when one is shown, else spend and forecast."""
    r, b = data.report, data.report.budget
    running = data.today is not None
    has_budget = b is not None and data.policy is not None and data.policy.budget is not None
    forecast = r.shown_forecast
    return svg.burndown(
        [(d.day.isoformat(), d.spent.amount) for d in data.days],
        data.today,
        amount=b.amount.amount if b is not None and has_budget else None,
        forecast=forecast.amount if running and forecast is not None else None,
        committed_to=(b.spent + b.committed).amount if running and b is not None else None,
        thresholds=data.policy.budget.alerts.actual if has_budget else [],  # type: ignore[union-attr]
        labels={
            "title": f.t("dash_burndown"),
            "daily": f.t("dash_legend_day"),
            "budget": f.t("dash_legend_budget"),
            "spent": f.t("dash_legend_spent"),
            "committed": f.t("dash_legend_committed"),
            "forecast": f.t("dash_legend_forecast"),
        },
        money={"amount": f.money(b.amount) if b is not None else "", "top": r.currency},
        num=lambda v: f.num(v),
    )


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


def _static(name: str) -> Response:
    """A file of the dashboard's own folder; anything else (``..``, a NUL, a backslash, a
    control character, a folder) is 404, never an error."""
    missing = Response("not found", 404, "text/plain; charset=utf-8")
    if not name or re.search(r"[\x00-\x1f\x7f\\]", name) or ".." in name.split("/"):
        return missing
    try:
        path = (STATIC / name).resolve()
        if not path.is_relative_to(STATIC) or not path.is_file():
            return missing
    except (OSError, ValueError):
        return missing
    ctype = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return Response(path.read_bytes(), ctype=ctype, headers=[("Cache-Control", "max-age=3600")])


def _calendar_zone(app: App, m: Any) -> ZoneInfo | None:
    """The time zone of the policy calendar a machine's idle rules follow, as on the fleet
    (None: none, or rules that cannot be read; the fleet says why)."""
    from provisioner.jobs.sweep import RuleBook

    try:
        rules = RuleBook(app.policies).for_machine(m)
    except (ProvisionerError, ValueError):
        return None
    return next((c.calendar.tz for c in rules.idle if c.calendar is not None), None)


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
    return env
