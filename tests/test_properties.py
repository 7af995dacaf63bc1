"""Properties of the analysis on synthetic traces, including ring-buffer truncation."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from memprof.analysis.explain import explain
from memprof.analysis.layout import lay_out
from memprof.trace.events import as_snapshot_events
from memprof.trace.normalize import normalize
from tests.independent import peak_allocated

MIB = 1 << 20
sizes = st.one_of(st.integers(1, 4096), st.integers(4096, 2 * MIB), st.integers(2 * MIB, 64 * MIB))
ops = st.lists(st.tuples(st.booleans(), sizes, st.integers(0, 1000)), min_size=1, max_size=80)


def record(program: list[tuple[bool, int, int]]) -> dict:
    """Run ``program`` (alloc, or free the k-th live block) and lay it out as on a GPU."""
    events, live = [], []
    for n, (is_alloc, size, k) in enumerate(program):
        if is_alloc or not live:
            events.append(("alloc", n, size, 0, 0, ()))
            live.append((n, size))
        else:
            ident, size = live.pop(k % len(live))
            events += [(a, ident, size, 0, 0, ())
                       for a in ("free_requested", "free_completed")]
    layout = lay_out(events)
    return {"segments": layout.segments, "device_traces": [as_snapshot_events(layout.trace)]}


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
    assert r.inconsistencies == 0
    assert r.final_reserved_predicted_bytes == r.final_reserved_recorded_bytes
    assert r.decisions_matched == r.decisions_total
    assert r.addresses_matched == r.addresses_total
