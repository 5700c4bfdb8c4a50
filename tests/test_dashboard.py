"""The team dashboard against a seeded state — a sandbox fleet, most of November's usage, two
budgets, heartbeats — seeded through the product's own API on a ManualClock: in Debian's chromium
(Selenium through /usr/bin/chromedriver), each page checked against ``provisioner report -o json``
and screenshotted (80 %, 150 % zoom, a 400 px window) into $PROVISIONER_SCREENSHOTS (default: a
pytest temporary directory); and as plain
WSGI: the token gate when bound beyond loopback, the CSV, the Plan page."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.request
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from urllib.parse import urlencode
from wsgiref.util import setup_testing_defaults

import pytest

from provisioner import heartbeats, machines, startup
from provisioner.app import App
from provisioner.clock import CLOCK_ENV
from provisioner.dashboard import Dashboard, make_app
from provisioner.spec import Experiment
from tests.conftest import (
    TEST_START,
    make_settings,
    run_cli,
    sandbox_experiment,
    write_settings,
    write_yaml,
)

NOW = datetime(2026, 11, 26, 10, 0, tzinfo=UTC)  # a Thursday: 11:00 in Berlin, in hours
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"

POLICIES = [
    {
        "name": "demo-budget",
        "applies_to": {"projects": ["demo"]},
        "budget": {"amount": "1200 USD", "alerts": {"actual": [50, 80, 100]}},
        "off_hours": {
            "timezone": "Europe/Berlin",
            "windows": [{"days": "mon-fri", "start": "19:20", "end": "07:00"}],
        },
    },
    {
        "name": "vision-budget",
        "applies_to": {"projects": ["vision"]},
        "budget": {"amount": "20000 RUB", "language": "ru"},
    },
]


def up(app, name, project="demo", owner="ana@example.com", **res) -> None:
    e = sandbox_experiment(name, **res) | {"project": project, "owner": owner}
    app.actor = owner  # each owner launches their own (provisioner.identity)
    machines.up(app, Experiment.model_validate(e))


def seed(home: Path, clock, db_url: str | None = None) -> tuple[App, Path]:
    """November up to the 26th, by the product's own calls; the budgets arrive afterwards
    (their guard would have refused some of these launches)."""
    pdir = home.parent / "policies"
    pdir.mkdir(parents=True, exist_ok=True)
    a = App(make_settings(home, state_url=db_url), clock)
    clock.set(TEST_START)  # Mon Nov 2 09:00
    up(a, "train-a")  # T4 spot, USD: runs all month
    up(a, "eval-ru", owner="bob@example.com", market="reserved", regions=["sandbox-ru"])
    up(a, "seg-1", project="vision", owner="carol@example.com")
    clock.set(datetime(2026, 11, 5, 10, tzinfo=UTC))
    up(a, "big-a100", gpu="A100:1", market="reserved")
    clock.set(datetime(2026, 11, 12, 18, tzinfo=UTC))
    machines.down(a, "big-a100")
    clock.set(datetime(2026, 11, 16, 9, tzinfo=UTC))
    up(a, "seg-2", project="vision", owner="carol@example.com", regions=["sandbox-ru"])
    clock.set(datetime(2026, 11, 20, 20, tzinfo=UTC))  # the scheduler's idle stop
    machines.stop(
        a,
        "seg-2",
        reason="off-hours-idle",
        detail={"why": "GPUs below 5% for 30 min", "idle_since": "2026-11-20T19:00:00+00:00"},
    )
    # the last two hours: heartbeats from the live machines' agents
    clock.set(NOW - timedelta(hours=2))
    from sqlalchemy import select

    from provisioner.models import Machine

    with a.db.session() as s:
        live = {m.name: m.id for m in s.scalars(select(Machine).where(Machine.status == "running"))}
    for mid in live.values():
        startup.issue_token(a, mid)
    for i in range(24):
        for k, (_, mid) in enumerate(sorted(live.items())):
            util = [80.0 + (i % 5) * 3, 2.0, 40.0 + 20 * ((i // 4) % 2)][k % 3]
            heartbeats.record(a, mid, [{"index": 0, "util": util, "mem_used_mb": 1000}])
        clock.advance(timedelta(minutes=5))
    clock.set(NOW)
    for p in POLICIES:
        write_yaml(pdir / f"{p['name']}.yaml", p)
    a.close()
    exps = home.parent / "experiments"
    exps.mkdir(exist_ok=True)
    write_yaml(exps / "a100.yaml", sandbox_experiment("try-a100", gpu="A100:1", market="reserved"))
    dash = App(
        make_settings(
            home, state_url=db_url, policies=[str(pdir)], dashboard={"experiments": [str(exps)]}
        ),
        clock,
    )
    return dash, pdir


CSRF = "t" * 43  # the double-submit pair a page's form sends: its cookie and its hidden field


def call(
    wsgi,
    path: str,
    method: str = "GET",
    body: str = "",
    remote="127.0.0.1",
    csrf: bool = True,
    **headers: str,
):
    """One request through the WSGI callable from ``remote``: (status code, headers, text).
    A POST carries the form's CSRF token and its cookie, as a page's form does (``csrf=False``:
    as a form on another site would, without them)."""
    if method == "POST" and csrf:
        body += ("&" if body else "") + f"csrf={CSRF}"
        headers["cookie"] = "; ".join(
            c for c in (headers.get("cookie"), f"provisioner_csrf={CSRF}") if c
        )
    env: dict = {"REQUEST_METHOD": method, "REMOTE_ADDR": remote}
    path, _, query = path.partition("?")
    env["PATH_INFO"], env["QUERY_STRING"] = path, query
    setup_testing_defaults(env)
    raw = body.encode()
    env["wsgi.input"] = io.BytesIO(raw)
    env["CONTENT_LENGTH"] = str(len(raw))
    if method == "POST":
        env["CONTENT_TYPE"] = "application/x-www-form-urlencoded"
    for k, v in headers.items():
        env["HTTP_" + k.upper()] = v
    got: dict = {}

    def start_response(status, hdrs, exc_info=None):
        got["status"], got["headers"] = int(status.split()[0]), hdrs

    out = b"".join(wsgi(env, start_response))
    return got["status"], got["headers"], out.decode()


def sign_in(wsgi, token: str, remote: str = "127.0.0.1", **headers: str) -> str:
    """The session cookie (``name=value``) the login form gives for ``token``."""
    status, hdrs, _ = call(wsgi, "/login", "POST", urlencode({"token": token}), remote, **headers)
    assert status == 303, status
    [cookie] = [v for k, v in hdrs if k == "Set-Cookie" and v.startswith("provisioner_session=")]
    return cookie.split(";")[0]


def report_json(a: App, pdir: Path, *args: str) -> dict:
    cfg = write_settings(a.settings.home, policies=[str(pdir)], state_url=a.settings.state_url)
    r = run_cli("--config", str(cfg), "report", *args, "-o", "json", now=NOW)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def money_text(m: dict) -> str:
    """How the English pages write an amount (Babel, en_US)."""
    from provisioner.money import Money
    from provisioner.render import Fmt

    return Fmt("en").money(Money(Decimal(m["amount"]), m["currency"]))


# --- plain WSGI ------------------------------------------------------------------------------


@pytest.fixture
def seeded(home, clock, db_url):
    """The seeded state on SQLite and on PostgreSQL; the CLI is pointed at the same one."""
    a, pdir = seed(home, clock, db_url)
    yield a, pdir
    a.close()


def test_loopback_is_open_and_wide_binding_refuses_without_the_token(seeded):
    a, _ = seeded
    status, _, html = call(make_app(a, listen="127.0.0.1:8765"), "/")
    assert status == 200 and "train-a" in html
    # bound beyond loopback with no token set: every page refused, the login says why
    closed = make_app(a, listen="0.0.0.0:8765")
    status, headers, _ = call(closed, "/")
    assert status == 303 and dict(headers)["Location"] == "/login"
    for path in ("/spend", "/spend.csv", "/machine/train-a", "/plan"):
        status, _, body = call(closed, path, "POST" if path == "/plan" else "GET")
        assert status in (303, 401) and "train-a" not in body and "$" not in body
    assert "PROVISIONER_DASHBOARD_TOKEN" in call(closed, "/login")[2]
    assert call(closed, "/login", "POST", "token=")[0] == 401


def test_token_once_on_the_login_form_becomes_a_strict_session_cookie(seeded, monkeypatch):
    a, _ = seeded
    token = "s3cret-dashboard-token"
    monkeypatch.setenv("PROVISIONER_DASHBOARD_TOKEN", token)
    wsgi = make_app(a, listen="10.1.2.3:8765")
    status, _, body = call(wsgi, "/spend")
    assert status == 303
    status, _, body = call(wsgi, "/login", "POST", "token=wrong")
    assert status == 401 and "not the dashboard" in body
    status, headers, _ = call(wsgi, "/login", "POST", urlencode({"token": token}))
    assert status == 303
    [cookie] = [v for k, v in headers if k == "Set-Cookie" and v.startswith("provisioner_session=")]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert token not in cookie  # a signature over an expiry, not the token
    session = cookie.split(";")[0]
    status, _, page = call(wsgi, "/spend", cookie=session)
    assert status == 200 and "demo-budget" in page and token not in page
    assert call(wsgi, "/spend", cookie=session[:-4] + "beef")[0] == 303  # forged: refused
    assert call(wsgi, "/spend.csv", authorization=f"Bearer {token}")[0] == 200
    assert call(wsgi, "/spend.csv", authorization="Bearer nope")[0] == 401


def test_guessing_the_token_is_slowed_per_address_and_account(seeded, clock, monkeypatch):
    """Five wrong tokens within 15 minutes, on the form or as a Bearer header: then that
    address waits (429, Retry-After) even with the right token, and so does anyone trying the
    same (shared) token who has not signed in with it before; a browser that has, does not."""
    a, _ = seeded
    token = "s3cret-dashboard-token"
    monkeypatch.setenv("PROVISIONER_DASHBOARD_TOKEN", token)
    wsgi = make_app(a, listen="10.1.2.3:8765")
    right, wrong = urlencode({"token": token}), "token=guess"
    guesser, colleague, stranger = "203.0.113.9", "198.51.100.4", "192.0.2.8"
    status, headers, _ = call(wsgi, "/login", "POST", right, remote=colleague)
    [device] = [v.split(";")[0] for k, v in headers if v.startswith("provisioner_device=")]
    for _ in range(4):
        assert call(wsgi, "/login", "POST", wrong, remote=guesser)[0] == 401
        clock.advance(timedelta(seconds=5))
    assert call(wsgi, "/spend.csv", remote=guesser, authorization="Bearer guess")[0] == 401
    status, headers, body = call(wsgi, "/login", "POST", right, remote=guesser)
    assert status == 429 and dict(headers)["Retry-After"] == "880"  # the first guess + 15 min
    assert "Too many failed sign-ins from this address or with this token" in body
    assert "try again in 880 s" in body
    ru = call(wsgi, "/login", "POST", right, remote=guesser, cookie="provisioner_lang=ru")
    assert ru[0] == 429 and "попробуйте снова через 880 с" in ru[2]
    status, headers, body = call(
        wsgi, "/spend.csv", remote=guesser, authorization=f"Bearer {token}"
    )
    assert status == 429 and dict(headers)["Retry-After"] == "880"
    assert body == "too many failed logins: try again in 880 s"
    assert call(wsgi, "/login", "POST", right, remote=stranger)[0] == 429  # the account's
    assert call(wsgi, "/login", "POST", right, remote=colleague, cookie=device)[0] == 303
    clock.advance(timedelta(seconds=879))
    assert call(wsgi, "/login", "POST", right, remote=guesser)[0] == 429
    clock.advance(timedelta(seconds=1))  # the first guess is 15 minutes old: one more try
    assert call(wsgi, "/login", "POST", wrong, remote=guesser)[0] == 401
    status, headers, _ = call(wsgi, "/login", "POST", right, remote=guesser)
    assert status == 429 and dict(headers)["Retry-After"] == "5"
    clock.advance(timedelta(seconds=5))
    assert call(wsgi, "/login", "POST", right, remote=guesser)[0] == 303


def test_pages_travel_compressed_to_browsers_that_take_it(seeded):
    import gzip

    wsgi = make_app(seeded[0])
    cookie = f"provisioner_csrf={CSRF}"  # the rows' act forms carry it: the same in both
    env: dict = {"REQUEST_METHOD": "GET", "PATH_INFO": "/", "HTTP_ACCEPT_ENCODING": "gzip, br"}
    env["HTTP_COOKIE"] = cookie
    setup_testing_defaults(env)
    got: dict = {}
    raw = b"".join(wsgi(env, lambda status, hdrs, exc=None: got.update(hdrs)))
    assert got["Content-Encoding"] == "gzip" and got["Content-Length"] == str(len(raw))
    plain = call(wsgi, "/", cookie=cookie)[2]
    assert gzip.decompress(raw).decode() == plain  # the same page, smaller
    assert len(raw) < len(plain.encode()) / 3


def test_russian_pages_and_report_say_the_schedulers_words_in_russian(seeded):
    """States, markets, events, rates per hour and the savings' reasons: in Russian on the
    Russian pages and in the Russian report, not the scheduler's English names."""
    a, pdir = seeded
    wsgi = make_app(a)
    ru = {"cookie": "provisioner_lang=ru"}
    fleet = call(wsgi, "/", **ru)[2]
    assert ">работает</span>" in fleet and ">running</span>" not in fleet
    assert "прерываемая" in fleet and "₽/ч" in fleet and "/h<" not in fleet
    machine = call(wsgi, "/machine/seg-2", **ru)[2]
    assert ">остановлена</span>" in machine and "простой в нерабочее время" in machine
    assert "<td>запущена</td>" in machine and "<td>launched</td>" not in machine
    cfg = write_settings(a.settings.home, policies=[str(pdir)], state_url=a.settings.state_url)
    r = run_cli("--config", str(cfg), "report", "--project", "vision", "--language", "ru", now=NOW)
    assert r.returncode == 0, r.stderr
    assert "простой в нерабочее время" in r.stdout and "off-hours-idle" not in r.stdout
    assert ">running</span>" in call(wsgi, "/")[2]  # English stays English


