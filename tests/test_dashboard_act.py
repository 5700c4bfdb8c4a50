"""Acting on a machine from the dashboard (issue 27, point 4): stop, start, keep until, autostop
and down from the machine page, as the signed-in user (a trusted proxy names them here), each an
event with that user as its actor; stop and down asked twice; a non-owner, a form without its
CSRF token, a policy's or budget's refusal each refused, the refusal in the CLI's own words."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from markupsafe import escape
from sqlalchemy import select

from provisioner import acting, machines
from provisioner.app import App
from provisioner.dashboard.web import Dashboard
from provisioner.identity import SCHEDULER
from provisioner.models import Event, Machine
from provisioner.spec import Experiment
from tests.conftest import TEST_OWNER, make_settings, run_cli, sandbox_experiment, write_settings
from tests.conftest import write_yaml as write_policy
from tests.test_dashboard import (  # noqa: F401  (browser: a fixture)
    browser,
    browser_sign_in,
    call,
    sign_in,
    stop_server,
)

PROXY = "10.0.0.5"  # the team's authenticating proxy: its X-Forwarded-User names the user
LEAD = "lead@example.com"  # a policy grants them act_as over ana's machines
BOB = "bob@example.com"  # a colleague: may look, not act on ana's machines
POLICIES = [
    {
        "name": "demo",
        "applies_to": {"projects": ["demo"]},
        "act_as": {LEAD: [TEST_OWNER]},
    },
    {"name": "tight", "applies_to": {"projects": ["tight"]}, "budget": {"amount": "1 USD"}},
]


@pytest.fixture
def team(home, clock, db_url):
    """``train`` (ana's, running) and ``tight-1`` (ana's, in a project whose 1-USD budget its
    own 100 hours spent, stopped), seeded before the policies arrive; then the dashboard's app
    with them."""
    a = App(make_settings(home, state_url=db_url), clock)
    a.actor = TEST_OWNER
    for name, project in (("train", "demo"), ("tight-1", "tight")):
        e = sandbox_experiment(name, market="reserved") | {"project": project}
        machines.up(a, Experiment.model_validate(e))
    clock.advance(timedelta(hours=100))
    machines.stop(a, "tight-1")
    a.close()
    pdir = home.parent / "policies"
    pdir.mkdir(parents=True, exist_ok=True)
    for p in POLICIES:
        write_policy(pdir / f"{p['name']}.yaml", p)
    settings = make_settings(
        home,
        state_url=db_url,
        policies=[str(pdir)],
        identity={"trusted_proxies": [PROXY]},
    )
    app = App(settings, clock)
    yield app, Dashboard(app, token=None, open_access=False), pdir
    app.close()


def as_user(dash, user: str, path: str, method: str = "GET", body: str = "", **kw):
    return call(dash, path, method, body, remote=PROXY, X_FORWARDED_USER=user, **kw)


def machine(app: App, name: str) -> Machine:
    with app.db.session() as s:
        return s.scalars(select(Machine).where(Machine.name == name)).one()


def said(headers) -> str | None:
    """The flash cookie a response sets (name=value), if any."""
    for k, v in headers:
        if k == "Set-Cookie" and v.startswith("provisioner_done="):
            return v.split(";")[0]
    return None


def events(app: App, name: str) -> list[tuple[str, str | None]]:
    """(kind, actor) of the machine's events, oldest first."""
    m = machine(app, name)
    with app.db.session() as s:
        rows = s.scalars(select(Event).where(Event.machine_id == m.id).order_by(Event.id))
        return [(e.kind, e.actor) for e in rows]


