"""Laying a GPU-less trace out in CUDA memory, then replaying it, must agree exactly."""

from __future__ import annotations

from memprof.analysis.explain import explain
from memprof.analysis.layout import lay_out
from memprof.trace.events import TraceEvent, as_snapshot_events
from memprof.trace.normalize import normalize

MIB = 1 << 20


def _events(program: list[tuple[str, int, int]]) -> list[TraceEvent]:
    out = []
    for op, ident, size in program:
        actions = ("alloc",) if op == "alloc" else ("free_requested", "free_completed")
        out += [(a, ident, size, 0, 0, ()) for a in actions]
    return out


def test_frees_keep_their_address_when_blocks_merge():
    program = [("alloc", 1, 1000), ("alloc", 2, 1000), ("alloc", 3, 30 * MIB),
               ("free", 1, 1000), ("free", 2, 1000), ("alloc", 4, 1500)]
    layout = lay_out(_events(program))
    trace, segments = as_snapshot_events(layout.trace), layout.segments
    allocs = {e["addr"] for e in trace if e["action"] == "alloc"}
    freed = [e["addr"] for e in trace if e["action"] == "free_completed"]
    assert len(freed) == 2 and set(freed) <= allocs and freed[0] != freed[1]
    d = explain(normalize({"segments": segments, "device_traces": [trace]})).devices[0]
    assert d.replay.inconsistencies == 0
    assert d.replay.addresses_matched == d.replay.addresses_total == 4
    # a 2 MiB small segment and a 30 MiB large one; 1500 B reuses the merged small hole
    assert d.end_reserved_bytes == 32 * MIB
    assert d.end_allocated_bytes == 30 * MIB + 1536
    assert d.peak_allocated_bytes == 30 * MIB + 2048