def test_csv_is_the_reports_csv(seeded, home):
    a, pdir = seeded
    wsgi = make_app(a)
    status, headers, body = call(wsgi, "/spend.csv?budget=demo-budget&by=owner")
    assert status == 200
    h = dict(headers)
    assert h["Content-Type"].startswith("text/csv")
    assert h["Content-Disposition"] == 'attachment; filename="spend-demo-budget-2026-11.csv"'
    rows = list(csv.DictReader(io.StringIO(body)))
    owners = {r["owner"] for r in rows}
    assert owners == {"ana@example.com", "bob@example.com"}  # demo's only: the budget's scope
    total = sum(Decimal(r["amount_USD"]) for r in rows)
    cli = report_json(a, pdir, "--project", "demo")
    assert total.quantize(Decimal("0.01")) == Decimal(cli["total"]["amount"])


def test_plan_page_ranks_offers_and_says_bad_input_like_the_cli(seeded):
    a, _ = seeded
    wsgi = make_app(a)
    good = "name: try\nproject: demo\nowner: ana@example.com\nresources:\n  gpu: T4:1\n"
    good += "  market: spot\n  clouds: [sandbox]\n"
    status, _, html = call(wsgi, "/plan", "POST", urlencode({"text": good}))
    assert status == 200
    assert 'id="candidates"' in html and "sandbox-us" in html
    assert "budget demo-budget (2026-11)" in html  # the budget verdict, as `plan` prints it
    assert "as <code>provisioner plan</code> gives them" in html and "`" not in html
    bad = good.replace("gpu: T4:1", "gpu: T4:1\n  colour: blue")
    status, _, html = call(wsgi, "/plan", "POST", urlencode({"text": bad}))
    assert status == 200 and "pasted:6: resources.colour: unknown field" in html
    assert 'id="candidates"' not in html
    # a file the page offers
    [offered] = [ln for ln in call(wsgi, "/plan")[2].splitlines() if "a100.yaml" in ln]
    path = offered.split('value="')[1].split('"')[0]
    status, _, html = call(wsgi, "/plan", "POST", urlencode({"file": path}))
    assert "try-a100: A100:1 reserved" in html and "sbx-a100-1" in html
    # a path the page did not offer is never read
    status, _, html = call(wsgi, "/plan", "POST", urlencode({"file": "/etc/passwd"}))
    assert "root:" not in html and "not one the dashboard offers" in html


