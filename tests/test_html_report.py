"""report.html, the page's data: the figures of report.json, the timeline's levels, the peak's
parts and segments, nothing fetched, and text from files never markup. (The page in a
browser: test_html_browser.py.)"""

from __future__ import annotations

import base64
import gzip
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from memprof.analysis.explain import explain
from memprof.cli.app import app
from memprof.report.html import series
from memprof.report.html.assemble import page_html
from memprof.report.html.pages import embedded_timelines, report_page
from memprof.report.json import report_dict
from memprof.trace import load_snapshot
from tests.conftest import fixture

DATA = re.compile(r'<script type="application/json" id="memprof-data">(.*?)</script>', re.S)
# the figures a page shows, as report.json has them
FIGURES = ("peak", "end", "categories", "categories_requested", "top_sites", "top_modules",
           "steps", "step_growth", "leak", "fragmentation", "replay", "oom_events")
HOSTILE = "</script><script>window.pwned = 1</script><img src=x onerror=alert(1)>"


def page_data(path: Path) -> dict[str, Any]:
    """The data a page holds."""
    found = DATA.search(path.read_text(encoding="utf-8"))
    assert found is not None, f"{path}: no data"
    return json.loads(found.group(1))


def level_columns(timeline: dict[str, Any], level: int) -> dict[str, np.ndarray]:
    """A level of a page's timeline unpacked as the page unpacks it, by column name."""
    names = ["position", *(["time_us"] if timeline["x"] == "seconds" else []),
             *timeline["series"]]
    planes = np.frombuffer(gzip.decompress(base64.b64decode(timeline["levels"][level]["data"])),
                           np.uint8)
    raw = planes.reshape(8, -1).T.copy().view("<f8").ravel()  # the bytes, unshuffled
    return {name: np.cumsum(col) for name, col in zip(names, raw.reshape(len(names), -1),
                                                      strict=True)}


def assert_page_matches(page: dict[str, Any], report: dict[str, Any]) -> None:
    """The page's devices hold report.json's figures, and its parts, segments and timeline
    add up to them."""
    assert [d["report"]["device"] for d in page["devices"]] == \
        [d["device"] for d in report["devices"]]
    for dev, expected in zip(page["devices"], report["devices"], strict=True):
        shown = dev["report"]
        for key in FIGURES:
            assert shown[key] == expected[key], key
        peak = expected["peak"]
        by_category: dict[str, int] = {}
        for category, _, _, size, _ in dev["parts"]:
            by_category[category] = by_category.get(category, 0) + size
        assert by_category == {k: v for k, v in expected["categories"].items() if v}
        segments = dev["segments"]["segments"]
        assert sum(s[1] for s in segments) == peak["reserved_at_peak_bytes"]
        assert sum(r[1] for s in segments for r in s[4]) == peak["allocated_bytes"]
        assert all(r[0] >= 0 and r[0] + r[1] <= s[1] for s in segments for r in s[4])
        timeline = dev["timeline"]
        for level in range(len(timeline["levels"])):
            cols = level_columns(timeline, level)
            assert len(cols["position"]) == timeline["levels"][level]["points"]
            assert cols["allocated"].max() == peak["allocated_bytes"]
            assert cols["reserved"].max() == peak["reserved_bytes"]
            at = np.flatnonzero(cols["position"] == peak["event_index"] + 1)
            assert at.size == 1 and cols["allocated"][at[0]] == peak["allocated_bytes"]
            stacked = [cols[k] for k in timeline["series"][2:]]
            if stacked:  # exact categories: they sum to the allocated bytes at every point
                assert np.array_equal(np.sum(stacked, axis=0), cols["allocated"])
        last = timeline["levels"][-1]
        assert last["buckets"] is not None or last["points"] == expected["events"] + 1


def explain_html(snapshot: Path, out: Path, *extra: str) -> tuple[dict[str, Any], Path]:
    """``memprof explain SNAPSHOT --json --html``, in this process: (report.json, the page)."""
    page = out / "report.html"
    result = CliRunner().invoke(app, ["explain", str(snapshot), "--json", "-o",
                                      str(out / "report.json"), "--html", str(page), *extra])
    assert result.exit_code == 0, result.output
    return json.loads((out / "report.json").read_text()), page


@pytest.mark.parametrize("name", ["kkaitlyn111", "Constructor-Sun", "MAGMA27"])
def test_a_snapshots_page_holds_its_report_figures(name: str, tmp_path: Path) -> None:
    report, page = explain_html(fixture(name), tmp_path)
    data = page_data(page)
    assert data["kind"] == "report" and data["title"] == fixture(name).name
    assert_page_matches(data, report)


