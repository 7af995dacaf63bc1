"""The gate's verdict as one offline page: both runs side by side (``--format html``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memprof.gate.compare import Verdict
from memprof.gate.render import text, verdict_dict
from memprof.report.html.assemble import page_html
from memprof.report.html.pages import check_page


def check_html(verdict: Verdict, current: tuple[Path, dict[str, Any]],
               baseline: tuple[Path, dict[str, Any]]) -> str:
    """The page of ``verdict`` on two reports, each (its path, its data)."""
    return page_html(check_page(verdict_dict(verdict), text(verdict), current, baseline))
