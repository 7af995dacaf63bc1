"""The timeline as the page holds it: the PNG's points (`kept_points`) at several
resolutions, each packed small.

A level keeps, of each of its buckets, the first point and the highest and lowest allocated
and reserved points, so a step line through them has the full timeline's outline at any
zoom that shows a bucket or more per pixel; the page draws the coarsest level that does.
The finest level holds every point when the trace is short enough. A level is its
columns (position, time, allocated, reserved, then each category), each delta-coded as
float64 (exact for integers below 2**53), byte-shuffled, gzipped and base64-encoded: a
browser unpacks it with ``DecompressionStream``, only when the zoom first needs it.
"""

from __future__ import annotations

import base64
import zlib
from typing import Any

import numpy as np

from memprof.analysis.findings import DeviceFindings
from memprof.report.plot import kept_points

FIRST_BUCKETS = 2048  # the first level: the PNG's points, a few per pixel of a wide chart
FACTOR = 8  # each level has this many times the buckets of the one before
MAX_BUCKETS = 1 << 20  # the finest level of a long trace: 10M events, 10 a bucket
# the levels' packed text at most (the first is always kept): a finer level past it is left
# out, so a page stays a few megabytes however long and irregular its trace
MAX_PACKED = 4 << 20


def timeline(d: DeviceFindings) -> dict[str, Any]:
    """The page's timeline of device ``d``: its levels, and where its steps and peak are."""
    t = d.timeline
    n = len(t.allocated)
    times = None
    if t.time_us is not None and len(t.time_us):
        times = np.concatenate([t.time_us[:1], t.time_us]).astype(np.int64)
    columns = {"allocated": t.allocated, "reserved": t.reserved, **(d.category_timeline or {})}
    peak = d.peak_event_index + 1
    levels: list[dict[str, Any]] = []
    buckets, packed = FIRST_BUCKETS, 0
    while True:
        kept = kept_points(t.allocated, t.reserved, peak, buckets)
        data = _pack([kept, *([] if times is None else [times[kept]]),
                      *(v[kept] for v in columns.values())])
        packed += len(data)
        if levels and packed > MAX_PACKED:
            break
        levels.append({"buckets": None if len(kept) == n else buckets, "points": len(kept),
                       "data": data})
        if len(kept) == n or buckets >= MAX_BUCKETS:
            break
        buckets *= FACTOR

    def x(position: int) -> float:
        return float(position - 1) if times is None else (times[position] - times[0]) / 1e6

    return {
        "x": "event" if times is None else "seconds",
        "t0_us": None if times is None else int(times[0]),
        "series": list(columns),
        "levels": levels,
        "peak_x": x(peak),
        "step_x": [[x(s.start + 1 if s.start + 1 < n else n - 1), x(min(s.end, n - 1))]
                   for s in d.steps],
    }


def _pack(columns: list[np.ndarray]) -> str:
    """``columns`` (int64, one length) delta-coded as float64, byte-shuffled (the values'
    first bytes, then their second bytes, ...: alike bytes together compress four times
    smaller), gzipped, in base64."""
    deltas = np.concatenate([np.diff(c.astype(np.int64), prepend=0) for c in columns])
    shuffled = deltas.astype("<f8").view(np.uint8).reshape(-1, 8).T.tobytes()
    packer = zlib.compressobj(6, zlib.DEFLATED, 31)  # wbits 31: a gzip stream
    return base64.b64encode(packer.compress(shuffled) + packer.flush()).decode("ascii")
