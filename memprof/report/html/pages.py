"""The data of each kind of page: a report (``run``, ``explain``), a comparison (``check``)
and advice (``suggest``). Reports are embedded as report.json has them; what a report.json
lacks, the timelines, is read back from the run's own report.html.

    page = report_page(findings, report_dict(findings, "run", facts), "train.py --steps 5")
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from memprof.analysis.findings import Findings
from memprof.report.colours import ALLOCATED_COLOUR, CATEGORY_COLOURS, PEAK_COLOUR
from memprof.report.console import CATEGORY_NAMES
from memprof.report.html.device import device_page
from memprof.report.text import visible
from memprof.trace.model import CATEGORIES

SCHEMA = "memprof.page/1"
# the facts of a run the page shows (the rest of report.json's run, e.g. its signature, stays
# in report.json)
RUN_FACTS = ("command", "started", "torch_version", "device", "predicted", "allocator_conf",
             "duration_s", "exit", "stopped_by", "optimizer_steps", "rank", "world_size",
             "virtual_gpu", "need", "cuda")
MAX_PAGE_BYTES = 64 << 20  # a page holds a few megabytes at most; anything near this is not one


def report_page(findings: Findings, report: dict[str, Any], title: str) -> dict[str, Any]:
    """The page of one report: ``report`` is ``findings``' report.json (its devices in the
    same order); ``title`` the command line or the snapshot's name."""
    facts = _facts(report)
    capacity = capacity_of(facts)
    return _page("report", title, {
        **_report_head(report, facts),
        "devices": [device_page(d, r, capacity) for d, r in
                    zip(findings.devices, report["devices"], strict=True)],
    })


def check_page(verdict: dict[str, Any], text: str, current: tuple[Path, dict[str, Any]],
               baseline: tuple[Path, dict[str, Any]]) -> dict[str, Any]:
    """The page of ``memprof check``: its verdict (``verdict_dict``), the verdict in words,
    and both runs (each a report.json's path and data), the baseline first."""
    return _page("check", f"{visible(str(current[0]))} against {visible(str(baseline[0]))}",
                 {"verdict": verdict, "text": text,
                  "runs": [_run(*baseline, "baseline"), _run(*current, "current")]})


def suggest_page(advice: dict[str, Any], path: Path, report: dict[str, Any]
                 ) -> dict[str, Any]:
    """The page of ``memprof suggest``: ``advice`` (its JSON) and the run it advises on
    (``report`` read from ``path``)."""
    return _page("suggest", visible(str(path)), {"advice": advice["suggest"],
                                                 "source": advice["source"],
                                                 "runs": [_run(path, report, "run")]})


def capacity_of(facts: dict[str, Any]) -> int | None:
    """The card's memory, where the run says it: the virtual GPU's, or the GPU's."""
    for key in ("virtual_gpu", "cuda"):
        part = facts.get(key)
        if isinstance(part, dict) and isinstance(part.get("total_bytes"), int):
            return part["total_bytes"]
    return None


def _page(kind: str, title: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"schema": SCHEMA, "kind": kind, "title": title,
            "categories": [[k, CATEGORY_NAMES[k], CATEGORY_COLOURS[k]] for k in CATEGORIES],
            "colours": {"allocated": ALLOCATED_COLOUR, "peak": PEAK_COLOUR}, **body}


def _facts(report: dict[str, Any]) -> dict[str, Any]:
    run = report.get("run")
    return {k: run[k] for k in RUN_FACTS if k in run} if isinstance(run, dict) else {}


def _report_head(report: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
    return {"command": report.get("command"), "source": report.get("source"),
            "run": facts or None, "imbalance": report.get("imbalance")}


def _run(path: Path, report: dict[str, Any], role: str) -> dict[str, Any]:
    """A run of a comparison: its report, and its timelines where its report.html has them."""
    facts = _facts(report)
    capacity = capacity_of(facts)
    timelines = embedded_timelines(path.with_suffix(".html"))
    return {"role": role, "path": visible(str(path)), **_report_head(report, facts),
            "devices": [{"report": d, "capacity_bytes": capacity,
                         "timeline": timelines.get((d.get("device"), d.get("rank")))}
                        for d in report["devices"]]}


_DATA = re.compile(rb'<script type="application/json" id="memprof-data">(.*?)</script>', re.S)
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_SERIES = {"allocated", "reserved", *CATEGORIES}


def embedded_timelines(page: Path) -> dict[tuple[Any, Any], dict[str, Any]]:
    """The timelines of a report page memprof wrote, by (device, rank); none when ``page``
    is missing or not such a page (a timeline that is not well formed is left out)."""
    try:
        if not page.is_file() or page.stat().st_size > MAX_PAGE_BYTES:
            return {}
        found = _DATA.search(page.read_bytes())
        data = json.loads(found.group(1)) if found else None
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("kind") != "report":
        return {}
    out = {}
    for d in data.get("devices") or []:
        report = d.get("report") if isinstance(d, dict) else None
        if isinstance(report, dict) and _timeline_ok(d.get("timeline")):
            out[report.get("device"), report.get("rank")] = d["timeline"]
    return out


def _timeline_ok(t: Any) -> bool:
    """Whether ``t`` has the form `series.timeline` gives (it is drawn from another file)."""
    if not isinstance(t, dict) or t.get("x") not in ("event", "seconds"):
        return False
    number = (int, float)
    series = t.get("series")
    levels = t.get("levels")
    return (isinstance(t.get("t0_us"), int | None)
            and isinstance(series, list) and len(series) >= 2
            and all(isinstance(s, str) and s in _SERIES for s in series)
            and isinstance(levels, list) and bool(levels) and all(
                isinstance(v, dict) and isinstance(v.get("points"), int)
                and isinstance(v.get("buckets"), int | None) and isinstance(v.get("data"), str)
                and _BASE64.fullmatch(v["data"]) is not None for v in levels)
            and isinstance(t.get("peak_x"), number)
            and isinstance(t.get("step_x"), list) and all(
                isinstance(s, list) and len(s) == 2 and all(isinstance(x, number) for x in s)
                for s in t["step_x"]))
