"""Secrets taken out of text, in whatever form the text carries them.

A secret read from a file often ends in a newline (a Kubernetes secret made from a file, an
EnvironmentFile with CRLF), and an error message may quote it raw, as ``repr`` or JSON would
(``\\n`` escaped, quotes doubled), URL-encoded (in a URL), HTML-escaped, or broken across lines.
:func:`redact` replaces each of these forms of each secret with ``***``: the whole secret, the
secret without the whitespace around it, and each line of a secret that holds several.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterable
from urllib.parse import quote, quote_plus

MASK = "***"
SHORTEST = 4  # a shorter value is no secret worth the name, and masking it would garble text


def forms(secret: str) -> set[str]:
    """Every way ``secret`` (or one of its lines) may be written in a message or a page."""
    core = secret.strip()
    pieces = {secret, core, *(line.strip() for line in re.split(r"\r\n|\r|\n", core))}
    out: set[str] = set()
    for p in pieces:
        if len(p) < SHORTEST:
            continue
        out |= {
            p,
            repr(p)[1:-1],
            json.dumps(p)[1:-1],
            json.dumps(p, ensure_ascii=False)[1:-1],
            p.encode("unicode_escape").decode("ascii"),
            quote(p, safe=""),
            quote(p),
            quote_plus(p),
            html.escape(p),
            html.escape(p, quote=False),
        }
    return {f for f in out if len(f) >= SHORTEST}


def _pattern(form: str) -> str:
    """``form``, found also where a line break (raw or escaped) splits it anywhere."""
    brk = r"(?:\r?\n|\\r\\n|\\n)?"
    return brk.join(re.escape(c) for c in form)


def redactor(secrets: Iterable[str | None]) -> re.Pattern[str] | None:
    """One pattern for every form of every secret, the longest first; None: nothing to hide."""
    every = set()
    for s in secrets:
        if s and len(s.strip()) >= SHORTEST:
            every |= forms(s)
    if not every:
        return None
    return re.compile("|".join(_pattern(f) for f in sorted(every, key=len, reverse=True)))


def redact(text: str, secrets: Iterable[str | None]) -> str:
    """``text`` without any form of any of ``secrets``."""
    pattern = redactor(secrets)
    return pattern.sub(MASK, text) if pattern else text