def test_language_from_the_browser_and_bad_input_in_a_query(seeded):
    a, _ = seeded
    wsgi = make_app(a)
    status, _, html = call(wsgi, "/spend", accept_language="ru-RU,ru;q=0.9,en;q=0.8")
    assert status == 200 and '<html lang="ru">' in html and "Расходы: все проекты" in html
    assert "1\xa0071,85\xa0$" in html  # demo's November so far, written the Russian way
    assert '<html lang="en">' in call(wsgi, "/", accept_language="de-DE,en;q=0.5")[2]
    status, _, html = call(wsgi, "/spend?period=2026-13")
    assert status == 400 and "period: not a period: &#39;2026-13&#39;" in html
    status, _, html = call(wsgi, "/spend?by=colour")
    assert status == 400 and "by: use one of project, owner, cloud, gpu, machine" in html
    assert call(wsgi, "/machine/nope")[0] == 404
    assert call(wsgi, "/plan", "POST", "text=" + "x" * 300_000)[0] == 413


# --- hostile requests (issue 26, point 6) ---------------------------------------------------


@pytest.fixture
def bare(home, clock):
    """A state with one machine whose project is a spreadsheet formula."""
    a = App(make_settings(home), clock)
    up(a, "sheet", project='=HYPERLINK("http://evil.example","x")', owner="@ana")
    clock.advance(timedelta(hours=5))  # some spend to report
    yield a
    a.close()


