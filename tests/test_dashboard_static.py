"""The dashboard's CSS and script at versioned URLs: each page links them with their content's
hash (``?v=``), which is cached a year and immutable (RFC 9111 max-age, RFC 8246 immutable);
at any other URL — none, last release's hash — the browser revalidates (no-cache), so a new
release's stylesheet is never an hour late. Pages themselves are never stored."""

from __future__ import annotations

import hashlib
import re

from provisioner.dashboard import make_app
from provisioner.dashboard.wsgi import STATIC
from tests.test_dashboard import bare, call  # noqa: F401  (fixture)


def cache(headers) -> str:
    return dict(headers)["Cache-Control"]


def test_static_files_at_their_content_hash_are_cached_for_good_else_revalidated(bare):  # noqa: F811
    wsgi = make_app(bare)
    status, headers, page = call(wsgi, "/")
    assert status == 200 and cache(headers) == "no-store"
    links = {
        name: url for url, name in re.findall(r'(?:href|src)="(/static/([\w.]+)\?v=\w+)"', page)
    }
    assert set(links) == {"dashboard.css", "live.js"}
    for name, url in links.items():
        digest = hashlib.sha256((STATIC / name).read_bytes()).hexdigest()
        assert url.endswith("?v=" + digest[:16])  # the content's own hash
        status, headers, body = call(wsgi, url)
        assert status == 200 and cache(headers) == "public, max-age=31536000, immutable"
        assert body == (STATIC / name).read_text()
        for other in (f"/static/{name}", f"/static/{name}?v=0123456789abcdef"):
            status, headers, _ = call(wsgi, other)
            assert status == 200 and cache(headers) == "no-cache", other