def test_a_long_trace_is_held_at_several_resolutions(monkeypatch: pytest.MonkeyPatch) -> None:
    path = fixture("kkaitlyn111")
    findings = explain(load_snapshot(path), str(path))
    report = report_dict(findings)
    # the fixture's 6,000 events as a long trace: 64 buckets, then 512, then all
    monkeypatch.setattr(series, "FIRST_BUCKETS", 64)
    data = report_page(findings, report, "long")
    levels = data["devices"][0]["timeline"]["levels"]
    assert [v["buckets"] for v in levels] == [64, 512, None]
    assert levels[0]["points"] < levels[1]["points"] < levels[2]["points"]
    assert_page_matches(data, report)
    every = level_columns(data["devices"][0]["timeline"], 2)
    timeline = findings.devices[0].timeline
    assert np.array_equal(every["allocated"], timeline.allocated)
    assert np.array_equal(every["reserved"], timeline.reserved)
    # past the size cap, the finer levels are left out; the first always stays
    monkeypatch.setattr(series, "MAX_PACKED", len(levels[0]["data"]) + len(levels[1]["data"]))
    kept = report_page(findings, report, "long")["devices"][0]["timeline"]["levels"]
    assert kept == levels[:2]
    monkeypatch.setattr(series, "MAX_PACKED", 1)
    assert report_page(findings, report, "long")["devices"][0]["timeline"]["levels"] == \
        levels[:1]


def test_the_page_fetches_nothing(tmp_path: Path) -> None:
    _, page = explain_html(fixture("kkaitlyn111"), tmp_path)
    html = page.read_text()
    assert "default-src 'none'" in html  # the browser refuses any request the page makes
    markup = DATA.sub("", html)
    assert not re.search(r"""\b(src|href|action|srcset)\s*=""", markup)
    assert not re.search(r"\b(fetch|XMLHttpRequest|WebSocket|EventSource|sendBeacon|importScripts)"
                         r"\s*\(|\bimport\s*\(|url\(", markup)
    # the one address: uPlot's own header comment
    assert re.findall(r"https?://[^\s\"')]*", html) == ["https://github.com/leeoniya/uPlot"]
    assert "/*! https://github.com/leeoniya/uPlot (v1.6.32) */" in html


def test_text_from_files_is_never_markup(tmp_path: Path) -> None:
    path = fixture("kkaitlyn111")
    findings = explain(load_snapshot(path), str(path))
    report = report_dict(findings)
    report["devices"][0]["top_sites"][0]["file"] = HOSTILE
    report["devices"][0]["top_sites"][0]["site"] = HOSTILE
    data = report_page(findings, report, HOSTILE)
    html = page_html(data)
    assert html.count("<script") == 2 and html.count("</script>") == 2  # the data's, the code's
    assert "<img" not in html and "\\u003c/script\\u003e" in html
    found = DATA.search(html)
    assert found is not None and json.loads(found.group(1))["title"] == HOSTILE


def test_timelines_are_read_back_from_a_page_and_a_bad_one_refused(tmp_path: Path) -> None:
    _, page = explain_html(fixture("kkaitlyn111"), tmp_path)
    timelines = embedded_timelines(page)
    assert list(timelines) == [(0, None)]
    assert timelines[0, None] == page_data(page)["devices"][0]["timeline"]
    data = page_data(page)
    data["devices"][0]["timeline"]["series"][0] = "<script>"
    bad = tmp_path / "bad.html"
    bad.write_text(page_html(data))
    assert embedded_timelines(bad) == {}
    (tmp_path / "junk.html").write_text('<script type="application/json" id="memprof-data">{')
    assert embedded_timelines(tmp_path / "junk.html") == {}
    assert embedded_timelines(tmp_path / "missing.html") == {}


def test_a_file_named_like_markup_is_its_title(tmp_path: Path) -> None:
    named = tmp_path / "<img src=x onerror=alert(1)>.pickle"
    shutil.copy(fixture("MAGMA27"), named)
    _, page = explain_html(named, tmp_path)
    assert page_data(page)["title"] == named.name
    assert "<img" not in page.read_text()


def test_explain_html_is_not_written_over_without_force(tmp_path: Path) -> None:
    page = tmp_path / "page.html"
    page.write_text("mine")
    result = CliRunner().invoke(app, ["explain", str(fixture("MAGMA27")), "--html", str(page)])
    assert result.exit_code != 0 and page.read_text() == "mine"
