"""Personal tokens: how the dashboard (and scripts calling it) know a user.

``provisioner token create --user alice@example.com`` prints ``pvt_<id>.<secret>`` once. The
state keeps the id, the user and a salted SHA-256 of the secret, never the secret: 32 random
bytes need no slow hash (a slow one is for guessable passwords), and a salted hash read from
a backup cannot be replayed. A token may expire and may be revoked; either ends it at once,
and with it every dashboard session it opened (their cookies are signed with its hash).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select

from provisioner import identity
from provisioner.app import App
from provisioner.errors import UserError
from provisioner.models import Token

PREFIX = "pvt_"
_TOKEN_RE = re.compile(r"^pvt_([0-9a-f]{12})\.([A-Za-z0-9_-]{20,100})$")
_EMAIL_RE = re.compile(r"^[^@\s]+@[^@\s]+$")


@dataclass(frozen=True)
class Issued:
    id: str
    user: str
    token: str  # shown once, never stored
    expires_at: datetime | None


def digest(salt: str, secret: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt) + secret.encode()).hexdigest()


def create(app: App, user: str, expires: timedelta | None = None) -> Issued:
    """A new token of ``user``: for oneself, or for another when a policy grants the actor
    ``act_as`` that user (an admin issuing a member's token)."""
    user = user.strip()
    if not _EMAIL_RE.match(user) or len(user) > 128:
        raise UserError(f"--user: not an e-mail address: {user!r}")
    _may_manage(app, user)
    now = app.clock.now()
    token_id, secret, salt = secrets.token_hex(6), secrets.token_urlsafe(32), secrets.token_hex(16)
    expires_at = None if expires is None else now + expires
    with app.db.session() as s:
        s.add(
            Token(
                id=token_id,
                user=user,
                salt=salt,
                hash=digest(salt, secret),
                created_at=now,
                created_by=app.actor,
                expires_at=expires_at,
            )
        )
    return Issued(token_id, user, f"{PREFIX}{token_id}.{secret}", expires_at)


def listing(app: App) -> list[Token]:
    with app.db.session() as s:
        return list(s.scalars(select(Token).order_by(Token.created_at, Token.id)))


def revoke(app: App, token_id: str) -> Token:
    token_id = token_id.removeprefix(PREFIX).split(".")[0]
    with app.db.session() as s:
        t = s.get(Token, token_id)
        if t is None:
            raise UserError(f"no token {token_id!r} (see `provisioner token list`)")
        if t.created_by != app.actor:
            _may_manage(app, t.user)
        if t.revoked_at is None:
            t.revoked_at = app.clock.now()
        return t


def _may_manage(app: App, user: str) -> None:
    who = app.actor
    if user == who or identity.grants(app.policies, who, user):
        return
    raise UserError(
        f"{user} is not you ({who}): a token of another user needs a policy's act_as "
        f"granting you that user"
    )


def verify(app: App, token: str) -> Token | None:
    """The live token ``token`` is, or None (unknown, wrong, revoked or expired)."""
    m = _TOKEN_RE.match(token.strip())
    if not m:
        return None
    with app.db.session() as s:
        t = s.get(Token, m.group(1))
    if t is None or not usable(app, t):
        return None
    if not hmac.compare_digest(digest(t.salt, m.group(2)), t.hash):
        return None
    return t


def named(app: App, token: str) -> str | None:
    """The id a token-shaped string names when the state knows that token (live or not): what
    the dashboard counts wrong guesses against; None for any other string."""
    m = re.match(r"^pvt_([0-9a-f]{12})\.", token.strip())
    if not m:
        return None
    with app.db.session() as s:
        return m.group(1) if s.get(Token, m.group(1)) is not None else None


def usable(app: App, t: Token) -> bool:
    return t.revoked_at is None and (t.expires_at is None or app.clock.now() < t.expires_at)


def by_id(app: App, token_id: str) -> Token | None:
    """A live token by its id (a dashboard session names it; its hash signs the cookie)."""
    if not re.fullmatch(r"[0-9a-f]{12}", token_id):
        return None
    with app.db.session() as s:
        t = s.get(Token, token_id)
    return t if t is not None and usable(app, t) else None


def any_usable(app: App) -> bool:
    """Whether a live token exists (the dashboard's login form is then worth showing)."""
    now = app.clock.now()
    with app.db.session() as s:
        q = select(Token.id).where(
            Token.revoked_at.is_(None), (Token.expires_at.is_(None)) | (Token.expires_at > now)
        )
        return s.scalars(q.limit(1)).first() is not None
