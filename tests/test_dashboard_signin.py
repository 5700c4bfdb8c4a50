"""Acting needs a signed-in person, on a loopback dashboard too (issue 33, point 7): anyone on
the computer may look there, but a form without a sign-in does nothing and the OS user serving
the dashboard never acts; wrong tokens are counted per client address and per account, so
neither fresh device cookies nor fresh addresses buy more guesses; the key that signs sessions
is trusted only as it was written."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlencode

import pytest
from sqlalchemy import select

from provisioner import machines, tokens
from provisioner.app import App
from provisioner.dashboard import make_app
from provisioner.dashboard.access import COOKIE
from provisioner.dashboard.web import Dashboard
from provisioner.models import Event, Machine
from provisioner.spec import Experiment
from tests.conftest import TEST_OWNER, make_settings, sandbox_experiment
from tests.test_dashboard import call, sign_in

BOB = "bob@example.com"
REFUSED = "refused: sign in (a personal token) to act on a machine"
KEY = "dashboard-session.key"


@pytest.fixture
def lab(home, clock, db_url):
    """ana's running ``train``; the dashboard's app is served by ``root@localhost`` (the OS
    user of the measured attack), on loopback."""
    a = App(make_settings(home, state_url=db_url), clock)
    a.actor = TEST_OWNER
    machines.up(a, Experiment.model_validate(sandbox_experiment("train")))
    ana = tokens.create(a, TEST_OWNER).token
    a.actor = BOB
    bob = tokens.create(a, BOB).token
    a.actor = "root@localhost"
    yield a, ana, bob
    a.close()


def train(app: App) -> Machine:
    with app.db.session() as s:
        return s.scalars(select(Machine).where(Machine.name == "train")).one()


def events(app: App) -> list[tuple[str, str | None]]:
    with app.db.session() as s:
        rows = s.scalars(select(Event).where(Event.machine_id == train(app).id).order_by(Event.id))
        return [(e.kind, e.actor) for e in rows]


def test_anonymous_stop_on_a_loopback_dashboard_is_refused_and_nothing_is_done(lab):
    app, _, _ = lab
    local = make_app(app, listen="127.0.0.1:8765")
    page = f"/machine/{train(app).id}"
    status, _, body = call(local, page)  # looking stays open on loopback
    assert status == 200 and "train" in body and 'id="act-stop"' not in body
    assert "Sign in with your personal token to act on this machine." in body
    assert 'id="sign-in"' in body  # the header's way in
    before = events(app)
    for form in ("do=stop&confirm=yes", "do=down&confirm=yes", "do=autostop&duration=1m"):
        status, _, body = call(local, page, "POST", form)
        assert status == 403 and REFUSED in body, form
    assert train(app).status == "running" and events(app) == before
    # the shared token names no one either: looking, yes; acting, no
    shared = Dashboard(app, token="s3cret-shared", open_access=True)
    session = sign_in(shared, "s3cret-shared")
    status, _, body = call(shared, page, "POST", "do=stop&confirm=yes", cookie=session)
    assert status == 403 and REFUSED in body and train(app).status == "running"


def test_the_signed_in_owner_stops_it_and_the_event_names_them(lab):
    app, ana, bob = lab
    local = make_app(app, listen="127.0.0.1:8765")
    page = f"/machine/{train(app).id}"
    status, _, body = call(local, "/login")
    assert status == 200 and "sign in with your personal token" in body
    as_bob = sign_in(local, bob)
    status, _, body = call(local, page, "POST", "do=stop&confirm=yes", cookie=as_bob)
    assert status == 403 and f"refused: {BOB} is not the owner of this machine" in body
    as_ana = sign_in(local, ana)
    status, _, body = call(local, page, cookie=as_ana)
    assert f'id="user">{TEST_OWNER}<' in body and 'id="act-stop"' in body
    status, _, _ = call(local, page, "POST", "do=stop&confirm=yes", cookie=as_ana)
    assert status == 303 and train(app).status == "stopped"
    assert events(app)[-1] == ("stopped", TEST_OWNER)  # not root@localhost, who serves it
    assert "root@localhost" not in {who for _, who in events(app)}


def test_a_loopback_dashboard_without_a_personal_token_says_how_to_make_one(home, clock):
    app = App(make_settings(home), clock)
    status, _, body = call(make_app(app, listen="127.0.0.1:8765"), "/login")
    assert (
        status == 200
        and 'id="login-none"' in body
        and "<code>provisioner token create</code>" in body
    )
    app.close()


def wrong(token: str) -> str:
    """``token`` with another secret: a guess at the same account."""
    head, _, secret = token.partition(".")
    return f"{head}.{'A' * len(secret)}"


def form(token: str) -> str:
    return urlencode({"token": token})


def test_the_address_count_survives_fresh_device_cookies_and_sessions(lab, clock):
    """Bob, signed in, mints a new device cookie (and session) before each guess at ana's
    token: the fifth wrong guess locks his address all the same, for ana's right token too."""
    app, ana, bob = lab
    local = make_app(app, listen="127.0.0.1:8765")
    here = "127.0.0.1"
    for _ in range(5):
        status, headers, _ = call(local, "/login", "POST", form(bob), here)
        assert status == 303  # a right token resets nothing
        device = next(v.split(";")[0] for k, v in headers if v.startswith("provisioner_device="))
        assert call(local, "/login", "POST", form(wrong(ana)), here, cookie=device)[0] == 401
        clock.advance(timedelta(seconds=10))
    status, headers, body = call(local, "/login", "POST", form(ana), here, cookie=device)
    assert status == 429 and dict(headers)["Retry-After"] == "850"  # 15 min after the first
    assert (
        "Too many failed sign-ins from this address or with this token: try again in 850 s." in body
    )
    # a Bearer try is a try: refused the same way, while looking without one stays open
    status, _, body = call(local, "/", here, authorization=f"Bearer {ana}")
    assert status == 429 and body == "too many failed logins: try again in 850 s"
    assert call(local, "/", here)[0] == 200
    clock.advance(timedelta(seconds=850))
    assert call(local, "/login", "POST", form(ana), here)[0] == 303


