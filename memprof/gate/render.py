"""The gate's verdict as text, JSON, a markdown table (a pull-request comment) or JUnit XML."""

from __future__ import annotations

import json
import re
from typing import Any
from xml.etree import ElementTree

from memprof.gate.compare import IMPROVEMENT, REGRESSION, Change, DeviceVerdict, Verdict
from memprof.report.json import SCHEMA
from memprof.report.text import visible
from memprof.report.units import format_bytes as human

FORMATS = ("text", "json", "markdown", "junit")


def render(verdict: Verdict, fmt: str) -> str:
    """The verdict in format ``fmt`` (one of :data:`FORMATS`)."""
    return {"text": text, "json": as_json, "markdown": markdown, "junit": junit}[fmt](verdict)


def headline(verdict: Verdict, d: DeviceVerdict) -> str:
    """e.g. "peak allocated grew from 3.10 GiB to 3.52 GiB (+13.5%, limit 5%)"."""
    where = "" if _single(verdict) else f"device {d.device}{_rank(d)}: "
    limit = verdict.limit.text
    if d.delta == 0:
        moved = f"is unchanged at {human(d.current_bytes)}"
    else:
        moved = (f"{'grew' if d.delta > 0 else 'shrank'} from {human(d.baseline_bytes)} to"
                 f" {human(d.current_bytes)} ({_change(d)}, limit {limit})")
    line = f"{where}{verdict.metric.title} {moved}"
    return f"{line}: {d.reason}" if d.reason else line


def text(verdict: Verdict) -> str:
    """Plain lines for the terminal: the verdict first, then what grew."""
    lines = []
    for d in verdict.devices:
        mark = {REGRESSION: "REGRESSION", IMPROVEMENT: "IMPROVED"}.get(d.verdict, "OK")
        lines.append(f"{mark}: {headline(verdict, d)}")
        if d.verdict != REGRESSION:
            continue
        lines += [f"  the run changed: {c}" for c in verdict.run_changes]
        for title, changes in (("category", d.categories), ("site", d.sites),
                               ("module", d.modules)):
            grown = [c for c in changes if c.delta > 0][:3]
            if grown:
                lines.append(f"  grew most by {title}: " + "; ".join(_item(c) for c in grown))
    lines += [f"note: {n}" for n in verdict.notes]
    if verdict.improved:
        lines.append("Memory went down: update the baseline with --update-baseline to keep the"
                     " gain.")
    return "\n".join(visible(line) for line in lines)


def as_json(verdict: Verdict) -> str:
    """The verdict inside the report schema (``command: "check"``)."""
    return json.dumps({"schema": SCHEMA, "command": "check", "units": "bytes",
                       "check": verdict_dict(verdict)}, indent=2)


def verdict_dict(verdict: Verdict) -> dict[str, Any]:
    """The verdict as JSON-ready data."""
    return {
        "metric": verdict.metric.name,
        "max_increase": verdict.limit.text,
        "verdict": REGRESSION if verdict.regressed else IMPROVEMENT if verdict.improved
        else "pass",
        "notes": verdict.notes,
        "run_changes": verdict.run_changes,
        "devices": [{
            "device": d.device, "rank": d.rank, "verdict": d.verdict, "reason": d.reason,
            "baseline_bytes": d.baseline_bytes, "current_bytes": d.current_bytes,
            "delta_bytes": d.delta, "allowed_increase_bytes": d.allowed_bytes,
            "change": None if d.change is None else round(d.change, 6),
            **{k: [{"name": c.name, "baseline_bytes": c.baseline_bytes,
                    "current_bytes": c.current_bytes} for c in changes]
               for k, changes in (("categories", d.categories), ("sites", d.sites),
                                  ("modules", d.modules))},
        } for d in verdict.devices],
    }


def markdown(verdict: Verdict) -> str:
    """A table for a pull-request comment."""
    rows = ["| device | metric | baseline | current | change | limit | verdict |",
            "|---|---|---:|---:|---:|---:|---|"]
    for d in verdict.devices:
        rows.append(f"| {d.device}{_rank(d)} | {verdict.metric.title} | {human(d.baseline_bytes)}"
                    f" | {human(d.current_bytes)} | {_change(d)} | {verdict.limit.text} |"
                    f" {'**' + d.verdict + '**' if d.verdict == REGRESSION else d.verdict} |")
    if verdict.regressed and verdict.run_changes:
        rows += ["", "The run changed:", ""] + [f"- {_md(c)}" for c in verdict.run_changes]
    for d in verdict.devices:
        grown = [c for c in d.categories + d.sites + d.modules if c.delta]
        if d.verdict == REGRESSION and grown:
            rows += ["", f"What changed most on device {d.device}{_rank(d)}:", "",
                     "| what | baseline | current | change |", "|---|---:|---:|---:|"]
            rows += [f"| {_md(c.name)} | {human(c.baseline_bytes)} | {human(c.current_bytes)} |"
                     f" {'+' if c.delta > 0 else '−'}{human(abs(c.delta))} |" for c in grown]
    rows += [f"\n_{_md(n)}_" for n in verdict.notes]
    return "\n".join(rows)


def junit(verdict: Verdict) -> str:
    """JUnit XML: one test case per device, a failure for each regression."""
    suite = ElementTree.Element("testsuite", name="memprof check", tests=str(len(
        verdict.devices)), failures=str(sum(d.verdict == REGRESSION for d in verdict.devices)))
    for d in verdict.devices:
        case = ElementTree.SubElement(suite, "testcase", classname="memprof.check",
                                      name=visible(f"device {d.device}{_rank(d)}"
                                                   f" {verdict.metric.name}"))
        if d.verdict == REGRESSION:
            failure = ElementTree.SubElement(case, "failure", message=visible(headline(verdict,
                                                                                        d)))
            failure.text = text(Verdict(verdict.metric, verdict.limit, [d], verdict.notes,
                                        verdict.run_changes))
    return ElementTree.tostring(suite, encoding="unicode", xml_declaration=True)


def _single(verdict: Verdict) -> bool:
    return len(verdict.devices) == 1


def _rank(d: DeviceVerdict) -> str:
    return "" if d.rank is None else f" rank {d.rank}"


def _change(d: DeviceVerdict) -> str:
    if d.change is None:
        return f"+{human(d.delta)}" if d.delta else "0"
    if d.delta and abs(d.change) < 0.0005:  # a few bytes: "+0.0%" would read as none
        return f"{'+' if d.delta > 0 else '-'}{human(abs(d.delta))}"
    return f"{d.change:+.1%}"


def _item(c: Change) -> str:
    return f"{c.name} +{human(c.delta)}"


def _md(s: str) -> str:
    """``s`` as markdown shows it verbatim in a table cell: a code span (no link, image,
    HTML, emphasis or @mention is read inside one), its pipes escaped as GitHub's tables
    need, non-printable characters shown as escapes."""
    shown = visible(s).replace("|", "\\|")
    fence = "`" * (max((len(run) for run in re.findall("`+", shown)), default=0) + 1)
    return f"{fence} {shown} {fence}"
