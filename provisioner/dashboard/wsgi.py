"""The dashboard's HTTP: a request (its cookies, form, CSRF token, Bearer token), a response
(the security headers, gzip, no caching of pages), which hosts it answers to, and its static
files.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import mimetypes
import re
import secrets
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

STATIC = Path(__file__).resolve().parent.parent / "static" / "dashboard"
CSRF_COOKIE = "provisioner_csrf"
_CSRF_RE = re.compile(r"[A-Za-z0-9_-]{32,128}")
# where /lang may send the browser back to: a path on this site. Not "//host" or "/\host"
# (a browser reads both as another host), nor a control character or space (a browser drops
# tabs and newlines from a URL, so "/\t/host" is "//host")
_BACK_RE = re.compile(r"/(?![/\\])[^\\\x00-\x20\x7f]*")
MAX_FORM = 256 * 1024  # a pasted experiment file is a few kB
GZIP_FROM = 2048  # bytes: smaller pages are not worth compressing
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


#: a static file asked for at its current version: the URL changes with the content, so the
#: browser keeps it a year and never asks again (RFC 9111 §5.2.2.1 max-age; RFC 8246
#: "immutable"); at any other address (none, an old version) it asks each time (no-cache)
FOREVER = "public, max-age=31536000, immutable"


def static_version(name: str) -> str:
    """The content's hash that versions a static file's URL (``?v=``): a new release's CSS is
    a new URL, so no browser keeps last release's for an hour."""
    path = STATIC / name
    return _hash(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _hash(path: Path, _mtime: int) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def static_url(req: Request, name: str) -> str:
    return req.url(f"/static/{name}", v=static_version(name))


def static_file(name: str, version: str | None = None) -> Response:
    """A file of the dashboard's own folder, cached for good when asked for at its
    :func:`static_version`, else revalidated; anything else (``..``, a NUL, a backslash, a
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
    body = path.read_bytes()
    current = version == _hash(path, path.stat().st_mtime_ns)
    return Response(
        body, ctype=ctype, headers=[("Cache-Control", FOREVER if current else "no-cache")]
    )
