"""The JSON report: one versioned schema for every command (see docs/report-schema.md)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from memprof.analysis.findings import DeviceFindings, Findings, Live, ModuleUsage, Oom, SiteUsage
from memprof.report.files import write_atomic

SCHEMA = "memprof.report/1"


def report_dict(findings: Findings, command: str = "explain",
                run: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report as JSON-ready data; ``run`` holds the facts of a ``memprof run``."""
    data = {
        "schema": SCHEMA,
        "command": command,
        "source": {"path": findings.source, "format": findings.format,
                   "allocator_conf": findings.allocator_conf},
        "units": "bytes",
        "devices": [_device(d) for d in findings.devices],
    }
    if run is not None:
        data["run"] = run
    ranks = sorted({d.rank for d in findings.devices if d.rank is not None})
    if len(ranks) > 1:
        peaks = [d.peak_allocated_bytes for d in findings.devices]
        data["imbalance"] = {"ranks": ranks, "peak_allocated_min_bytes": min(peaks),
                             "peak_allocated_max_bytes": max(peaks),
                             "max_over_min": round(max(peaks) / max(min(peaks), 1), 4)}
    return data


def write_json(data: dict[str, Any], path: Path, overwrite: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (over an existing file only with ``overwrite``)."""
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2) + "\n"), overwrite)


def _device(d: DeviceFindings) -> dict[str, Any]:
    frag = d.fragmentation
    return {
        "device": d.device,
        "rank": d.rank,
        "events": d.events,
        "window": {
            "first_time_us": d.first_time_us,
            "last_time_us": d.last_time_us,
            "blocks_before_window": d.blocks_before_window,
            "bytes_before_window": d.bytes_before_window,
            "events_dropped": d.events_dropped,
            "run_peak": d.run_peak,
        },
        "peak": {
            "allocated_bytes": d.peak_allocated_bytes,
            "reserved_bytes": d.peak_reserved_bytes,
            "reserved_at_peak_bytes": d.reserved_at_peak_bytes,
            "event_index": d.peak_event_index,
            "time_us": d.peak_time_us,
        },
        "end": {"allocated_bytes": d.end_allocated_bytes, "reserved_bytes": d.end_reserved_bytes},
        "categories": d.at_peak.categories,
        # the tensors' own bytes, by category: what a hand count of 4P parameters finds
        "categories_requested": d.at_peak.requested or None,
        "categories_inferred": d.categories_inferred,
        # of those, what the repeated blocks' modules held (memprof run only; else null)
        "categories_in_blocks": d.at_peak.in_blocks or None,
        # the most each category held at any time (exact categories only)
        "category_peaks": None if d.category_timeline is None else
        {k: int(v.max()) for k, v in d.category_timeline.items()},
        # activations memprof run tagged (attention scores, eval passes), live at the peak
        "tagged": None if d.tagged is None else {k: asdict(v) for k, v in d.tagged.items()},
        "top_sites": [_site(s) for s in d.at_peak.sites],
        "top_modules": [_module(m) for m in d.at_peak.modules],
        # the same summed over repeated blocks (``layers.*.mlp``), with their count
        "repeated_modules": [_module(m) for m in d.at_peak.repeated_modules],
        "fragmentation": {
            "unallocated_at_peak_bytes": frag.unallocated_at_peak_bytes,
            "largest_free_block_at_peak_bytes": frag.largest_free_block_at_peak_bytes,
            "unallocated_at_end_bytes": frag.unallocated_at_end_bytes,
            "largest_free_block_at_end_bytes": frag.largest_free_block_at_end_bytes,
            "free_blocks_at_end": frag.free_blocks_at_end,
            "pools_at_peak": [asdict(p) for p in frag.pools_at_peak],
            "pools_at_end": [asdict(p) for p in frag.pools_at_end],
        },
        "oom": _oom(d.ooms[0]) if d.ooms else None,
        "ooms": [_oom(o) for o in d.ooms],
        "oom_events": d.oom_events,
        "replay": asdict(d.replay),
        "steps": [asdict(p) for p in d.steps],
        "leak": None if d.leak is None else {
            "growth_per_step_bytes": d.leak.growth_per_step_bytes,
            "steps": d.leak.steps,
            "site": _site(d.leak.site) if d.leak.site else None,
            "site_growth_bytes": d.leak.site_growth_bytes,
        },
        "step_growth": asdict(d.step_growth),
    }


def _site(s: SiteUsage) -> dict[str, Any]:
    return {
        "site": s.label,
        "file": s.user.filename if s.user else None,
        "line": s.user.line if s.user else None,
        "function": s.user.name if s.user else None,
        "call": f"{s.call.filename}:{s.call.line} {s.call.name}" if s.call else None,
        "bytes": s.bytes,
        "count": s.count,
        "share": round(s.share, 6),
    }


def _module(m: ModuleUsage) -> dict[str, Any]:
    return {
        "module": m.module,
        "bytes": m.bytes,
        "count": m.count,
        "share": round(m.share, 6),
        "frame": f"{m.frame.filename}:{m.frame.line} {m.frame.name}" if m.frame else None,
        "instances": m.instances,
    }


def _live(live: Live) -> dict[str, Any]:
    return {"allocated_bytes": live.allocated_bytes, "categories": live.categories,
            "top_sites": [_site(s) for s in live.sites],
            "top_modules": [_module(m) for m in live.modules]}


def _oom(o: Oom) -> dict[str, Any]:
    data = {k: v for k, v in asdict(o).items() if k != "live"}
    data["live"] = _live(o.live)
    return data