def test_a_name_the_dashboard_was_not_given_is_refused_against_dns_rebinding(bare):
    wsgi = make_app(bare)  # loopback: open to this computer, and only through its own names
    status, _, body = call(wsgi, "/", host="rebind.evil.example:8765")
    assert status == 421 and "sheet" not in body and "dashboard.hosts" in body
    assert call(wsgi, "/spend.csv", host="rebind.evil.example")[0] == 421
    for host in ("127.0.0.1:8765", "localhost:8765", "[::1]:8765", "app.localhost", "10.0.0.5"):
        assert call(wsgi, "/", host=host)[0] == 200, host
    named = Dashboard(bare, token=None, open_access=True, hosts=["GPU.lab.example"])
    assert call(named, "/", host="gpu.lab.example:8765")[0] == 200
    assert call(named, "/", host="other.lab.example")[0] == 421
    # behind a TLS proxy that sends its own Host: a form from the configured name is ours
    form = urlencode({"text": "name: x\n"})
    proxied = {"host": "127.0.0.1:8765", "origin": "https://gpu.lab.example"}
    assert call(named, "/plan", "POST", form, **proxied)[0] == 200
    assert (
        call(named, "/plan", "POST", form, host="127.0.0.1:8765", origin="https://x.example")[0]
        == 403
    )


def test_a_post_from_another_site_is_refused(bare, monkeypatch):
    wsgi = make_app(bare)
    form = urlencode({"text": "name: x\n"})
    _, headers, page = call(wsgi, "/plan")
    [cookie] = [v for k, v in headers if k == "Set-Cookie" and v.startswith("provisioner_csrf=")]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    token = cookie.split(";")[0].partition("=")[2]
    assert f'name="csrf" value="{token}"' in page  # the form carries the cookie's double
    # a page elsewhere posting to it: no token, or another origin, or a stale pair
    assert call(wsgi, "/plan", "POST", form, csrf=False)[0] == 403
    assert call(wsgi, "/plan", "POST", form, origin="http://evil.example")[0] == 403
    assert call(wsgi, "/plan", "POST", form, origin="null", csrf=False)[0] == 403
    assert call(wsgi, "/plan", "POST", form, referer="http://evil.example/x")[0] == 403
    stale = call(wsgi, "/plan", "POST", form + "&csrf=" + "u" * 43, csrf=False, cookie=cookie)
    assert stale[0] == 403
    # its own form: the pair, from its own origin
    ok = call(
        wsgi,
        "/plan",
        "POST",
        form + f"&csrf={token}",
        csrf=False,
        cookie=cookie,
        origin="http://127.0.0.1",
    )
    assert ok[0] == 200 and 'id="plan-result"' in ok[2]
    # as a browser sends it under Referrer-Policy: no-referrer, "Origin: null": the pair decides
    pair = {"csrf": False, "cookie": cookie.split(";")[0], "origin": "null"}
    assert call(wsgi, "/plan", "POST", form + f"&csrf={token}", **pair)[0] == 200
    # a script with the token needs no form token; the login form does
    monkeypatch.setenv("PROVISIONER_DASHBOARD_TOKEN", "s3cret-dashboard-token")
    wide = make_app(bare, listen="10.1.2.3:8765")
    assert call(wide, "/login", "POST", "token=s3cret-dashboard-token", csrf=False)[0] == 403
    bearer = {"authorization": "Bearer s3cret-dashboard-token"}
    assert call(wide, "/plan", "POST", form, csrf=False, **bearer)[0] == 200


@pytest.mark.parametrize(
    "back",
    [
        "/%5Cevil.example",
        "//evil.example",
        "/%5C/evil.example",
        "https://evil.example/",
        "/%09/evil.example",
        "%2F%2Fevil.example",
        "javascript:alert(1)",
        "/%0d%0aSet-Cookie:x=1",
    ],
)
def test_the_language_switch_never_leaves_the_site(bare, monkeypatch, back):
    for wsgi in (make_app(bare), _token_app(bare, monkeypatch)):
        status, headers, _ = call(wsgi, f"/lang?to=ru&back={back}")
        assert status == 303 and dict(headers)["Location"] == "/", back
    status, headers, _ = call(make_app(bare), "/lang?to=ru&back=/spend%3Fby%3Downer")
    assert dict(headers)["Location"] == "/spend?by=owner"


def _token_app(a, monkeypatch):
    monkeypatch.setenv("PROVISIONER_DASHBOARD_TOKEN", "s3cret-dashboard-token")
    return make_app(a, listen="10.1.2.3:8765")


