"""Properties of the analysis on synthetic traces, including ring-buffer truncation."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from memprof.analysis.allocator import CachingAllocator
from memprof.analysis.explain import explain
from memprof.trace.normalize import normalize
from tests.independent import peak_allocated

MIB = 1 << 20
sizes = st.one_of(st.integers(1, 4096), st.integers(4096, 2 * MIB), st.integers(2 * MIB, 64 * MIB))
ops = st.lists(st.tuples(st.booleans(), sizes, st.integers(0, 1000)), min_size=1, max_size=80)


def record(program: list[tuple[bool, int, int]]) -> dict:
    """Run ``program`` (alloc, or free the k-th live block) on the simulator; emit a snapshot."""
    alloc = CachingAllocator()
    events, live = [], []
    for is_alloc, size, k in program:
        if is_alloc or not live:
            before = set(alloc.segments)
            block = alloc.malloc(size)
            for addr in set(alloc.segments) - before:
                events.append({"action": "segment_alloc", "addr": addr,
                               "size": alloc.segments[addr].total, "stream": 0})
            events.append({"action": "alloc", "addr": block.addr, "size": size, "stream": 0})
            live.append(block)
        else:
            block = live.pop(k % len(live))
            for action in ("free_requested", "free_completed"):
                events.append({"action": action, "addr": block.addr, "size": block.requested,
                               "stream": 0})
            alloc.free(block)
    segments = [{
        "device": 0, "address": seg.addr, "total_size": seg.total, "stream": 0,
        "segment_type": "small" if seg.small else "large", "segment_pool_id": (0, 0),
        "allocated_size": sum(b.size for b in seg.blocks() if b.allocated),
        "active_size": sum(b.size for b in seg.blocks() if b.allocated),
        "requested_size": sum(b.requested for b in seg.blocks() if b.allocated),
        "is_expandable": False, "frames": [],
        "blocks": [{"address": b.addr, "size": b.size, "requested_size": b.requested,
                    "state": "active_allocated" if b.allocated else "inactive", "frames": []}
                   for b in seg.blocks()],
    } for seg in alloc.segments.values()]
    return {"segments": segments, "device_traces": [events]}


@settings(max_examples=60, deadline=None)
@given(ops, st.integers(0, 200))
def test_timeline_invariants_hold_on_any_window(program, dropped):
    raw = record(program)
    # a ring buffer keeps only the newest events: drop the oldest
    raw["device_traces"][0] = raw["device_traces"][0][dropped:]
    findings = explain(normalize(raw))
    if not findings.devices:
        return
    d = findings.devices[0]
    assert (d.timeline.allocated >= 0).all()
    assert (d.timeline.reserved >= d.timeline.allocated).all()
    assert d.peak_allocated_bytes >= d.end_allocated_bytes
    assert d.end_allocated_bytes == sum(s["allocated_size"] for s in raw["segments"])
    assert (d.peak_allocated_bytes, d.end_allocated_bytes) == peak_allocated(raw, 0)
    assert sum(d.at_peak.categories.values()) == d.peak_allocated_bytes
    r = d.replay
    assert r.decisions_matched == r.decisions_total
    assert r.addresses_matched == r.addresses_total