def test_the_account_count_holds_across_addresses(lab, clock):
    """Five wrong guesses at ana's token from five addresses: the sixth address waits too, with
    the right token; ana's browser that signed in before does not."""
    app, ana, _ = lab
    wide = Dashboard(app, token=None, open_access=False)
    status, headers, _ = call(wide, "/login", "POST", form(ana), "198.51.100.1")
    assert status == 303
    device = next(v.split(";")[0] for k, v in headers if v.startswith("provisioner_device="))
    for i in range(5):
        assert call(wide, "/login", "POST", form(wrong(ana)), f"203.0.113.{i + 1}")[0] == 401
    status, headers, body = call(wide, "/login", "POST", form(ana), "203.0.113.99")
    assert status == 429 and dict(headers)["Retry-After"] == "900"
    assert "try again in 900 s." in body
    status, _, _ = call(
        wide, "/spend.csv", "GET", "", "203.0.113.98", authorization=f"Bearer {ana}"
    )
    assert status == 429  # a script's Bearer tries the same account
    assert call(wide, "/login", "POST", form(ana), "198.51.100.1", cookie=device)[0] == 303
    clock.advance(timedelta(minutes=15))
    assert call(wide, "/login", "POST", form(ana), "203.0.113.99")[0] == 303


def test_behind_a_trusted_proxy_the_forwarded_address_is_counted(home, clock):
    """The proxy's own address is everyone's: the address it appends to X-Forwarded-For is
    counted instead; from any other peer that header is anyone's to write and is ignored."""
    app = App(make_settings(home, identity={"trusted_proxies": ["10.0.0.5"]}), clock)
    app.actor = TEST_OWNER
    ana = tokens.create(app, TEST_OWNER).token
    wide = Dashboard(app, token=None, open_access=False)
    proxy, guesser, colleague = "10.0.0.5", "203.0.113.9", "198.51.100.4"
    for _ in range(5):  # guesses at no known token: they count on the address alone
        assert call(wide, "/login", "POST", "token=guess", proxy, X_FORWARDED_FOR=guesser)[0] == 401
    assert call(wide, "/login", "POST", form(ana), proxy, X_FORWARDED_FOR=guesser)[0] == 429
    assert call(wide, "/login", "POST", form(ana), proxy, X_FORWARDED_FOR=colleague)[0] == 303
    # an untrusted peer cannot pick a fresh address for each guess
    for i in range(5):
        fake = f"192.0.2.{i + 1}"
        assert (
            call(wide, "/login", "POST", "token=guess", "198.51.100.66", X_FORWARDED_FOR=fake)[0]
            == 401
        )
    assert (
        call(wide, "/login", "POST", form(ana), "198.51.100.66", X_FORWARDED_FOR="192.0.2.77")[0]
        == 429
    )
    app.close()