def test_the_owner_stops_after_confirming_and_the_event_names_them(team):
    app, dash, _ = team
    m = machine(app, "train")
    page = f"/machine/{m.id}"
    status, _, body = as_user(dash, TEST_OWNER, page)
    assert status == 200 and 'id="act-stop"' in body and 'id="act-down"' in body
    # the first POST asks: nothing is done yet
    status, _, body = as_user(dash, TEST_OWNER, page, "POST", "do=stop")
    assert status == 200 and 'id="confirm-question"' in body
    assert "Stop train? Compute billing ends" in body and 'name="confirm" value="yes"' in body
    assert machine(app, "train").status == "running"
    # confirmed: done, then back to the page with what was done
    status, headers, _ = as_user(dash, TEST_OWNER, page, "POST", "do=stop&confirm=yes")
    assert status == 303 and dict(headers)["Location"] == page
    assert machine(app, "train").status == "stopped"
    assert events(app, "train")[-1] == ("stopped", TEST_OWNER)
    flash = said(headers)
    assert flash == f"provisioner_done={m.id}.stop"
    status, headers, body = as_user(dash, TEST_OWNER, page, cookie=flash)
    assert 'id="flash" role="status">train stopped<' in body
    assert said(headers) == "provisioner_done="  # said once
    # a link from elsewhere cannot make the page claim what was not done
    assert 'id="flash"' not in as_user(dash, TEST_OWNER, f"{page}?done=down")[2]
    assert '<td class="actor">ana@example.com</td>' in body  # the events table says who
    # the page offers what fits a stopped machine: start, not stop
    assert 'id="act-start"' in body and 'id="act-stop"' not in body


def test_each_action_as_a_user_a_policy_lets_act_as_the_owner(team, clock):
    app, dash, _ = team
    mid = machine(app, "train").id
    page = f"/machine/{mid}"
    steps = [
        ("do=keep&until=23:00", "keep", "kept"),
        ("do=unkeep", "unkeep", "keep-cancelled"),
        ("do=autostop&duration=45m", "autostop", "autostop-set"),
        ("do=unautostop", "unautostop", "autostop-cancelled"),
        ("do=stop&confirm=yes", "stop", "stopped"),
        ("do=start", "start", "started"),
        ("do=down&confirm=yes", "down", "terminated"),
    ]
    for form, done, kind in steps:
        status, headers, _ = as_user(dash, LEAD, page, "POST", form)
        assert status == 303, form
        assert dict(headers)["Location"] == page
        assert said(headers) == f"provisioner_done={mid}.{done}"
        assert events(app, "train")[-1] == (kind, LEAD), form
        if done == "keep":
            kept = machine(app, "train").kept_until
            assert kept is not None and kept > clock.now()
        if done == "autostop":
            assert machine(app, "train").autostop_seconds == 45 * 60
    assert machine(app, "train").status == "terminated"
    # the process serving the page still acts as itself: the user was this request's only
    assert app.actor == TEST_OWNER
    # a second cancel changes nothing, and says so
    status, _, body = as_user(dash, LEAD, page, cookie=f"provisioner_done={mid}.down-same")
    assert "train was already gone" in body and 'id="act"' not in body  # gone: no forms


def test_a_colleague_who_is_not_the_owner_is_refused(team):
    app, dash, _ = team
    page = f"/machine/{machine(app, 'train').id}"
    before = events(app, "train")
    status, _, body = as_user(dash, BOB, page)
    assert status == 200 and 'id="act-none"' in body and 'id="act-stop"' not in body
    for form in ("do=stop&confirm=yes", "do=down&confirm=yes", "do=keep&until=23:00"):
        status, _, body = as_user(dash, BOB, page, "POST", form)
        assert status == 403, form
        assert (
            "refused: bob@example.com is not the owner of this machine (ana@example.com) and no "
            "policy grants act_as over them" in body
        )
    assert machine(app, "train").status == "running" and events(app, "train") == before


def test_a_form_without_its_csrf_token_is_refused(team):
    app, dash, _ = team
    page = f"/machine/{machine(app, 'train').id}"
    status, _, body = as_user(dash, TEST_OWNER, page, "POST", "do=down&confirm=yes", csrf=False)
    assert status == 403 and "security token is missing" in body
    assert machine(app, "train").status == "running"