def test_csv_cells_cannot_become_formulas(bare):
    from provisioner.render import csv_cell

    for by, field in (("project", "project"), ("owner", "owner")):
        status, _, body = call(make_app(bare), f"/spend.csv?by={by}")
        assert status == 200
        [row] = list(csv.DictReader(io.StringIO(body)))[:1]
        assert row[field][0] == "'" and row[field][1] in "=@", row
    assert [csv_cell(c) for c in ("=1", "+1", "-1", "@a", "\tx", "\rx", "a=b", "")] == [
        "'=1",
        "'+1",
        "'-1",
        "'@a",
        "'\tx",
        "'\rx",
        "a=b",
        "",
    ]


def test_a_wrong_bearer_token_is_401_on_every_page(bare, monkeypatch):
    wsgi = _token_app(bare, monkeypatch)
    for path in ("/", "/spend", "/spend.csv", "/machine/sheet"):
        status, headers, body = call(wsgi, path, authorization="Bearer nope")
        assert status == 401 and "sheet" not in body, path
        assert dict(headers)["WWW-Authenticate"].startswith("Bearer")
    assert call(wsgi, "/", authorization="Bearer s3cret-dashboard-token")[0] == 200


def test_a_guesser_behind_the_teams_proxy_does_not_lock_out_a_browser_that_logged_in(
    bare, clock, monkeypatch
):
    wsgi = _token_app(bare, monkeypatch)
    proxy = "198.51.100.7"
    right, wrong = urlencode({"token": "s3cret-dashboard-token"}), "token=guess"
    status, headers, _ = call(wsgi, "/login", "POST", right, remote=proxy)
    assert status == 303
    [device] = [v.split(";")[0] for k, v in headers if v.startswith("provisioner_device=")]
    for _ in range(5):  # someone else behind the same proxy guesses
        assert call(wsgi, "/login", "POST", wrong, remote=proxy)[0] == 401
    assert call(wsgi, "/login", "POST", right, remote=proxy)[0] == 429  # a new browser waits
    # the browser that logged in before is counted on its own: the right token passes
    assert call(wsgi, "/login", "POST", right, remote=proxy, cookie=device)[0] == 303
    # and its own wrong guesses are limited like anyone's
    for _ in range(5):
        assert call(wsgi, "/login", "POST", wrong, remote=proxy, cookie=device)[0] == 401
    assert call(wsgi, "/login", "POST", right, remote=proxy, cookie=device)[0] == 429
    forged = device[:-4] + "beef"  # a device cookie not signed here is none: the account's
    assert call(wsgi, "/login", "POST", right, remote="192.0.2.1", cookie=forged)[0] == 429
    clock.advance(timedelta(minutes=15, seconds=1))
    assert call(wsgi, "/login", "POST", right, remote=proxy)[0] == 303


@pytest.mark.parametrize(
    "path",
    [
        "/static/\x00",
        "/static/dashboard.css\x00.png",
        "/static/../web.py",
        "/static/../../dashboard/web.py",
        "/static/..\\..\\settings.py",
        "/static/%2e%2e/web.py",
        "/static/",
        "/static/\udcff",
        "/static/" + "a" * 5000,
    ],
)
def test_static_paths_outside_its_folder_are_404_never_500(bare, path):
    assert call(make_app(bare), path)[0] == 404
    assert call(make_app(bare), "/static/dashboard.css")[0] == 200


# --- the browser -----------------------------------------------------------------------------


@pytest.fixture
def browser():
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip(f"no Debian chromium ({CHROMIUM}, {CHROMEDRIVER}): apt install chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.add_argument("--lang=en-US")
    drv = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    yield drv
    drv.quit()


@pytest.fixture
def served(seeded):
    from waitress.server import create_server

    a, pdir = seeded
    server = create_server(make_app(a), host="127.0.0.1", port=0, threads=2)
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.effective_port}", a, pdir
    stop_server(server, t)


def stop_server(server, thread: threading.Thread) -> None:
    """Close a waitress server and wait up to 5 s for its thread, with sleeps: a timed join
    can stall under libfaketime (the CI's edge-date run)."""
    import time

    server.close()
    for _ in range(50):
        if not thread.is_alive():
            break
        time.sleep(0.1)


def browser_sign_in(drv, base: str, app: App, user: str) -> None:
    """Sign in on the login page with a new personal token of ``user``: acting needs it, on a
    loopback dashboard too."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    from provisioner import tokens

    was, app.actor = app.actor, user
    try:
        issued = tokens.create(app, user)
    finally:
        app.actor = was
    drv.get(base + "/login")
    drv.find_element(By.ID, "token").send_keys(issued.token + Keys.ENTER)
    WebDriverWait(drv, 30).until(lambda d: d.find_elements(By.ID, "user"))


def go(drv, element) -> None:
    """Click ``element`` and wait until the page it leads to has replaced this one."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    old = drv.find_element(By.TAG_NAME, "html")
    element.click()

    def replaced(_: object) -> bool:
        try:
            old.tag_name  # noqa: B018  (chromedriver answers stale, or "node not in document")
        except WebDriverException:
            return True
        return False

    WebDriverWait(drv, 30).until(replaced)


@pytest.fixture
def screens(tmp_path_factory) -> Path:
    """Where the screenshots go: ``$PROVISIONER_SCREENSHOTS`` to keep them, else a temporary
    directory of pytest's."""
    chosen = os.environ.get("PROVISIONER_SCREENSHOTS")
    path = Path(chosen) if chosen else tmp_path_factory.mktemp("screens")
    path.mkdir(parents=True, exist_ok=True)
    return path


def shoot(drv, screens: Path, name: str) -> None:
    """Screenshots at 80 % and 150 % zoom and in a 400 px window, for people to look at."""
    for zoom in (80, 150):
        drv.set_window_size(1400, 1000)
        drv.execute_script(f"document.body.style.zoom='{zoom}%'")
        drv.save_screenshot(str(screens / f"{name}-{zoom}.png"))
    drv.execute_script("document.body.style.zoom='100%'")
    drv.set_window_size(400, 900)
    drv.save_screenshot(str(screens / f"{name}-narrow.png"))
    drv.set_window_size(1400, 1000)


