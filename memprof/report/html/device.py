"""One device's part of the page, read from its findings and its report.json entry."""

from __future__ import annotations

from typing import Any

from memprof.analysis.findings import DeviceFindings
from memprof.analysis.peak_detail import PeakDetail
from memprof.report.console import oom_text, replay_text, ring_buffer_note, step_section
from memprof.report.html.series import timeline

# the blocks of the allocator's map: beyond this many, a segment's neighbouring runs are
# merged whatever their category (the map is a few hundred thousand pixels)
MAX_RUNS = 50_000


def device_page(d: DeviceFindings, report: dict[str, Any], capacity: int | None
                ) -> dict[str, Any]:
    """The page's data for device ``d``: ``report`` (its report.json entry, shown as it is),
    the timeline, the peak's parts and segments, the verdicts in the console's words, and
    ``capacity`` (the card's memory, where known)."""
    return {
        "report": report,
        "timeline": timeline(d),
        "capacity_bytes": capacity,
        "parts": [] if d.peak_detail is None else
        [[p.category, p.module, p.site, p.bytes, p.count] for p in d.peak_detail.parts],
        "segments": None if d.peak_detail is None else _segments(d.peak_detail),
        "text": {
            "steps": step_section(d)[-1].plain,  # the verdict, or why there is none
            "replay": replay_text(d.replay).plain.strip(),
            "ooms": [oom_text(o).plain for o in d.ooms],
            "ring_buffer": ring_buffer_note(d) if d.events_dropped else None,
        },
    }


def _segments(detail: PeakDetail) -> dict[str, Any]:
    """The map: per segment ``[address, size, pool, stream, runs]``, a run being
    ``[offset, size, category, blocks]``; a segment's runs merged where they are too many."""
    total = sum(len(s.runs) for s in detail.segments)
    out = []
    for s in detail.segments:
        runs = [[r.offset, r.size, r.category, r.count] for r in s.runs]
        if total > MAX_RUNS and len(runs) > 1:
            runs = _merged(runs, max(1, len(runs) * MAX_RUNS // total))
        out.append([s.address, s.size, s.pool, s.stream, runs])
    return {"segments": out, "blocks_outside": detail.blocks_outside, "merged": total > MAX_RUNS}


def _merged(runs: list[list[Any]], keep: int) -> list[list[Any]]:
    """``runs`` in ``keep`` groups of neighbours, each given its largest run's category and
    its span (gaps inside a group drawn as held: the map is too coarse to show them)."""
    step = -(-len(runs) // keep)
    out = []
    for i in range(0, len(runs), step):
        group = runs[i:i + step]
        first, last = group[0], group[-1]
        out.append([first[0], last[0] + last[1] - first[0],
                    max(group, key=lambda r: r[1])[2], sum(r[3] for r in group)])
    return out
