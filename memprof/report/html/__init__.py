"""report.html: one self-contained, offline page of a report, a comparison or advice.

``series`` packs the timeline at several resolutions, ``device`` gathers one device's part,
``pages`` the data of each kind of page, ``assemble`` writes the page: the template
(``page.html``), styles and scripts (package data; uPlot vendored under ``vendor/``) and
the data as JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memprof.analysis.findings import Findings
from memprof.report.html.assemble import write_page
from memprof.report.html.pages import report_page


def write_report_page(findings: Findings, report: dict[str, Any], title: str, path: Path,
                      overwrite: bool = False) -> None:
    """Write the page of ``findings`` (``report``: their report.json) to ``path``."""
    write_page(report_page(findings, report, title), path, overwrite)