@pytest.mark.slow  # every page in a real browser
def test_each_page_in_chromium_matches_the_report(served, browser, home, screens):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    base, a, pdir = served
    drv = browser
    # Fleet: every live machine, with GPU sparklines and the scheduler's next move
    drv.get(base + "/")
    rows = drv.find_elements(By.CSS_SELECTOR, "#fleet tbody tr")
    assert sorted(r.get_attribute("data-machine") for r in rows) == [
        "eval-ru",
        "seg-1",
        "seg-2",
        "train-a",
    ]
    train = drv.find_element(By.CSS_SELECTOR, 'tr[data-machine="train-a"]')
    assert train.find_elements(By.CSS_SELECTOR, "svg.sparkline polyline")
    # Thursday 11:00 in Berlin: in hours; the idle rule acts from 19:20 Berlin time, said in
    # one short line (the rule in full, and why it is up, on the machine's page)
    nxt = train.find_element(By.CSS_SELECTOR, "td.next").text
    assert nxt == "stop if idle, from 19:20 Europe/Berlin"
    assert "in working hours" not in train.text
    # cost so far, by hand: 577 h (Nov 2 09:00 → Nov 26 10:00) at 0.15 USD/h, plus the
    # 50 GB disk at 0.10 USD per GB-month: 86.55 + 3.95 USD
    assert train.find_element(By.CSS_SELECTOR, ".cost").text == "$90.50"
    shoot(drv, screens, "fleet")
    # filter by project, then follow a machine link
    Select(drv.find_element(By.ID, "filter-project")).select_by_value("vision")
    go(drv, drv.find_element(By.ID, "apply"))
    rows = drv.find_elements(By.CSS_SELECTOR, "#fleet tbody tr")
    assert sorted(r.get_attribute("data-machine") for r in rows) == ["seg-1", "seg-2"]
    assert "project=vision" in drv.current_url
    go(drv, drv.find_element(By.LINK_TEXT, "seg-2"))
    assert drv.find_element(By.ID, "machine-name").text.startswith("seg-2")
    events = drv.find_element(By.ID, "events").text
    assert "idle out of hours" in events and "GPUs below 5% for 30 min" in events
    usage = [r.text for r in drv.find_elements(By.CSS_SELECTOR, "#usage tbody tr")]
    assert len(usage) == 2  # compute until the stop; the disk still bills
    assert sum("still billing" in u for u in usage) == 1
    shoot(drv, screens, "machine")
    drv.get(base + "/machine/train-a")  # a running one: its heartbeats, newest first
    beats = drv.find_elements(By.CSS_SELECTOR, "#heartbeats tbody tr")
    # today: the time alone, in the demo-budget calendar's zone (Berlin), UTC on hover
    assert len(beats) == 24 and beats[0].text.startswith("10:55 Europe/Berlin")
    first = beats[0].find_element(By.TAG_NAME, "time")
    assert first.get_attribute("title") == "2026-11-26 09:55 UTC"
    assert drv.find_elements(By.CSS_SELECTOR, "svg.sparkline polyline")
    assert drv.find_element(By.ID, "machine-next").text == (
        "stop if GPUs stay below 5 % for 30 min (demo-budget) 19:20 Europe/Berlin"
    )
    assert drv.find_element(By.ID, "machine-why").text == "in working hours (demo-budget)"
    shoot(drv, screens, "machine-running")

    # Spend: the budget's numbers, to the cent, as `provisioner report` gives them
    cli = report_json(a, pdir, "--project", "demo")
    drv.get(base + "/spend?budget=demo-budget")
    assert drv.find_element(By.ID, "total").text == money_text(cli["total"])
    b = cli["budget"]
    assert drv.find_element(By.ID, "committed").text == money_text(b["committed"])
    assert drv.find_element(By.ID, "forecast").text == money_text(b["forecast"])
    assert drv.find_element(By.ID, "left").text == money_text(b["left"])
    assert drv.find_element(By.ID, "idle-waste").text == money_text(cli["idle_waste"])
    lines = {
        r.get_attribute("data-key"): r.find_element(By.CSS_SELECTOR, ".line-total").text
        for r in drv.find_elements(By.CSS_SELECTOR, "#lines tbody tr")
    }
    assert lines == {ln["key"]: money_text(ln["total"]) for ln in cli["lines"]}
    assert drv.find_elements(By.CSS_SELECTOR, "svg.burndown polyline.spent")
    assert len(drv.find_elements(By.CSS_SELECTOR, "svg.burndown line.threshold")) >= 2
    shoot(drv, screens, "spend")
    # another grouping, and the other budget's card: its standing as `report --policy` says
    Select(drv.find_element(By.ID, "f-by")).select_by_value("owner")
    go(drv, drv.find_element(By.ID, "apply"))
    keys = [
        r.get_attribute("data-key") for r in drv.find_elements(By.CSS_SELECTOR, "#lines tbody tr")
    ]
    assert sorted(keys) == ["ana@example.com", "bob@example.com"]
    for name in ("demo-budget", "vision-budget"):  # each card: the budget's own standing
        want = report_json(a, pdir, "--policy", name)["budget"]
        card = drv.find_element(By.CSS_SELECTOR, f'.budget-card[data-budget="{name}"]')
        for field in ("spent", "amount", "committed", "forecast"):
            got = card.find_element(By.CSS_SELECTOR, f'[data-field="{field}"]').text
            assert got == money_text(want[field])
    go(drv, card.find_element(By.CSS_SELECTOR, "a.to-spend"))
    assert "budget=vision-budget" in drv.current_url
    savings = drv.find_element(By.ID, "savings").text
    vcli = report_json(a, pdir, "--project", "vision")
    assert savings == "idle out of hours " + money_text(vcli["savings"]["off-hours-idle"])
    shoot(drv, screens, "spend-vision")

    # Plan: paste an experiment file, see the ranked offers and the verdicts
    drv.get(base + "/plan")
    text = "\n".join(
        [
            "name: try",
            "project: demo",
            "owner: ana@example.com",
            "resources:",
            "  gpu: T4:1",
            "  market: spot",
            "  clouds: [sandbox]",
        ]
    )
    from selenium.webdriver.support.ui import WebDriverWait

    def box() -> str:
        return drv.find_element(By.ID, "plan-text").get_attribute("value") or ""

    Select(drv.find_element(By.ID, "plan-file")).select_by_index(1)  # experiments/a100.yaml
    WebDriverWait(drv, 30).until(lambda _: "name: try-a100" in box())  # the picker fills it
    go(drv, drv.find_element(By.ID, "plan-go"))
    assert "try-a100: A100:1 reserved" in drv.find_element(By.CSS_SELECTOR, "#plan-result h2").text
    assert "name: try-a100" in box()  # what was planned stays in the box
    drv.find_element(By.ID, "plan-text").clear()
    drv.find_element(By.ID, "plan-text").send_keys(text)  # typed: the text is planned, not the file
    assert Select(drv.find_element(By.ID, "plan-file")).first_selected_option.text == "—"
    go(drv, drv.find_element(By.ID, "plan-go"))
    first = drv.find_element(By.CSS_SELECTOR, "#candidates tbody tr").text
    assert "sandbox" in first and "T4" in first
    checks = drv.find_element(By.ID, "plan-checks").text
    assert "policy: allowed by demo-budget" in checks and "budget demo-budget" in checks
    shoot(drv, screens, "plan")

    # Russian, as the browser asks
    drv.get(base + "/lang?to=ru&back=/spend")
    assert drv.find_element(By.TAG_NAME, "h1").text.startswith("Расходы")
    shoot(drv, screens, "spend-ru")
    for name, path in (
        ("fleet-ru", "/"),
        ("machine-ru", "/machine/seg-2"),
        ("spend-vision-ru", "/spend?budget=vision-budget"),
        ("plan-ru", "/plan"),
    ):
        drv.get(base + path)
        shoot(drv, screens, name)