# --- the key that signs sessions ------------------------------------------------------------


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:16])


def _readable(path: Path) -> None:
    path.chmod(0o644)


def _symlink(path: Path) -> None:
    elsewhere = path.with_name("elsewhere.key")
    os.replace(path, elsewhere)  # the very key, 0600: as a link it is still not ours
    path.symlink_to(elsewhere)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path, 0o600)


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        (_empty, "0 bytes, not the 32 of a key made here"),
        (_short, "16 bytes, not the 32 of a key made here"),
        (_readable, "mode 0644: others may read or write it"),
        (_symlink, "a symlink, not the key file made here"),
        (_fifo, "not a regular file"),
    ],
)
def test_a_bad_session_key_is_replaced_never_trusted(home, clock, caplog, spoil, why):
    app = App(make_settings(home), clock)
    app.actor = TEST_OWNER
    issued = tokens.create(app, TEST_OWNER)
    session = sign_in(Dashboard(app, token=None, open_access=False), issued.token)
    path = home / KEY
    assert path.stat().st_mode & 0o777 == 0o600 and path.stat().st_size == 32
    spoil(path)
    caplog.set_level(logging.INFO, logger="provisioner")
    fresh = Dashboard(app, token=None, open_access=False)  # a restart reads the file again
    status, headers, _ = call(fresh, "/", cookie=session)
    assert status == 303 and dict(headers)["Location"] == "/login"  # its sessions ended
    lines = [r.getMessage() for r in caplog.records if r.name == "provisioner.secretfile"]
    assert len(lines) == 1 and str(path) in lines[0] and why in lines[0], lines
    assert "replaced with a new key" in lines[0]
    st = path.lstat()
    assert not path.is_symlink() and path.is_file()
    assert st.st_size == 32 and st.st_mode & 0o777 == 0o600
    if spoil is _symlink:  # the link's target is left as it was
        assert path.with_name("elsewhere.key").stat().st_size == 32
    # the new key is kept: a new session survives the next restart, said nothing more
    session = sign_in(fresh, issued.token)
    again = Dashboard(app, token=None, open_access=False)
    status, _, body = call(again, "/", cookie=session)
    assert status == 200 and f'id="user">{TEST_OWNER}<' in body
    assert len([r for r in caplog.records if r.name == "provisioner.secretfile"]) == 1
    app.close()


def test_an_empty_key_file_planted_before_the_start_signs_nothing_forgeable(home, clock):
    """The measured attack: a 0-byte key was trusted, so anyone who read a token's row (every
    member may read the state) could sign a session with the empty key."""
    app = App(make_settings(home), clock)
    app.actor = TEST_OWNER
    issued = tokens.create(app, TEST_OWNER)
    home.mkdir(parents=True, exist_ok=True)
    (home / KEY).write_bytes(b"")
    (home / KEY).chmod(0o600)
    row = tokens.by_id(app, issued.id)
    assert row is not None
    exp = int(clock.now().timestamp()) + 10**9
    msg = f"session:{exp}:{row.id}:{row.hash}".encode()
    forged = f"{COOKIE}={exp}.{row.id}.{hmac.new(b'', msg, hashlib.sha256).hexdigest()}"
    status, _, _ = call(Dashboard(app, token=None, open_access=False), "/", cookie=forged)
    assert status == 303  # to the login: no one signed in
    assert (home / KEY).stat().st_size == 32
    app.close()


def test_a_good_session_key_is_kept(home, clock, caplog):
    app = App(make_settings(home), clock)
    app.actor = TEST_OWNER
    issued = tokens.create(app, TEST_OWNER)
    session = sign_in(Dashboard(app, token=None, open_access=False), issued.token)
    before = (home / KEY).read_bytes()
    caplog.set_level(logging.INFO, logger="provisioner")
    status, _, body = call(Dashboard(app, token=None, open_access=False), "/", cookie=session)
    assert status == 200 and f'id="user">{TEST_OWNER}<' in body
    assert (home / KEY).read_bytes() == before
    assert not [r for r in caplog.records if r.name == "provisioner.secretfile"]
    app.close()
