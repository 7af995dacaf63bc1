"""Training steps: the peak of each, and whether the memory left after each step grows (a leak)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from memprof.analysis.findings import (
    BOUNDED,
    LEAK,
    NO_GROWTH,
    NO_STEPS,
    TOO_FEW_STEPS,
    StepGrowth,
    StepPeak,
)

WARMUP_STEPS = 1  # the first step creates optimizer state and gradients: growth there is expected
LEAK_WINDOW = 4  # steps after warm-up whose growth must be steady to call a leak
MIN_STEPS = WARMUP_STEPS + LEAK_WINDOW
SIGNIFICANT = 0.01  # growth after warm-up below this share of the peak is noise
STEADY = 0.25  # a leak's smallest growth in the window is at least this share of its largest


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


def step_growth(ends: Sequence[int], peak_allocated: int,
                state_ends: Sequence[int] | None = None) -> StepGrowth:
    """Judge the memory left allocated after each step (``ends``, one per step).

    Optimizer state (``state_ends``, where categories are exact) is set aside: it grows by
    the optimizer's design (LBFGS keeps ``history_size`` steps) and is bounded. A leak is
    growth in each of the last ``LEAK_WINDOW - 1`` steps by a steady amount; growth that
    stopped is bounded. Fewer than ``MIN_STEPS`` steps, or growth that goes on unevenly,
    cannot be told apart from either.

    >>> step_growth([10, 20, 30, 40, 50], 100).verdict
    'leak'
    """
    n = len(ends)
    if n == 0:
        return StepGrowth(NO_STEPS, 0, MIN_STEPS)
    total = np.asarray(ends, np.int64)[WARMUP_STEPS:]
    state = np.asarray(state_ends, np.int64)[WARMUP_STEPS:] if state_ends is not None else 0
    kept = total - state
    state_growth = int(state.max() - state[0]) if state_ends is not None and len(kept) else 0
    if n < MIN_STEPS:
        return StepGrowth(TOO_FEW_STEPS, n, MIN_STEPS, optimizer_state_growth_bytes=state_growth)
    growth = int(kept.max() - kept[0])
    deltas = np.diff(kept)
    significant = max(1.0, SIGNIFICANT * peak_allocated)
    if growth < significant or deltas[-1] <= 0:
        if max(growth, state_growth) < significant:
            return StepGrowth(NO_GROWTH, n, MIN_STEPS, growth,
                              optimizer_state_growth_bytes=state_growth)
        grew = np.flatnonzero(np.diff(total) > 0)  # (the first step after warm-up is step 2)
        until = int(grew[-1]) + WARMUP_STEPS + 2 if len(grew) else WARMUP_STEPS + 1
        return StepGrowth(BOUNDED, n, MIN_STEPS, growth, grew_until_step=until,
                          optimizer_state_growth_bytes=state_growth)
    last = deltas[-(LEAK_WINDOW - 1):]
    if last.min() > 0 and last.min() >= STEADY * last.max():
        return StepGrowth(LEAK, n, MIN_STEPS, growth, int(last.sum()) // len(last),
                          optimizer_state_growth_bytes=state_growth)
    # still growing at the end, unevenly: a cache that fills or a leak; more steps will tell
    return StepGrowth(TOO_FEW_STEPS, n, 2 * n, growth, optimizer_state_growth_bytes=state_growth)