# --- the command -----------------------------------------------------------------------------


def test_the_command_refuses_to_listen_wide_without_a_token(home):
    cfg = write_settings(home)
    r = run_cli(
        "--config",
        str(cfg),
        "dashboard",
        "--listen",
        "0.0.0.0:8765",
        env={"PROVISIONER_DASHBOARD_TOKEN": ""},
    )
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "error: --listen 0.0.0.0:8765: reachable beyond this computer, so a token is required; "
        "set PROVISIONER_DASHBOARD_TOKEN (or dashboard.token in settings), or create personal "
        "ones (`provisioner token create`)"
    )
    assert not (home / "state.db").exists()  # nothing written


@pytest.mark.slow  # the dashboard command as a real process
def test_the_command_serves_the_dashboard_on_loopback(home):
    cfg = write_settings(home)
    argv = ["--config", str(cfg), "dashboard", "--listen", "127.0.0.1:0"]  # port 0: any free
    proc = subprocess.Popen(
        [sys.executable, "-m", "provisioner", *argv],
        env={**os.environ, CLOCK_ENV: TEST_START.isoformat()},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # printed once it listens
        assert line.startswith("dashboard on http://127.0.0.1:"), line
        url = line.split()[2]
        with urllib.request.urlopen(url) as resp:
            page = resp.read().decode()
            headers = resp.headers
        assert "<h1>Fleet" in page and "No live machines match." in page
        assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
        with urllib.request.urlopen(url + "static/dashboard.css") as resp:
            assert resp.headers["Content-Type"] == "text/css"
    finally:
        proc.terminate()
        proc.wait(30)


# --- fits, stays put, accessible ------------------------------------------------------------

AXE = Path(__file__).resolve().parent / "vendor" / "axe-core" / "axe.min.js"  # npm axe-core


def window(drv, width: int, height: int, scale: float) -> None:
    """What a ``width`` × ``height`` window shows at browser zoom ``scale``: a viewport of
    width/scale CSS pixels drawn at ``scale`` device pixels each (as Ctrl-+ does, media
    queries included)."""
    drv.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {
            "width": round(width / scale),
            "height": round(height / scale),
            "deviceScaleFactor": scale,
            "mobile": False,
        },
    )


def axe_problems(drv) -> list[str]:
    """axe-core's critical and serious violations on the page shown: rule, impact, elements."""
    drv.set_script_timeout(120)
    drv.execute_script(AXE.read_text())
    found = drv.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "axe.run(document, {resultTypes: ['violations']}).then("
        " r => done(r.violations.map(v => [v.id, v.impact,"
        "  v.nodes.slice(0, 3).map(n => n.target.join(' ')).join(', ')])),"
        " e => done([['axe-failed', 'critical', String(e)]]));"
    )
    return [" ".join(v) for v in found if v[1] in ("critical", "serious")]