def test_a_budget_refusal_says_the_clis_words(team, home, clock, db_url):
    app, dash, pdir = team
    page = f"/machine/{machine(app, 'tight-1').id}"
    status, _, body = as_user(dash, TEST_OWNER, page, "POST", "do=start")
    assert status == 409 and machine(app, "tight-1").status == "stopped"
    cfg = write_settings(home, state_url=db_url, policies=[str(pdir)])
    r = run_cli("--config", str(cfg), "start", "tight-1", now=clock.now())
    assert r.returncode == 2, r.stdout + r.stderr
    said = r.stderr.strip().removeprefix("error: tight-1: ")
    assert "budget" in said and str(escape(said)) in body
    assert 'id="refused" role="alert"' in body
    assert [k for k, _ in events(app, "tight-1")][-1] == "stopped"  # nothing recorded


def test_bad_input_is_refused_with_the_clis_words(team):
    app, dash, _ = team
    page = f"/machine/{machine(app, 'train').id}"
    status, _, body = as_user(dash, TEST_OWNER, page, "POST", "do=keep&until=25:99")
    assert status == 409
    assert str(escape("--until '25:99': write HH:MM or an ISO date-time")) in body
    status, _, body = as_user(dash, TEST_OWNER, page, "POST", "do=autostop&duration=forever")
    assert status == 409 and str(escape("autostop 'forever'")) in body
    status, _, body = as_user(dash, TEST_OWNER, page, "POST", "do=reboot")
    assert status == 400 and "no such action: reboot" in body
    assert machine(app, "train").kept_until is None


def test_down_needs_its_confirmation(team):
    app, dash, _ = team
    page = f"/machine/{machine(app, 'train').id}"
    status, _, body = as_user(dash, TEST_OWNER, page, "POST", "do=down")
    assert status == 200 and "Terminate train and everything it bills for?" in body
    assert 'id="confirm-no"' in body  # a way back that does nothing
    assert machine(app, "train").status == "running"
    status, _, _ = as_user(dash, TEST_OWNER, page, "POST", "do=down&confirm=no")
    assert status == 200 and machine(app, "train").status == "running"


def test_on_loopback_acting_needs_signing_in_and_the_served_user_never_acts(team):
    """Anyone on the computer may look at a loopback dashboard, not act as who serves it: an
    anonymous form is refused and the page links to the login; signed in, the owner acts."""
    from provisioner import tokens

    app, _, _ = team
    app.actor = TEST_OWNER  # the dashboard is served by ana herself
    local = Dashboard(app, token=None, open_access=True)
    page = f"/machine/{machine(app, 'train').id}"
    status, _, body = call(local, page)
    assert status == 200 and 'id="act-stop"' not in body
    assert "Sign in with your personal token to act on this machine." in body
    before = events(app, "train")
    status, _, body = call(local, page, "POST", "do=autostop&duration=1h")
    assert status == 403 and "refused: sign in (a personal token) to act on a machine" in body
    assert events(app, "train") == before and machine(app, "train").autostop_seconds is None
    session = sign_in(local, tokens.create(app, TEST_OWNER).token)
    app.actor = SCHEDULER  # whoever serves it: the event names the signed-in user
    status, _, _ = call(local, page, "POST", "do=autostop&duration=1h", cookie=session)
    assert status == 303 and events(app, "train")[-1] == ("autostop-set", TEST_OWNER)


def test_russian_words_on_the_page_and_its_confirmation(team):
    app, dash, _ = team
    page = f"/machine/{machine(app, 'train').id}"
    status, _, body = as_user(dash, TEST_OWNER, page, cookie="provisioner_lang=ru")
    assert status == 200 and "Действия с машиной" in body and "Остановить" in body
    status, _, body = as_user(
        dash, TEST_OWNER, page, "POST", "do=stop", cookie="provisioner_lang=ru"
    )
    assert "Остановить train? Оплата вычислений прекратится" in body


