"""Training steps: the peak of each, and memory that grows from step to step (a leak)."""

from __future__ import annotations

from itertools import pairwise

import numpy as np

from memprof.analysis.findings import Leak, Live, StepPeak


def step_peaks(allocated: np.ndarray, steps: list[int]) -> list[StepPeak]:
    """Per-step peaks from the allocated timeline (``allocated[i + 1]``: after event ``i``)."""
    out, start = [], 0
    for k, end in enumerate(steps, 1):
        if end <= start:
            continue
        window = allocated[start + 1: end + 1]
        out.append(StepPeak(k, start, end, int(window.max()), int(allocated[end])))
        start = end
    return out


def find_leak(peaks: list[StepPeak], first: Live, last: Live,
              peak_allocated: int) -> Leak | None:
    """A probable leak: after the first step (which creates optimizer state), memory left
    allocated grew after every step, by at least 1% of the peak in all.

    ``first`` and ``last`` are what was live after the second and the last step.
    """
    ends = [p.end_allocated_bytes for p in peaks[1:]]
    if len(ends) < 3 or any(b <= a for a, b in pairwise(ends)):
        return None
    growth = ends[-1] - ends[0]
    if growth < 0.01 * peak_allocated:
        return None
    before = {s.label: s.bytes for s in first.sites}
    grown = [(s.bytes - before.get(s.label, 0), s) for s in last.sites]
    size, site = max(grown, key=lambda g: g[0], default=(0, None))
    return Leak(growth // (len(ends) - 1), len(ends) - 1, site, size)