@pytest.mark.slow  # a real browser
def test_the_fleet_fits_1280_and_150_percent_stays_put_and_axe_finds_nothing_serious(
    served, browser, screens
):
    from selenium.webdriver.common.by import By

    base, _, _ = served
    drv = browser
    for width, height, scale, name in ((1280, 800, 1.0, "fit-1280"), (1280, 800, 1.5, "fit-150")):
        window(drv, width, height, scale)
        drv.get(base + "/")
        sizes = drv.execute_script(
            "const t = document.getElementById('fleet');"
            "return [t.scrollWidth, t.parentElement.clientWidth,"
            " document.documentElement.scrollWidth, document.documentElement.clientWidth,"
            " Math.max(...[...t.querySelectorAll('th, td')].map("
            "  c => c.getBoundingClientRect().right))];"
        )
        table, box, page, view, right = sizes
        # nothing to scroll sideways: the table in its box, the page in the window, every
        # cell's right edge inside the window
        assert table <= box and page <= view and right <= view, (name, sizes)
        drv.save_screenshot(str(screens / f"{name}.png"))
        drv.execute_script("document.getElementById('fleet').scrollIntoView()")
        drv.save_screenshot(str(screens / f"{name}-table.png"))
        train = drv.find_element(By.CSS_SELECTOR, 'tr[data-machine="train-a"]')
        for shown in ("train-a", "demo", "ana@example.com", "spot", "$90.50", "19:20"):
            assert shown in train.text, (name, shown, train.text)
    window(drv, 400, 900, 1.0)  # a phone: each machine a card, the page never wider than it
    drv.get(base + "/")
    wide = drv.execute_script(
        "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]"
    )
    assert wide[0] <= wide[1], wide
    drv.save_screenshot(str(screens / "fit-400.png"))
    drv.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})

    # no meta refresh: nothing reloads under a reader; a link reloads, keeping the filter
    drv.get(base + "/?project=demo")
    assert not drv.find_elements(By.CSS_SELECTOR, 'meta[http-equiv="refresh"]')
    assert drv.find_element(By.ID, "refresh").get_attribute("href").endswith("/?project=demo")
    # one time zone on the page: the team's (settings leave it unset; its policy calendar's)
    assert "as of 11:00 Europe/Berlin" in drv.find_element(By.ID, "updated").text
    # the same instant in UTC on hover
    nxt = drv.find_element(By.CSS_SELECTOR, 'tr[data-machine="train-a"] td.next time')
    assert nxt.text == "19:20 Europe/Berlin"
    assert nxt.get_attribute("title") == "2026-11-26 18:20 UTC"

    problems = {}
    for path in ("/", "/spend?budget=demo-budget", "/machine/train-a", "/machine/seg-2", "/plan"):
        drv.get(base + path)
        problems[path] = axe_problems(drv)
    drv.get(base + "/lang?to=ru&back=/")  # the Russian pages too
    for path in ("/", "/spend?budget=vision-budget"):
        drv.get(base + path)
        problems["ru " + path] = axe_problems(drv)
    drv.get(base + "/lang?to=en&back=/plan")
    assert problems == {path: [] for path in problems}
    # the Plan page with a result on it
    drv.find_element(By.ID, "plan-text").send_keys(
        "name: try\nproject: demo\nowner: ana@example.com\nresources:\n  gpu: T4:1\n"
        "  market: spot\n  clouds: [sandbox]\n"
    )
    go(drv, drv.find_element(By.ID, "plan-go"))
    assert drv.find_elements(By.CSS_SELECTOR, "#candidates tbody tr")
    assert axe_problems(drv) == [], "/plan with candidates"


@pytest.mark.slow  # a real browser
def test_the_fleet_updates_in_place_keeping_scroll_and_focus(served, browser, clock):
    """live.js: the page's live parts swapped for fresh ones, the reader left where they were;
    nothing swapped while they are in a form."""
    from selenium.webdriver.common.by import By

    base, _, _ = served
    drv = browser
    window(drv, 1280, 400, 1.0)  # a short window: the reader scrolls down to the table
    drv.get(base + "/")
    updated = drv.find_element(By.ID, "updated").text
    assert "11:00 Europe/Berlin" in updated
    drv.execute_script("window.scrollTo(0, 200)")
    y = drv.execute_script("return window.scrollY")
    assert y == 200
    table_top = "return document.getElementById('fleet').getBoundingClientRect().top"
    seen = drv.execute_script(table_top)
    clock.advance(timedelta(minutes=1))  # the server's clock: a fresh fleet
    # in a form (a filter focused): nothing is swapped under the reader
    drv.find_element(By.ID, "filter-owner").click()
    assert drv.execute_async_script("window.provisionerRefresh().then(arguments[0])") is False
    assert drv.find_element(By.ID, "updated").text == updated
    drv.execute_script("document.activeElement.blur(); window.scrollTo(0, arguments[0])", y)
    assert drv.execute_async_script("window.provisionerRefresh().then(arguments[0])") is True
    assert "11:01 Europe/Berlin" in drv.find_element(By.ID, "updated").text
    # still where the reader was: the table where it was on the screen, though what is above
    # it changed (seg-1 is no longer idle now, its agent's last beat over a minute old; the
    # browser's scroll anchoring moves the scroll by what left, not to the top)
    assert abs(drv.execute_script(table_top) - seen) <= 2  # sub-pixel rounding
    assert drv.execute_script("return window.scrollY") > 0
    assert len(drv.find_elements(By.CSS_SELECTOR, "#fleet tbody tr")) == 4
    # the spend page too: its figures and its time, the reader's place kept
    drv.get(base + "/spend?budget=demo-budget")
    assert "11:01 Europe/Berlin" in drv.find_element(By.ID, "spend-asof").text
    drv.execute_script("window.scrollTo(0, 300)")
    clock.advance(timedelta(minutes=10))  # past the spend page's five-minute cache
    assert drv.execute_async_script("window.provisionerRefresh().then(arguments[0])") is True
    assert "11:11 Europe/Berlin" in drv.find_element(By.ID, "spend-asof").text
    assert drv.execute_script("return window.scrollY") == 300
    assert drv.find_element(By.ID, "total").text.startswith("$")
    drv.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
