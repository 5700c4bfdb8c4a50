"""Who may look at the dashboard, and who asks.

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
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import math
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from provisioner import team, tokens
from provisioner.app import App
from provisioner.dashboard.site import Site
from provisioner.dashboard.wsgi import Request, Response, host_name
from provisioner.models import Token

COOKIE = "provisioner_session"
SHARED = "dashboard.token"  # the user of the shared token (settings), whoever holds it
DEVICE_COOKIE = "provisioner_device"
SESSION_SECONDS = 12 * 3600
DEVICE_SECONDS = 90 * 24 * 3600  # a browser that logged in keeps its own guess count this long


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
