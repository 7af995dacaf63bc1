"""The page as one self-contained file: the template with its styles, scripts (uPlot and
memprof's own, package data) and the page's data inlined; nothing is fetched when it opens.

The data is JSON inside ``<script type="application/json">``, every ``<``, ``>`` and ``&``
escaped (``\\u003c``...): no text from a file can end the element or start markup; the
scripts put every text on the page as text (``textContent``), never as markup.
"""

from __future__ import annotations

import json
import math
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from memprof.report.files import write_atomic

STYLES = ("vendor/uPlot.min.css", "style.css")
SCRIPTS = ("vendor/uPlot.iife.min.js", "format.js", "timeline.js", "peak.js", "sections.js",
           "compare.js", "app.js")
_SLOTS = ("<!--memprof:style-->", "<!--memprof:data-->", "<!--memprof:script-->")
_ESCAPES = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026"}


def page_html(data: dict[str, Any]) -> str:
    """The page of ``data`` (from `pages`) as HTML text."""
    start, end = _template()
    return start + _json(data) + end


def write_page(data: dict[str, Any], path: Path, overwrite: bool = False) -> None:
    """Write the page of ``data`` to ``path`` atomically."""
    html = page_html(data)
    write_atomic(path, lambda tmp: tmp.write_text(html, encoding="utf-8"), overwrite)


def _json(data: dict[str, Any]) -> str:
    try:
        text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a NaN from a report handed over, which JSON.parse would refuse
        text = json.dumps(_finite(data), separators=(",", ":"), allow_nan=False)
    return text.translate(_ESCAPES)


def _finite(value: Any) -> Any:
    """``value`` with every NaN and infinity as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


@cache
def _template() -> tuple[str, str]:
    """The page before and after its data, the styles and scripts in."""
    files = resources.files(__package__)
    template = (files / "page.html").read_text(encoding="utf-8")
    styles = "\n".join((files / name).read_text(encoding="utf-8") for name in STYLES)
    scripts = "\n".join((files / name).read_text(encoding="utf-8") for name in SCRIPTS)
    for name, text in (("styles", styles), ("scripts", scripts)):
        if "</" + ("style" if name == "styles" else "script") in text.lower():
            raise ValueError(f"memprof's page {name} would end their own element")
    head, rest = template.split(_SLOTS[0])
    middle, rest = rest.split(_SLOTS[1])
    after, end = rest.split(_SLOTS[2])
    return head + styles + middle, after + scripts + end
