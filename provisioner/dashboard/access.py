"""Who may look at the dashboard, who may act, and who asks.

Looking: on a loopback address anyone on this computer may look. Bound wider, every request
needs a credential: the shared token (``dashboard.token`` in settings or
``$PROVISIONER_DASHBOARD_TOKEN``), a personal token (``provisioner token create``), or a
trusted proxy's header. A token entered once on the login form becomes an HttpOnly,
SameSite=Strict session cookie (the shared token's signed with it, a personal token's with
:attr:`Access.session_key` over its hash, so it dies when the token does); scripts may send a
token as ``Authorization: Bearer`` (a wrong one: 401). It never appears in a page or a URL.

Acting (a POST that changes something) needs a person, on every address, loopback included:
a personal token's sign-in or a trusted proxy's user (:meth:`Access.acting_user`). The OS user
who serves the dashboard never acts for a web request, nor does the shared token (it names no
one).

Guessing is slowed (:class:`Throttle`, in this process's memory: a restart forgets it, and
each worker of several counts on its own): :data:`LIMIT` wrong tokens within :data:`WINDOW`
seconds from one client address, or naming one account (a personal token's id, or the shared
token), and every further try from that address or for that account waits (429,
``Retry-After``), the right token included, so guessing does not pay. The address is the peer's,
or the one a trusted proxy appends to ``X-Forwarded-For``. A browser that signed in to an
account before holds a device cookie bound to that account, and its tries at that account are
counted on their own instead, so a guesser does not lock its owner out (OWASP,
https://owasp.org/www-community/Slow_Down_Online_Guessing_Attacks_with_Device_Cookies); a new
device cookie or session never resets a count: one for bob's account counts nothing for alice's.

Against other sites and rebinding names, open or not: a request naming a host other than an IP
address, ``localhost`` or one of ``dashboard.hosts`` is refused (421: a DNS-rebinding page
names its own host); every POST must come from this site (``Origin``/``Referer``) and carry
the form's CSRF token, the double of a SameSite=Strict cookie (OWASP, https://cheatsheetseries.
owasp.org/cheatsheets/Cross-Site_Request_Forgery_Prevention_Cheat_Sheet.html), unless it
authenticates with a Bearer token (which no browser adds by itself).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from provisioner import secretfile, team, tokens
from provisioner.app import App
from provisioner.dashboard.site import Site
from provisioner.dashboard.wsgi import Request, Response, host_name
from provisioner.models import Token

COOKIE = "provisioner_session"
SHARED = "dashboard.token"  # the user of the shared token (settings), whoever holds it
DEVICE_COOKIE = "provisioner_device"
SESSION_SECONDS = 12 * 3600
SESSION_KEY_BYTES = 32  # dashboard-session.key: what is written, and all that is trusted
DEVICE_SECONDS = 90 * 24 * 3600  # a browser that signed in keeps its own count this long
LIMIT = 5  # wrong tokens from one address, or for one account, within WINDOW…
WINDOW = 15 * 60  # …seconds (of the app's clock), then every try waits
_SHARED_ACCOUNT = "shared"  # the account a guess at the shared token counts on


class Throttle:
    """Failed sign-ins per key (``addr:…``, ``account:…``, ``device:…``): after ``limit``
    failures within ``window`` seconds every try counted on that key is refused (even with the
    right token, or guessing would go on) until its oldest failure is ``window`` old. Bounded:
    at most ``keys`` are remembered, those with the oldest failures forgotten first."""

    def __init__(self, limit: int = LIMIT, window: int = WINDOW, keys: int = 100_000) -> None:
        self.limit, self.window, self.keys = limit, window, keys
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def wait(self, who: str | Iterable[str], now: float) -> int:
        """Seconds until every one of ``who`` may try again (0: now)."""
        with self._lock:
            return max((self._wait(k, now) for k in _keys(who)), default=0)

    def _wait(self, key: str, now: float) -> int:
        seen = self._recent(key, now)
        if len(seen) < self.limit:
            return 0
        return max(1, math.ceil(seen[-self.limit] + self.window - now))

    def failed(self, who: str | Iterable[str], now: float) -> None:
        with self._lock:
            for key in _keys(who):
                seen = self._recent(key, now)
                if not seen:
                    if len(self._failures) >= self.keys:
                        oldest = min(self._failures, key=lambda k: self._failures[k][-1])
                        del self._failures[oldest]
                    self._failures[key] = seen
                seen.append(now)

    def _recent(self, who: str, now: float) -> deque[float]:
        seen = self._failures.get(who, deque())
        while seen and seen[0] <= now - self.window:
            seen.popleft()
        if not seen:
            self._failures.pop(who, None)
        return seen


def _keys(who: str | Iterable[str]) -> list[str]:
    return [who] if isinstance(who, str) else list(who)


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


class Access(Site):
    """The login, sessions, tokens and the checks every request passes."""

    def __init__(
        self, app: App, *, token: str | None, open_access: bool, hosts: Iterable[str] = ()
    ) -> None:
        super().__init__(app, token=token, open_access=open_access, hosts=hosts)
        self.throttle = Throttle()

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

    def address(self, req: Request) -> str:
        """The client's address: the peer's, or, when the peer is a trusted proxy
        (``identity.trusted_proxies``), the last one it appended to ``X-Forwarded-For`` (what
        any other sender writes there is anyone's to write)."""
        forwarded = req.environ.get("HTTP_X_FORWARDED_FOR", "")
        proxies = self.app.settings.identity.trusted_proxies
        if not forwarded or not proxies or not _trusted(req.client, proxies):
            return req.client
        last = forwarded.rsplit(",", 1)[-1].strip()
        try:
            return str(ipaddress.ip_address(last))
        except ValueError:
            return req.client

    def _account(self, given: str) -> str | None:
        """The account a token tries: a personal token's id when the state knows it, the
        shared token for anything else when one is set (None: a guess at nothing)."""
        if given.startswith(tokens.PREFIX):
            return tokens.named(self.app, given)
        return _SHARED_ACCOUNT if self.token else None

    def _counted(self, req: Request, given: str) -> list[str]:
        """What a try with token ``given`` counts on: its browser's own count when it signed in
        to that account before (a valid device cookie for it), else its address and the
        account."""
        account = self._account(given)
        if account is not None and (device := self._device(req, account)) is not None:
            return ["device:" + device]
        return ["addr:" + self.address(req)] + ([f"account:{account}"] if account else [])

    def _device(self, req: Request, account: str) -> str | None:
        """The nonce of the request's device cookie when it is ours, live and for ``account``."""
        exp, _, rest = req.cookies.get(DEVICE_COOKIE, "").partition(".")
        nonce, _, rest = rest.partition(".")
        owner, _, mac = rest.partition(".")
        if not (exp.isdigit() and nonce and owner == account and mac):
            return None
        if int(exp) < self.now().timestamp():
            return None
        good = self._device_mac(exp, nonce, account)
        return nonce if hmac.compare_digest(mac.encode(), good.encode()) else None

    def _device_mac(self, exp: str, nonce: str, account: str) -> str:
        msg = f"device:{exp}.{nonce}.{account}".encode()
        return hmac.new(self.session_key, msg, hashlib.sha256).hexdigest()

    def _device_cookie(self, req: Request, account: str) -> str:
        exp = str(int(self.now().timestamp()) + DEVICE_SECONDS)
        nonce = secrets.token_urlsafe(16)
        value = f"{exp}.{nonce}.{account}.{self._device_mac(exp, nonce, account)}"
        return (
            f"{DEVICE_COOKIE}={value}; Path={req.root or '/'}; HttpOnly; "
            f"SameSite=Strict; Max-Age={DEVICE_SECONDS}" + self._secure(req)
        )

    def allowed(self, req: Request) -> bool:
        """Whether ``req`` may look, and who asks (``req.user``): a trusted proxy's header, a
        personal token (Bearer or its session cookie), or the shared ``dashboard.token``
        (user :data:`SHARED`). On loopback anyone may look; a credential still names them,
        and a wrong Bearer token counts as a wrong guess there too."""
        req.user = self._proxy_user(req)
        if req.user is not None:
            return True
        if req.bearer is not None:  # a script's token: its guesses count as a form's
            req.user = self._token_user(req.bearer)
            if req.user is None:
                self.throttle.failed(self._counted(req, req.bearer), self.now().timestamp())
                return self.open
        else:
            req.user = self._session_user(req.cookies.get(COOKIE, ""))
        return self.open or req.user is not None

    def unauthenticated(self, req: Request) -> Response:
        """A request that may not look: a script's wrong token 401, a page's GET to the login,
        anything else 401."""
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
        if not team.names_others(self.app.db):  # a team's rules: the team's dashboard only
            return None
        return value if "@" in value else self.app.email_of(value)  # the team's member map

    def _held(self, req: Request) -> int:
        """Seconds a request offering a Bearer token must wait (0: none): its address or the
        account it tries has guessed wrong too often."""
        if req.bearer is None:
            return 0
        return self.throttle.wait(self._counted(req, req.bearer), self.now().timestamp())

    @functools.cached_property
    def session_key(self) -> bytes:
        """What signs the sessions of personal tokens: a random key in a 0600 file in the
        home, made once (sessions survive restarts and several workers). Never in the state:
        every member may read the database, and must not be able to forge a session. A key
        file that is not what was written (empty, short, a symlink, readable by others) is
        replaced, never trusted (:func:`provisioner.secretfile.key`)."""
        return secretfile.key(self.app.settings.home / "dashboard-session.key", SESSION_KEY_BYTES)

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
        """The sign-in form, on every address (on loopback, signing in is what lets one act);
        a right token: a session cookie, and a device cookie for its account."""
        if req.method != "POST":
            return self._login_page(req)
        given = req.form().get("token", "").strip()
        now, counted = self.now().timestamp(), self._counted(req, given)
        if wait := self.throttle.wait(counted, now):
            return self.too_many(req, wait)
        personal = tokens.verify(self.app, given) if given.startswith(tokens.PREFIX) else None
        if personal is None and not (self.token and same_secret(given, self.token)):
            self.throttle.failed(counted, now)
            return self._login_page(req, 401, failed=True)
        value = self._sign(int(time.time()) + SESSION_SECONDS, personal)
        cookie = (
            f"{COOKIE}={value}; Path={req.root or '/'}; HttpOnly; SameSite=Strict; "
            f"Max-Age={SESSION_SECONDS}" + self._secure(req)
        )
        account = personal.id if personal is not None else _SHARED_ACCOUNT
        return Response(
            status=303,
            headers=[
                ("Location", req.url("/")),
                ("Set-Cookie", cookie),
                ("Set-Cookie", self._device_cookie(req, account)),
            ],
        )

    def _login_page(self, req: Request, status: int = 200, **kw: Any) -> Response:
        return self.page(
            req,
            "login.html",
            status=status,
            configured=self.configured,
            loopback=self.open,
            **{"failed": False, **kw},
        )

    @property
    def configured(self) -> bool:
        """Whether any token can log in: the shared one, or a personal one."""
        return bool(self.token) or tokens.any_usable(self.app)

    def too_many(self, req: Request, wait: int) -> Response:
        """429 with ``Retry-After``: the form says how long; a script gets it in plain text."""
        if req.path == "/login":
            resp = self._login_page(req, 429, wait=wait)
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
