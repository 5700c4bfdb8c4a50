"""The dashboard's words (plain WSGI, no browser; the browser half, axe-core at three sizes in
both languages, is test_dashboard_a11y.py): headings that count what they say, held machines
shown held, the next action in one short line with the rest on the machine page, what burns
to the cent as `status --summary` says it, the safe choice focused, the Plan page's picked
file in its box, and one time zone — the team's — in the pages and in `status --summary`."""

from __future__ import annotations

import html as html_lib
import json
import re
from decimal import Decimal
from urllib.parse import quote

from provisioner.dashboard import make_app
from provisioner.jobs import recover
from tests.conftest import TEST_OWNER, run_cli, write_settings, write_yaml
from tests.test_dashboard import NOW, call, seeded  # noqa: F401
from tests.test_dashboard_act import as_user, machine, team  # noqa: F401
from tests.test_held import held_spot
from tests.test_scheduler import sched  # noqa: F401
from tests.test_summary import fresh_beats

RU = {"cookie": "provisioner_lang=ru"}


def row(page: str, name: str) -> str:
    found = re.search(rf'<tr data-machine="{name}">(.*?)</tr>', page, re.S)
    assert found is not None, name
    return found.group(1)


def text(fragment: str) -> str:
    return " ".join(html_lib.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def test_the_heading_counts_what_it_says_in_both_languages(seeded):  # noqa: F811
    a, _ = seeded
    wsgi = make_app(a)
    # three running and one stopped: the heading counts machines not deleted, never "running"
    en = call(wsgi, "/")[2]
    assert text(re.search(r'id="shown"[^>]*>(.*?)</span>', en).group(1)) == (  # type: ignore[union-attr]
        "showing 4 of 4 machines (deleted ones not listed)"
    )
    ru = call(wsgi, "/", **RU)[2]
    shown = text(re.search(r'id="shown"[^>]*>(.*?)</span>', ru).group(1))  # type: ignore[union-attr]
    assert shown == "показано 4 из 4 (удалённые не в списке)"
    counts = dict(re.findall(r'<li data-count="(\w+)"><strong>(\d+)</strong>', ru))
    assert counts["running"] == "3" and counts["stopped"] == "1"
    filtered = call(wsgi, "/?state=stopped", **RU)[2]
    assert "показано 1 из 4" in filtered and "работающих" not in filtered


def test_the_next_action_is_one_short_line_and_in_full_on_the_machine_page(seeded):  # noqa: F811
    a, _ = seeded
    wsgi = make_app(a)
    page = call(wsgi, "/")[2]
    nxt = re.search(r'<td class="next"[^>]*>(.*?)</td>', row(page, "train-a"), re.S)
    assert nxt is not None and text(nxt.group(1)) == "stop if idle, from 19:20 Europe/Berlin"
    assert "<br>" not in nxt.group(1) and "demo-budget" not in nxt.group(1)
    ru = call(wsgi, "/", **RU)[2]
    nxt = re.search(r'<td class="next"[^>]*>(.*?)</td>', row(ru, "train-a"), re.S)
    assert nxt is not None and text(nxt.group(1)) == "остановка при простое, с 19:20 Europe/Berlin"
    machine = call(wsgi, "/machine/train-a")[2]
    full = re.search(r'id="machine-next">(.*?)</dd>', machine, re.S)
    assert full is not None and text(full.group(1)) == (
        "stop if GPUs stay below 5 % for 30 min (demo-budget) 19:20 Europe/Berlin"
    )
    assert 'id="machine-why">in working hours (demo-budget)</dd>' in machine


def test_the_machine_page_says_idle_now(seeded):  # noqa: F811
    a, _ = seeded
    fresh_beats(a)  # seg-1's agent: 2 % for two hours
    wsgi = make_app(a)
    idle = call(wsgi, "/machine/seg-1")[2]
    assert '<span class="state state-idle" id="machine-idle">idle now</span>' in idle
    since = re.search(r'id="machine-idle-since">(.*?)</p>', idle)
    assert since is not None and since.group(1).startswith("idle since 09:00 Europe/Berlin: $")
    busy = call(wsgi, "/machine/train-a")[2]
    assert 'id="machine-idle"' not in busy
    assert "простаивает сейчас" in call(wsgi, "/machine/seg-1", **RU)[2]


def test_what_burns_is_to_the_cent_as_status_summary_says_it(seeded):  # noqa: F811
    a, pdir = seeded
    page = call(make_app(a), "/")[2]
    burning = text(re.search(r'<p id="burning">(.*?)</p>', page, re.S).group(1))  # type: ignore[union-attr]
    cfg = write_settings(a.settings.home, policies=[str(pdir)], state_url=a.settings.state_url)
    r = run_cli("--config", str(cfg), "status", "--summary", "--no-refresh", "-o", "json", now=NOW)
    sm = json.loads(r.stdout)
    for mo in sm["burning_per_hour"]:
        assert Decimal(mo["amount"]) == Decimal(mo["amount"]).quantize(Decimal("0.01"))
    usd = next(m for m in sm["burning_per_hour"] if m["currency"] == "USD")
    assert f"${Decimal(usd['amount']):,.2f}/h" in burning
    # no rate in the summary or a row's burn with more places than the cent
    assert not re.search(r"\d[.,]\d{3,}\s*(₽|/h)|\$\d+\.\d{3,}", page.split('id="fleet-foot"')[0])


def test_the_confirmation_focuses_the_safe_choice(team):  # noqa: F811
    app, dash, _ = team
    m = machine(app, "train")
    for do in ("stop", "down"):
        body = f"do={do}&back={quote('/?project=demo', safe='')}"
        status, _, page = as_user(dash, TEST_OWNER, f"/machine/{m.id}", "POST", body)
        assert status == 200
        form = re.search(r'<form [^>]*id="confirm-form".*?</form>', page, re.S)
        assert form is not None
        # only Cancel has the focus: Enter on the page does nothing; Terminate too
        assert re.findall(r"<(\w+)[^>]*\bautofocus\b", form.group(0)) == ["a"]
        assert f'href="/?project=demo#row-{m.id}" id="confirm-no" class="button" autofocus' in (
            form.group(0)
        )
    assert machine(app, "train").status == "running"


def test_a_held_machine_is_shown_held(sched):  # noqa: F811
    app = held_spot(sched)
    recover.run(app)  # its relaunch refused by the policy: held
    page = call(make_app(app), "/")[2]
    state = row(page, "spot")
    assert '<span class="state state-held">held</span>' in state and "preempted" not in text(state)
    machine = call(make_app(app), "/machine/spot")[2]
    assert re.search(
        r'<h1 id="machine-name">spot <span class="state state-held">held</span>', machine
    )


def test_the_plan_pages_file_picker_fills_the_box(seeded):  # noqa: F811
    a, _ = seeded
    wsgi = make_app(a)
    page = call(wsgi, "/plan")[2]
    files = re.findall(r'<option value="([^"]+a100\.yaml)"', page)
    assert len(files) == 1
    picked = call(wsgi, "/plan?file=" + quote(files[0], safe=""))[2]
    box = re.search(r'<textarea name="text" id="plan-text"[^>]*>(.*?)</textarea>', picked, re.S)
    assert box is not None and "name: try-a100" in html_lib.unescape(box.group(1))
    assert f'<option value="{files[0]}" selected>' in picked
    # without JavaScript: the file planned, and shown in the box
    done = call(wsgi, "/plan", "POST", "file=" + quote(files[0], safe=""))[2]
    assert "try-a100: A100:1 reserved" in done and "name: try-a100" in html_lib.unescape(done)
    # a path not offered: nothing read
    other = call(wsgi, "/plan?file=" + quote("/etc/passwd", safe=""))[2]
    assert "root:" not in other


def test_status_summary_says_times_in_the_teams_zone(seeded):  # noqa: F811
    a, pdir = seeded
    fresh_beats(a)
    cfg = write_settings(a.settings.home, policies=[str(pdir)], state_url=a.settings.state_url)
    import yaml

    data = yaml.safe_load(cfg.read_text())
    del data["timezone"]  # as a team's own settings file leaves it
    write_yaml(cfg, data)
    r = run_cli("--config", str(cfg), "status", "--summary", "--no-refresh", now=NOW)
    assert r.returncode == 0, r.stderr
    # the team's zone: settings leave it unset, its one policy calendar is Berlin's
    assert "idle now: seg-1 since 09:00 Europe/Berlin" in r.stdout
    assert " UTC" not in r.stdout
    cfg = write_settings(
        a.settings.home, policies=[str(pdir)], state_url=a.settings.state_url, timezone="UTC"
    )
    r = run_cli("--config", str(cfg), "status", "--summary", "--no-refresh", now=NOW)
    assert "idle now: seg-1 since 08:00 UTC" in r.stdout  # set: the settings' zone wins
    page = call(make_app(a), "/")[2]
    assert re.search(r'title="2026-11-26 10:00 UTC">11:00 Europe/Berlin</time>', page)
