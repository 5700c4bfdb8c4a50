"""An HTTP POST that goes only where it should: to a public address, or to one settings allow.

The host is resolved once, every address it resolves to is checked (loopback, link-local,
private, shared, reserved, multicast and cloud metadata addresses such as 169.254.169.254 and
fd00:ec2::254 are refused unless ``allow`` names the host or a network holding the address),
and the connection is made to the checked address itself, so a name that resolves elsewhere a
moment later (DNS rebinding) cannot swap it. Redirects are never followed: a POST redirected is
a GET without its body on most clients, and the target is the receiver's choice, not ours.

Only the status, the headers and at most :data:`MAX_BODY` bytes of the answer come back; a
failure is an :class:`Unreachable` whose message is a short reason (the error's class), never
the URL (it may hold a token) or the answer.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
from collections.abc import Sequence
from urllib.parse import urlsplit

MAX_BODY = 65_536  # enough for any documented JSON answer; the rest is not read
#: names of a cloud's metadata service, refused before they resolve (GCP's, and the short
#: names a cloud's resolver answers on its own machines)
METADATA_NAMES = frozenset(
    {"metadata.google.internal", "metadata.goog", "metadata", "instance-data"}
)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class Unreachable(Exception):
    """The POST was not made or got no answer: refused here, or a network failure."""

    def __init__(self, reason: str, *, refused: bool = False) -> None:
        super().__init__(reason)
        self.refused = refused  # by our rules (for good), not by the network (may pass)


def _allowed(host: str, ip: Address, allow: Sequence[str]) -> bool:
    for entry in allow:
        if entry.lower() == host:
            return True
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False


def _public(ip: Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return _public(ip.ipv4_mapped)
    return ip.is_global and not ip.is_multicast


def resolve(host: str, port: int, allow: Sequence[str]) -> str:
    """The address to connect to for ``host``: every address it resolves to must be public or
    allowed, else :class:`Unreachable` (refused) naming the host and the kind of address."""
    host = host.lower().rstrip(".")
    if host in METADATA_NAMES and host not in [a.lower() for a in allow]:
        raise Unreachable(f"{host} is a local or metadata name; not allowed", refused=True)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise Unreachable(f"{host} does not resolve ({type(e).__name__})") from None
    addresses = [ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos]
    for ip in addresses:
        if not _public(ip) and not _allowed(host, ip, allow):
            raise Unreachable(
                f"{host} resolves to {ip}, a non-public address; add it to notify.allow "
                "in settings to send there",
                refused=True,
            )
    return str(addresses[0])


class _Pinned(http.client.HTTPConnection):
    def __init__(self, host: str, port: int, ip: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.ip = ip

    def connect(self) -> None:
        self.sock = socket.create_connection((self.ip, self.port), self.timeout)


class _PinnedTLS(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, ip: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.ip = ip

    def connect(self) -> None:  # TLS to the checked address, the certificate checked for host
        sock = socket.create_connection((self.ip, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]


def post(
    url: str, body: bytes, headers: dict[str, str], *, allow: Sequence[str], timeout: float
) -> tuple[int, bytes, dict[str, str]]:
    """POST ``body`` to ``url``: (status, at most :data:`MAX_BODY` bytes, headers). A 3xx is
    returned as it is, never followed."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
    except ValueError as e:
        raise Unreachable(f"not a URL ({type(e).__name__})", refused=True) from None
    if parts.scheme not in ("http", "https") or not host:
        raise Unreachable("not an http:// or https:// URL", refused=True)
    port = port or (443 if parts.scheme == "https" else 80)
    ip = resolve(host, port, allow)
    kind = _PinnedTLS if parts.scheme == "https" else _Pinned
    conn = kind(host, port, ip, timeout)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        try:
            conn.putrequest("POST", path)
        except (ValueError, http.client.InvalidURL) as e:  # a control character, non-ASCII
            why = f"not a URL a request can carry ({type(e).__name__})"
            raise Unreachable(why, refused=True) from None
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, r.read(MAX_BODY), dict(r.headers)
    except (OSError, ValueError, http.client.HTTPException) as e:
        raise Unreachable(type(e).__name__) from None
    finally:
        conn.close()
