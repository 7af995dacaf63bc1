"""Explain time on one segment holding N blocks: near-linear in N, or quadratic?

Expandable-segment snapshots keep all their blocks in one segment, so every lookup
inside a segment must stay cheap. Three synthetic traces, each at several N:

- ``before window``: N blocks alive when the trace starts, freed in a shuffled order
  (each is sized from the segment and the trace);
- ``in window``: N blocks allocated and freed inside one expandable segment;
- ``off best fit``: N allocations whose recorded addresses are not where best fit would
  put them (the simulator must carve each out of a large free block).

Usage: python benchmarks/one_segment.py [N ...]   (default 10000 40000 100000)
"""

from __future__ import annotations

import random
import sys
import time

from measure import machine, write_table

from memprof.analysis.explain import explain
from memprof.trace.load import gc_paused
from memprof.trace.normalize import normalize

BLOCK = 2 << 20
BASE = 0x7F0000000000


def _event(action: str, addr: int, size: int) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": []}


def _segment(total: int, expandable: bool) -> dict:
    return {"device": 0, "address": BASE, "total_size": total, "stream": 0,
            "segment_type": "large", "allocated_size": 0, "active_size": 0,
            "requested_size": 0, "is_expandable": expandable,
            "blocks": [{"address": BASE, "size": total, "requested_size": 0,
                        "state": "inactive", "frames": []}]}


def before_window(n: int) -> dict:
    order = list(range(n))
    random.Random(0).shuffle(order)
    trace = [_event(a, BASE + k * BLOCK, BLOCK)
             for k in order for a in ("free_requested", "free_completed")]
    return {"segments": [_segment(n * BLOCK, False)], "device_traces": [trace]}


def in_window(n: int) -> dict:
    trace = [_event("segment_map", BASE, n * BLOCK)]
    trace += [_event("alloc", BASE + k * BLOCK, BLOCK) for k in range(n)]
    trace += [_event(a, BASE + k * BLOCK, BLOCK)
              for k in range(n) for a in ("free_requested", "free_completed")]
    trace.append(_event("segment_unmap", BASE, n * BLOCK))
    return {"segments": [], "device_traces": [trace],
            "allocator_settings": {"expandable_segments": True}}


def off_best_fit(n: int) -> dict:
    # every other slot, leaving a hole below each: best fit would fill the lowest hole
    slots = [BASE + 2 * k * BLOCK for k in range(n)]
    trace = [_event("alloc", a + BLOCK, BLOCK) for a in slots]
    trace += [_event(a, s + BLOCK, BLOCK)
              for s in slots for a in ("free_requested", "free_completed")]
    return {"segments": [_segment(2 * n * BLOCK, False)], "device_traces": [trace]}


CASES = {"before window": before_window, "in window": in_window, "off best fit": off_best_fit}


def seconds(raw: dict) -> float:
    start = time.perf_counter()
    with gc_paused():
        findings = explain(normalize(raw))
    assert findings.devices, "the synthetic snapshot was not explained"
    return time.perf_counter() - start


def main(argv: list[str]) -> None:
    sizes = [int(a) for a in argv[1:]] or [10_000, 40_000, 100_000]
    rows = []
    for name, build in CASES.items():
        times = [seconds(build(n)) for n in sizes]
        growth = times[-1] / times[0] / (sizes[-1] / sizes[0])
        rows.append([name, *[f"{t:.2f}" for t in times], f"{growth:.2f}"])
    write_table("one_segment", ["trace", *[f"{n:,} blocks (s)" for n in sizes],
                                f"time growth / N growth ({sizes[0]:,} to {sizes[-1]:,})"],
                rows, "Explain (normalise, replay, analysis) in one process. A last column"
                " near 1 is linear; N-fold more would be quadratic. Seconds vary by tens of"
                f" percent on this machine; the ratio is what to read. Machine: {machine()}.")


if __name__ == "__main__":
    main(sys.argv)