def test_a_threads_actor_is_its_own():
    """Two requests at once: each thread's events name its own user."""
    seen: dict[str, str | None] = {}
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait()  # the main thread acts as someone now
        seen["other"] = acting.current()
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with acting.acting_as(LEAD):
        inside.set()
        done.wait()
        seen["main"] = acting.current()
    t.join()
    assert seen == {"other": None, "main": LEAD} and acting.current() is None


@pytest.mark.slow  # a real browser against a real server
def test_stop_and_keep_keyboard_only_in_chromium(team, browser):  # noqa: F811
    """Tab to a form, Enter; the confirmation's button has the focus, Enter again."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
    from waitress.server import create_server

    app, _, _ = team
    local = Dashboard(app, token=None, open_access=True)
    server = create_server(local, host="127.0.0.1", port=0, threads=2)
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    drv = browser
    try:
        site = f"http://127.0.0.1:{server.effective_port}"
        browser_sign_in(drv, site, app, TEST_OWNER)  # on loopback too, acting needs it
        drv.get(f"{site}/machine/{machine(app, 'train').id}")

        def tab_to(form_id: str) -> None:
            for _ in range(80):
                ActionChains(drv).send_keys(Keys.TAB).perform()
                here = drv.execute_script(
                    "const e = document.activeElement; return e.form ? e.form.id : e.id"
                )
                if here == form_id:
                    return
            raise AssertionError(f"Tab never reached #{form_id}")

        def enter_and_wait() -> None:
            old = drv.find_element(By.TAG_NAME, "html")
            ActionChains(drv).send_keys(Keys.ENTER).perform()
            WebDriverWait(drv, 30).until(lambda _: _stale(old))

        tab_to("act-keep")  # the field of the keep form: type, Enter submits it
        assert drv.switch_to.active_element.get_attribute("id") == "keep-until"
        ActionChains(drv).send_keys("23:00").perform()
        enter_and_wait()
        assert "train is kept" in drv.find_element(By.ID, "flash").text
        tab_to("act-stop")
        enter_and_wait()
        # the safe choice focused; Tab to the one that stops it
        assert drv.switch_to.active_element.get_attribute("id") == "confirm-no"
        ActionChains(drv).send_keys(Keys.TAB).perform()
        assert drv.switch_to.active_element.get_attribute("id") == "confirm-yes"
        enter_and_wait()
        assert drv.find_element(By.ID, "flash").text == "train stopped"
    finally:
        stop_server(server, t)
    assert machine(app, "train").status == "stopped"
    assert [e for e in events(app, "train") if e[0] in ("kept", "stopped")] == [
        ("kept", TEST_OWNER),
        ("stopped", TEST_OWNER),
    ]


def _stale(element) -> bool:
    from selenium.common.exceptions import WebDriverException

    try:
        element.tag_name  # noqa: B018  (chromedriver answers stale once the page is replaced)
    except WebDriverException:
        return True
    return False


def test_a_script_acts_with_a_personal_token(team):
    from provisioner import tokens

    app, dash, _ = team
    issued = tokens.create(app, TEST_OWNER)
    page = f"/machine/{machine(app, 'train').id}"
    bearer = {"Authorization": f"Bearer {issued.token}"}
    status, _, _ = call(dash, page, "POST", "do=stop&confirm=yes", csrf=False, **bearer)
    assert status == 303 and events(app, "train")[-1] == ("stopped", TEST_OWNER)
    # the shared token names no one a policy lets act as ana
    shared = Dashboard(app, token="s3cret-shared", open_access=False)
    status, _, body = call(
        shared, page, "POST", "do=start", csrf=False, Authorization="Bearer s3cret-shared"
    )
    assert status == 403 and "refused: sign in (a personal token) to act on a machine" in body
    assert machine(app, "train").status == "stopped"
