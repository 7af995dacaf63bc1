"""What was live at the peak in full: bytes by category, module and site together (the
marginals are ``Live``'s tables), and the segments with their blocks laid out (the
allocator's map at the peak). The HTML report draws both.

    detail = peak_detail(rows, segments_after(segments, trace, peak))
    detail.parts[0]      # Part("activations", "blocks.3.attn", "train.py:12 ...", 1 << 30, 4)
    detail.segments[0]   # SegmentBlocks(0x7f..., 20 << 20, "large", 0, [(0, 4096, ...)])
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from memprof.analysis.replay import pool_name

# parts kept, most bytes first; the rest are summed per category and module path
MAX_PARTS = 400
SMALLER_SITES = "(smaller sites)"


@dataclass(frozen=True, slots=True)
class Part:
    """Bytes live at the peak of one category, allocated by one module, from one site."""

    category: str
    module: str | None  # the innermost module's path; None where modules are unknown
    site: str
    bytes: int
    count: int  # blocks


@dataclass(frozen=True, slots=True)
class Run:
    """Neighbouring live blocks of one category in a segment: ``count`` blocks from
    ``offset`` (bytes into the segment), ``size`` bytes in all."""

    offset: int
    size: int
    category: str
    count: int


@dataclass(slots=True)
class SegmentBlocks:
    """A segment at the peak (for expandable segments, one mapped range) and its blocks."""

    address: int
    size: int
    pool: str
    stream: int
    runs: list[Run] = field(default_factory=list)  # by offset; the gaps are free


@dataclass(slots=True)
class PeakDetail:
    """The peak's live blocks as parts and as a map of the segments."""

    parts: list[Part]
    segments: list[SegmentBlocks]
    blocks_outside: int  # live blocks in no known segment (a trace that lost segment events)


@dataclass(frozen=True, slots=True)
class Row:
    """One block live at the peak."""

    address: int
    size: int
    category: str
    module: str | None
    site: str


def peak_detail(rows: Iterable[Row],
                segments: dict[int, tuple[int, int, tuple[int, int], bool, bool]]
                ) -> PeakDetail:
    """Group ``rows`` into parts and place them in ``segments`` (by address: size, stream,
    pool, small, expandable; as ``window_start.segments_after`` gives them)."""
    rows = sorted(rows, key=lambda r: r.address)
    return PeakDetail(_parts(rows), *_segments(rows, segments))


def _parts(rows: list[Row]) -> list[Part]:
    groups: dict[tuple[str, str | None, str], list[int]] = {}
    for r in rows:
        g = groups.setdefault((r.category, r.module, r.site), [0, 0])
        g[0] += r.size
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: (-kv[1][0], kv[0][0], kv[0][1] or "",
                                                    kv[0][2]))
    parts = [Part(c, m, s, b, n) for (c, m, s), (b, n) in ranked[:MAX_PARTS]]
    rest: dict[tuple[str, str | None], list[int]] = {}
    for (c, m, _), (b, n) in ranked[MAX_PARTS:]:
        g = rest.setdefault((c, m), [0, 0])
        g[0] += b
        g[1] += n
    parts += [Part(c, m, SMALLER_SITES, b, n) for (c, m), (b, n) in
              sorted(rest.items(), key=lambda kv: -kv[1][0])]
    return parts


def _segments(rows: list[Row], segments: dict[int, tuple[int, int, tuple[int, int], bool, bool]]
              ) -> tuple[list[SegmentBlocks], int]:
    starts = sorted(segments)
    out = [SegmentBlocks(a, segments[a][0], pool_name(segments[a][2], segments[a][3]),
                         segments[a][1]) for a in starts]
    outside = 0
    for r in rows:
        i = bisect.bisect_right(starts, r.address) - 1
        if i < 0 or r.address + r.size > starts[i] + out[i].size:
            outside += 1
            continue
        seg, offset = out[i], r.address - starts[i]
        last = seg.runs[-1] if seg.runs else None
        if last is not None and last.category == r.category and \
                last.offset + last.size == offset:
            seg.runs[-1] = Run(last.offset, last.size + r.size, r.category, last.count + 1)
        else:
            seg.runs.append(Run(offset, r.size, r.category, 1))
    return out, outside
