"""report.html in a real browser (headless Chromium through its driver, Debian's packages
that .ci/run installs): each kind of page opens from disk with no console error and no
request, its charts draw, hovering the peak or pressing ``p`` shows the peak's bytes, the
check page shows both runs, and text from files stays text. Screenshots, light and dark,
are saved under the test's temporary folder."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from memprof.cli.app import app
from memprof.report.html.assemble import page_html
from memprof.report.units import format_bytes
from tests.conftest import fixture
from tests.test_html_report import HOSTILE, page_data
from tests.test_run_cli import SAMPLES, flags, memprof_run

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed"
                                " (pip install -e '.[dev]')")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.actions.action_builder import ActionBuilder  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    BROWSER is None or DRIVER is None,
    reason="no chromium or chromedriver on PATH (.ci/run installs Debian's chromium and"
    " chromium-driver)")

SMALL = {"hidden": 256, "layers": 2, "batch": 8, "steps": 3}
WIDER = {**SMALL, "hidden": 384}
WIDTH = 1280

CANVAS_INK = """
return [...document.querySelectorAll(arguments[0] + ' canvas')].map((c) => {
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
  return n / (c.width * c.height);
});"""


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A run's page, its check against a smaller run, its advice, a snapshot's page and a
    page with hostile text."""
    tmp = tmp_path_factory.mktemp("pages")
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = {name: pool.submit(memprof_run, tmp, "-o", tmp / name, "--no-timeline",
                                  SAMPLES / "mlp_adam.py", *flags(size))
                for name, size in (("base", SMALL), ("wider", WIDER))}
        for future in done.values():
            assert future.result().code == 0, future.result().stderr[-3000:]
    out = {"run": tmp / "wider" / "report.html", "check": tmp / "check.html",
           "suggest": tmp / "suggest.html", "snapshot": tmp / "snapshot.html",
           "hostile": tmp / "hostile.html"}
    runner = CliRunner()
    result = runner.invoke(app, ["check", str(tmp / "wider"), "-b", str(tmp / "base"),
                                 "--format", "html", "-o", str(out["check"]),
                                 "--max-increase", "1%"])
    assert result.exit_code == 1, result.output  # the wider run grew
    peak = json.loads((tmp / "wider" / "report.json").read_text())["devices"][0]["peak"]
    result = runner.invoke(app, ["suggest", str(tmp / "wider"), "--budget",
                                 str(peak["reserved_bytes"] * 2 // 3), "--html",
                                 str(out["suggest"])])
    assert result.exit_code in (0, 1), result.output
    result = runner.invoke(app, ["explain", str(fixture("kkaitlyn111")), "--html",
                                 str(out["snapshot"])])
    assert result.exit_code == 0, result.output
    data = page_data(out["snapshot"])
    data["title"] = HOSTILE
    data["devices"][0]["report"]["top_sites"][0]["file"] = HOSTILE
    out["hostile"].write_text(page_html(data))
    return out


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = Options()
    options.binary_location = BROWSER
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={WIDTH},1000", "--hide-scrollbars"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def open_page(driver: Any, page: Path, dark: bool = False) -> None:
    """Open ``page`` from disk and wait until it has drawn."""
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": [
        {"name": "prefers-color-scheme", "value": "dark" if dark else "light"}]})
    driver.set_window_size(WIDTH, 1000)
    driver.get(page.resolve().as_uri())
    WebDriverWait(driver, 20).until(
        lambda d: d.execute_script("return document.body.dataset.ready === 'true'"))


def problems(driver: Any) -> list[str]:
    """Console errors and warnings since the last call, and every request the page made."""
    logged = [e["message"] for e in driver.get_log("browser") if e["level"] != "INFO"]
    requests = driver.execute_script(
        "return performance.getEntriesByType('resource').map((e) => e.name)")
    return logged + [f"request: {r}" for r in requests]


def screenshot(driver: Any, path: Path) -> None:
    """The whole page, as tall as it is."""
    height = driver.execute_script("window.scrollTo(0, 0);"
                                   " return document.documentElement.scrollHeight")
    driver.set_window_size(WIDTH, min(int(height) + 40, 9000))
    driver.save_screenshot(str(path))


def hover(driver: Any, x: float, y: float) -> None:
    actions = ActionBuilder(driver)
    actions.pointer_action.move_to_location(int(x), int(y))
    actions.perform()


def peak_tooltip(driver: Any, peak_bytes: int) -> str:
    """Hover the timeline where its peak is drawn; the tooltip's text."""
    where = driver.execute_script("""
      return MP.shown.then((c) => {
        c.box.scrollIntoView({block: 'center'});
        const r = c.plot.over.getBoundingClientRect();
        return {x: r.left + c.plot.valToPos(c.dev.timeline.peak_x, 'x'), y: r.top + r.height / 2};
      });""")
    hover(driver, where["x"], where["y"])
    return driver.execute_script("return MP.shown.then((c) => c.tip.textContent)")


def exact(n: int) -> str:
    return f"{n:,} B"


def test_a_runs_page_draws_and_hovering_the_peak_shows_its_bytes(browser, pages, tmp_path):
    report = json.loads((pages["run"].parent / "report.json").read_text())
    peak = report["devices"][0]["peak"]["allocated_bytes"]
    open_page(browser, pages["run"])
    assert problems(browser) == []
    ink = browser.execute_script(CANVAS_INK, "#timeline")
    assert ink and max(ink) > 0.05, ink  # the series drew
    assert browser.execute_script(CANVAS_INK, "#allocator")[0] > 0.5  # the segments' map
    text = peak_tooltip(browser, peak)
    assert exact(peak) in text and "the peak" in text, text
    icicle = browser.execute_script(
        "return [...document.querySelectorAll('.icicle button')].map((b) => +b.dataset.bytes)")
    assert icicle[0] == peak and len(icicle) > 3
    screenshot(browser, tmp_path / "run.png")
    assert problems(browser) == []


