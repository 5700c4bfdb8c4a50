"""The dashboard's main pages in Debian's chromium at the three sizes a team reads them — a
1280 px window, the same at 150 % zoom (853 CSS px), a 400 px phone — in English and Russian:
axe-core finds nothing critical or serious, every box that scrolls sideways is reachable by
keyboard, the fleet's columns that matter are on screen, and the headings count what they say.
One browser for both languages (the language is a cookie)."""

from __future__ import annotations

import pytest

from tests.test_dashboard import (  # noqa: F401  (fixtures)
    axe_problems,
    browser,
    screens,
    seeded,
    served,
    window,
)

SIZES = ((1280, 800, 1.0, "1280"), (1280, 800, 1.5, "150"), (400, 900, 1.0, "400"))
PAGES = (
    "/",
    "/machine/train-a",
    "/machine/seg-2",
    "/spend?budget=demo-budget",
    "/spend?budget=vision-budget",
    "/alerts",
    "/plan",
)
#: every box on the page wider inside than out, with whether the keyboard reaches it
SCROLLERS = (
    "return [...document.querySelectorAll('body *')].filter(e => {"
    " const s = getComputedStyle(e);"
    " return ['auto', 'scroll'].includes(s.overflowX) && e.scrollWidth > e.clientWidth + 1;"
    "}).map(e => [e.id || e.className || e.tagName, e.tabIndex >= 0,"
    " e.getAttribute('role') || e.tagName, e.getAttribute('aria-label') || ''])"
)


@pytest.mark.slow  # a real browser: 7 pages × 3 sizes × 2 languages
def test_every_page_at_every_size_in_both_languages_is_accessible(served, browser, screens):  # noqa: F811
    from selenium.webdriver.common.by import By

    base, _, _ = served
    drv = browser
    problems: dict[str, list[str]] = {}
    for lang in ("en", "ru"):
        drv.get(f"{base}/lang?to={lang}&back=/")
        for width, height, scale, size in SIZES:
            window(drv, width, height, scale)
            for path in PAGES:
                drv.get(base + path)
                found = axe_problems(drv)
                for name, focusable, role, label in drv.execute_script(SCROLLERS):
                    if not (focusable and label):
                        found.append(f"scroll box {name} ({role}) not reachable by keyboard")
                if found:
                    problems[f"{lang} {size} {path}"] = found
            # the fleet: the columns that matter on screen, nothing cut at the window's edge
            drv.get(base + "/")
            drv.save_screenshot(str(screens / f"fleet-{lang}-{size}.png"))  # for people to see
            drv.execute_script("document.getElementById('fleet').scrollIntoView()")
            drv.save_screenshot(str(screens / f"fleet-{lang}-{size}-table.png"))
            cut = drv.execute_script(
                "const view = document.documentElement.clientWidth;"
                "return [...document.querySelectorAll('#fleet td.next, #fleet td .cost,"
                " #fleet td a.machine-link, #fleet .state')].filter("
                " c => c.getBoundingClientRect().right > view + 0.5).map(c => c.textContent)"
            )
            assert cut == [], (lang, size, cut)
            wide = drv.execute_script(
                "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
            )
            assert wide <= 0, (lang, size, "the page scrolls sideways", wide)
            heading = drv.find_element(By.ID, "shown").text
            word = {"en": "showing 4 of 4 machines", "ru": "показано 4 из 4"}[lang]
            assert heading.startswith(word), heading
            assert "работающих" not in heading  # 1 of the 4 is stopped: not "of 4 running"
    drv.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    assert problems == {}
