"""The run's timeline drawn by a child process: the same PNG as drawn here, and a fallback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import fixture, needs_fixtures

from memprof.analysis.explain import explain
from memprof.analysis.findings import Findings
from memprof.errors import MemprofError
from memprof.report import background_plot
from memprof.report.background_plot import BackgroundPlot
from memprof.report.plot import Panel, plot_timeline, timeline_panels, timeline_title
from memprof.trace.load import load_snapshot


@pytest.fixture(scope="module")
def findings() -> Findings:
    path = fixture("MAGMA27")  # two devices: two panels
    return explain(load_snapshot(path), str(path))


@pytest.fixture(scope="module")
def panels(findings: Findings) -> list[Panel]:
    return timeline_panels(findings)


@needs_fixtures
def test_the_child_draws_the_png_the_parent_would(findings: Findings, panels: list[Panel],
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    here = tmp_path / "here.png"
    plot_timeline(findings, here)
    monkeypatch.setattr(background_plot, "draw_timeline", None)  # the child's job alone
    with BackgroundPlot() as plot:
        plot.start()
        plot.send(panels, timeline_title(findings), tmp_path / "child.png")
        plot.wait()
    assert (tmp_path / "child.png").read_bytes() == here.read_bytes()
    assert here.read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child.png", "here.png"]


@needs_fixtures
def test_without_a_child_the_plot_is_drawn_here(panels: list[Panel], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    with BackgroundPlot() as plot:
        plot.start()  # cannot start: no such program
        plot.send(panels, "memprof: t", tmp_path / "t.png")
        plot.wait()
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")


@needs_fixtures
def test_a_failed_write_in_the_child_is_one_line(panels: list[Panel], tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with BackgroundPlot() as plot, pytest.raises(MemprofError, match="cannot write"):
        plot.start()
        plot.send(panels, "memprof: t", tmp_path / "file" / "t.png")
        plot.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@needs_fixtures
def test_a_long_title_is_cut_to_the_figures_width(findings: Findings) -> None:
    assert timeline_title(findings, "train.py") == "memprof: train.py"
    title = timeline_title(findings, "train.py " + "--flag=1 " * 40)
    assert len(title) == 130 and title.endswith("\u2026")
