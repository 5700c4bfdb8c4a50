"""Any character in a policy's name is safe on every page: ``|`` (the delivery key's
separator), ``:`` (the notice key's), NUL, markup, quotes and unicode answer 200 with the name
escaped — also after the policy is renamed and the old name stays in the stored rows. NUL, which
no state can keep, is refused where a policy is read and is a 400 in a query."""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import quote

import pytest
from markupsafe import escape

from policies.loader import load
from policies.problems import DocumentError
from provisioner import notify
from provisioner.app import App
from provisioner.dashboard import make_app
from provisioner.jobs import enforce
from provisioner.views import alerts as alerts_view
from tests.conftest import make_settings, write_yaml
from tests.test_dashboard import call
from tests.test_notify import launch

NAMES = [
    "a|b",
    "team:nlp|2026:actual:80",
    '<script>alert("x")</script>',
    "quote \" ' & амп",
    "ночь 🌙 €",
]


def _app(home, clock, db_url, pdir, name: str) -> App:
    write_yaml(
        pdir / "p.yaml",
        {
            "name": name,
            "applies_to": {"projects": ["demo"]},
            "budget": {"amount": "2000 USD", "alerts": {"actual": [0.1], "forecast": [100]}},
            "notify": [{"webhook": {"url": "http://127.0.0.1:9/hook"}}],
        },
    )
    return App(make_settings(home, state_url=db_url, policies=[str(pdir)]), clock)


PAGES = ["/", "/spend", "/spend?by=owner", "/alerts", "/fleet.csv", "/machine/big", "/plan"]


def _pages(name: str) -> list[str]:
    """Every page, and those that filter by the budget named so: 200, or a 400 saying there
    is no such budget (after a rename, the old name)."""
    q = quote(name, safe="")
    return [
        *PAGES,
        f"/spend?budget={q}",
        f"/spend?by=owner&budget={q}",
        f"/alerts?budget={q}",
        f"/alerts?budget={q}&status=failed",
        f"/spend.csv?budget={q}",
    ]


@pytest.mark.parametrize("name", NAMES)
def test_every_page_answers_whatever_the_name_holds(home, clock, db_url, tmp_path, name):
    pdir = tmp_path / "policies"
    pdir.mkdir()
    app = _app(home, clock, db_url, pdir, name)
    launch(app)
    clock.advance(timedelta(hours=1))
    assert enforce.run(app, clock.now())
    notify.deliver(app, clock.now())  # refused: the webhook is not allowed; recorded
    # each row read from its key as the threshold it was, whatever the name holds
    rows = alerts_view.alerts(app, {"budget": name}).rows
    assert rows and {(r.what, r.mark, r.policy) for r in rows} <= {
        ("actual", "0.1", name),
        ("forecast", "100", name),
    }, rows
    wsgi = make_app(app, listen="127.0.0.1:8765")
    for path in _pages(name):
        status, _, body = call(wsgi, path)
        assert status == 200 if path in PAGES else status in (200, 400), (path, status, body)
        assert "<script>alert" not in body, path
    status, _, body = call(wsgi, "/alerts")
    assert status == 200 and escape(name) in body  # the name as text, in each row
    for path in ("/alerts?budget=a%00b", "/spend?budget=%00", "/?owner=x%00"):
        assert call(wsgi, path)[0] == 400, path
    app.close()
    # renamed: the stored rows keep the old name
    app = _app(home, clock, db_url, pdir, name + " (renamed)")
    wsgi = make_app(app, listen="127.0.0.1:8765")
    for path in _pages(name) + _pages(name + " (renamed)"):
        status, _, body = call(wsgi, path)
        assert status == 200 if path in PAGES else status in (200, 400), (path, status, body)
        assert "<script>alert" not in body, path
    app.close()


def test_a_name_with_nul_is_refused_where_the_policy_is_read(tmp_path):
    write_yaml(tmp_path / "p.yaml", {"name": "a\x00b", "budget": {"amount": "1 USD"}})
    with pytest.raises(DocumentError, match="NUL"):
        load([tmp_path])
