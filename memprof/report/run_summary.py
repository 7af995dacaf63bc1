"""The console summary of ``memprof run``: the breakdown first, then steps, leak and sites."""

from __future__ import annotations

import shlex
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from memprof.analysis.findings import DeviceFindings
from memprof.report.console import (
    CATEGORY_NAMES,
    modules_table,
    more_ooms,
    oom_group,
    ring_buffer_note,
    sites_table,
    step_section,
)
from memprof.report.text import visible
from memprof.report.units import format_bytes as fb
from memprof.trace.model import CATEGORIES, COMMUNICATION, WORKSPACE


def render_run(d: DeviceFindings, run: dict[str, Any], console: Console) -> None:
    """Print the summary of one device of a run."""
    ended = run["exit"]
    how = {"completed": "completed", "exited": f"exited with sys.exit({ended['code']})",
           "raised": f"raised {visible(_first_line(ended['error']))}",
           "interrupted": "was interrupted (Ctrl-C)",
           "stopped": _stopped(run)}
    console.print(Text.assemble(
        ("memprof run ", "bold"), visible(shlex.join(run["command"][2:])),
        f": {how[ended['status']]},"
        f" exit code {ended['code']}, {run['duration_s']:.1f} s on {run['device']}"))
    virtual = run.get("virtual_gpu")
    if virtual:
        console.print(Text(f"Predicted for {virtual['spec']}: the script ran on a virtual GPU"
                           " (CUDA tensors without storage or compute) and memprof's model of"
                           " the CUDA caching allocator laid its memory out.", "dim"))
    elif run["predicted"]:
        console.print(Text("No GPU here: tensors were recorded on the CPU and laid out by"
                           " memprof's model of the CUDA caching allocator; reserved memory is"
                           " its prediction.", "dim"))
    console.print(breakdown(d, run))
    if d.events_dropped:
        console.print(Text(ring_buffer_note(d), "dim"))
    for part in step_section(d):
        console.print(part)
    console.print(sites_table(d.at_peak, "at the peak"))
    if d.at_peak.modules:
        console.print(modules_table(d.at_peak, "at the peak"))
    for oom in d.ooms:
        same = oom.live.allocated_bytes == d.peak_allocated_bytes
        console.print(oom_group(oom, same, d.categories_inferred))
    for line in more_ooms(d):
        console.print(line)
    if d.ooms and run.get("need"):
        console.print(need_line(run["need"], (run.get("virtual_gpu") or {}).get("spec")))


def need_line(need: dict[str, Any], card: str | None) -> Text:
    """What a run that ran out of memory needs (``run.need``), or why it is unknown."""
    if "unknown" in need:
        return Text.assemble(("Needs: unknown", "bold"), f" ({visible(str(need['unknown']))});"
                             " the peak above is a lower bound.")
    rerun = need["rerun"]
    how = f"{rerun['optimizer_steps']} optimizer steps" if rerun["optimizer_steps"] else \
        "no optimizer step"
    if rerun["stopped_by"] == "seconds":
        how += ", stopped when its time ran out: it may need more later"
    verdict = (f"{fb(need['short_bytes'])} short" if need["short_bytes"] else
               "it fits when the memory is laid out as predicted")
    allowed = need.get("allowed_bytes")
    capped = "" if allowed is None else f", where the run could reserve only {fb(allowed)}"
    return Text.assemble(
        ("Needs ", "bold"), (fb(need["total_bytes"]), "bold"),
        f" (predicted: {fb(need['reserved_bytes'])} reserved at the peak and"
        f" {fb(need['context_bytes'])} of CUDA context) on this {fb(need['card_bytes'])}"
        f" {visible(card or 'card')}{capped}: ", (verdict, "bold"),
        f". From the same script run again with the card's memory raised ({how}).")


def breakdown(d: DeviceFindings, run: dict[str, Any]) -> Table:
    """What filled the device at the peak: categories, then the allocator's cache, then context."""
    when = f"step {_peak_step(d)}" if d.steps else f"event {d.peak_event_index:,}"
    t = Table(title=f"Memory at the peak ({when})", title_justify="left", header_style="bold",
              box=None)
    t.add_column("")
    t.add_column("bytes", justify="right")
    t.add_column("share", justify="right")
    total = d.reserved_at_peak_bytes or 1
    for key in CATEGORIES:
        value = d.at_peak.categories[key]
        if key in (WORKSPACE, COMMUNICATION) and not value:
            continue  # only a virtual GPU knows its workspaces; only a distributed run talks
        t.add_row(CATEGORY_NAMES[key], fb(value), f"{100 * value / total:.1f}%")
    t.add_row(Text("allocated (max_memory_allocated)", "bold"), fb(d.peak_allocated_bytes), "",
              end_section=not d.at_peak.requested)
    if d.at_peak.requested:  # what a hand count of the tensors finds: blocks round up
        t.add_row(Text("  the tensors' own bytes (blocks round up)", "dim"),
                  Text(fb(sum(d.at_peak.requested.values())), "dim"), "", end_section=True)
    cached = d.reserved_at_peak_bytes - d.peak_allocated_bytes
    t.add_row("cached by the allocator (reserved, unallocated)", fb(cached),
              f"{100 * cached / total:.1f}%")
    virtual = run.get("virtual_gpu")
    suffix = f", predicted for {virtual['spec']}" if virtual else \
        ", predicted" if run["predicted"] else ""
    t.add_row(Text(f"reserved at the peak{suffix}", "bold"), fb(d.reserved_at_peak_bytes), "",
              end_section=True)
    context = (run.get("cuda") or {}).get("context_bytes")
    if virtual:
        t.add_row("CUDA context and other non-PyTorch memory",
                  fb(virtual["context_bytes"]) + ("" if virtual["context_measured"] else
                                                  " (assumed)"), "")
    else:
        t.add_row("CUDA context and other non-PyTorch memory",
                  fb(context) if context is not None else "not measured (no GPU)", "")
    if d.peak_reserved_bytes != d.reserved_at_peak_bytes:
        t.add_row("peak reserved over the run (max_memory_reserved)", fb(d.peak_reserved_bytes), "")
    return t


def _peak_step(d: DeviceFindings) -> str:
    for p in d.steps:
        if p.start <= d.peak_event_index < p.end:
            return str(p.step)
    return "after the last step" if d.peak_event_index >= d.steps[-1].end else "before step 1"


def _stopped(run: dict[str, Any]) -> str:
    """How a run memprof ended early was stopped (``run.stopped_by``)."""
    reason = run.get("stopped_by")
    if reason == "steps":
        return f"stopped after {run.get('optimizer_steps')} optimizer steps (--steps)"
    if reason == "seconds":
        return "stopped when --seconds ran out"
    return f"stopped by {reason}"  # a signal: SIGTERM


def _first_line(error: str | None, limit: int = 160) -> str:
    """An exception's first line, cut to ``limit`` characters (the JSON keeps it whole)."""
    line = str(error).split("\n", 1)[0]
    return line if len(line) <= limit else line[:limit - 1] + "…"