def test_the_keyboard_reaches_the_peak(browser, pages):
    report = json.loads((pages["run"].parent / "report.json").read_text())
    peak = report["devices"][0]["peak"]["allocated_bytes"]
    open_page(browser, pages["run"])
    browser.execute_script("return MP.shown.then((c) => c.box.focus())")
    browser.switch_to.active_element.send_keys("p")
    WebDriverWait(browser, 5).until(lambda d: exact(peak) in d.execute_script(
        "return MP.shown.then((c) => c.tip.textContent)"))
    focusable = browser.execute_script(
        "return [...document.querySelectorAll('button, [tabindex]')].every((e) => e.tabIndex >= 0)")
    assert focusable
    assert problems(browser) == []


def test_the_check_page_shows_both_runs(browser, pages, tmp_path):
    open_page(browser, pages["check"])
    assert problems(browser) == []
    data = page_data(pages["check"])
    body = browser.find_element("tag name", "body").text
    assert "REGRESSION" in body
    for run in data["runs"]:
        assert run["path"] in body
    ink = browser.execute_script(CANVAS_INK, ".chart")
    assert ink and max(ink) > 0.02, ink
    where = browser.execute_script("""
      const over = document.querySelector('.chart .u-over');
      over.scrollIntoView({block: 'center'});
      const r = over.getBoundingClientRect();
      return {x: r.left + r.width * 0.6, y: r.top + r.height / 2};""")
    hover(browser, where["x"], where["y"])
    tip = browser.execute_script("return document.querySelector('.chart .tip').textContent")
    assert "baseline" in tip and "current" in tip, tip
    screenshot(browser, tmp_path / "check.png")


def test_the_suggest_page_draws_the_plan_against_the_budget(browser, pages, tmp_path):
    open_page(browser, pages["suggest"])
    assert problems(browser) == []
    assert browser.execute_script(CANVAS_INK, "#timeline")[0] > 0.02
    body = browser.find_element("tag name", "body").text
    assert "budget" in body and "after the plan" in body
    assert browser.execute_script("return document.querySelectorAll('#plan .line').length") > 0
    screenshot(browser, tmp_path / "suggest.png")
    # what --verify adds (its re-runs take minutes): measured bars beside the estimates
    data = page_data(pages["suggest"])
    advice = data["advice"]
    current = advice["current"]["reserved_bytes"]
    advice["baseline_measured"] = {"reserved_bytes": current, "allocated_bytes": current}
    first = advice["remedies"][0]
    first["measured"] = {"reserved_bytes": current - first["saved_bytes"] // 2,
                         "allocated_bytes": 0}
    measured = tmp_path / "measured.html"
    measured.write_text(page_html(data))
    open_page(browser, measured)
    assert problems(browser) == []
    saved = browser.find_element("id", "remedies").text
    half = format_bytes(first["saved_bytes"] // 2)
    assert "measured" in saved and f"saves {half}" in saved, saved


def test_a_run_of_ranks_lists_the_worst_first(browser, pages):
    data = page_data(pages["snapshot"])
    low = json.loads(json.dumps(data["devices"][0]))
    low["report"]["peak"]["allocated_bytes"] //= 2
    data["devices"] = [low, data["devices"][0]]
    data["devices"][0]["report"]["rank"], data["devices"][1]["report"]["rank"] = 0, 1
    page = pages["snapshot"].with_name("ranks.html")
    page.write_text(page_html(data))
    open_page(browser, page)
    assert problems(browser) == []
    rows = browser.execute_script("return [...document.querySelectorAll('#ranks tbody tr')]"
                                  ".map((r) => r.cells[0].textContent)")
    assert rows == ["1", "0"]  # the higher peak first
    tabs = browser.find_elements("css selector", "#tabs button")
    assert len(tabs) == 2
    tabs[1].click()
    WebDriverWait(browser, 5).until(lambda d: d.execute_script(
        "return MP.shown.then((c) => c.dev.report.rank === 1)"))
    assert problems(browser) == []


@pytest.mark.parametrize("dark", [False, True])
def test_a_snapshots_page_draws_in_light_and_dark(browser, pages, tmp_path, dark):
    open_page(browser, pages["snapshot"], dark)
    assert problems(browser) == []
    background = browser.execute_script("return getComputedStyle(document.body).backgroundColor")
    assert (background == "rgb(22, 23, 26)") == dark
    assert max(browser.execute_script(CANVAS_INK, "#timeline")) > 0.05
    screenshot(browser, tmp_path / f"snapshot-{'dark' if dark else 'light'}.png")


def test_hostile_text_is_shown_as_text(browser, pages):
    open_page(browser, pages["hostile"])
    assert browser.execute_script("return window.pwned === undefined")
    assert browser.execute_script("return document.querySelectorAll('img').length") == 0
    assert HOSTILE in browser.find_element("id", "title").text
    assert HOSTILE in browser.find_element("id", "modules").text
    assert problems(browser) == []


def test_a_page_that_tries_a_request_fails_the_check(browser, pages, tmp_path):
    tampered = tmp_path / "tampered.html"
    tampered.write_text(pages["snapshot"].read_text().replace(
        "<main id=\"main\">", "<main id=\"main\"><img src=\"http://127.0.0.1:9/x.png\">"))
    open_page(browser, tampered)
    assert any("Content Security Policy" in p or "127.0.0.1" in p for p in problems(browser))
