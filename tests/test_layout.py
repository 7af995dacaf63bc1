"""Laying a GPU-less trace out in CUDA memory, then replaying it, must agree exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_hook_labels import SAMPLES
from test_run_cli import load_sample

from memprof.analysis.explain import explain
from memprof.analysis.layout import lay_out
from memprof.analysis.replay import replay
from memprof.analysis.settings import parse_alloc_conf
from memprof.collect.cpu.recorder import CpuRecorder
from memprof.collect.cpu.storages import StorageTracker
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


def _recorded(name: str, max_entries: int | None = None) -> list[TraceEvent]:
    """A sample's trace as the exact CPU recorder keeps it (tuples, no CUDA addresses; the
    newest ``max_entries`` events and what is still alive, with a ring buffer)."""
    with CpuRecorder(StorageTracker(max_entries)) as recorder:
        load_sample(name).main([*SAMPLES[name], "--device", "cpu"])
    snapshot = recorder.snapshot()
    assert (snapshot["memprof"]["dropped_events"] > 0) == (max_entries is not None)
    return snapshot["device_traces"][0]


@pytest.mark.parametrize(("name", "conf", "max_entries"), [
    ("transformer_lm", "", None), ("transformer_lm", "expandable_segments:True", None),
    ("mlp_adam", "max_split_size_mb:20,roundup_power2_divisions:4", None),
    ("transformer_lm", "", 300)])
def test_the_placements_own_replay_is_the_replay_of_what_it_placed(
        name: str, conf: str, max_entries: int | None):
    settings = parse_alloc_conf(conf)
    layout = lay_out(_recorded(name, max_entries), settings)
    snapshot = normalize({"segments": layout.segments, "device_traces": [layout.trace],
                          "allocator_settings": None})
    expected = replay(snapshot.traces[0], snapshot.segments_of(0), settings)
    assert layout.tally is not None and expected.check.addresses_matched > 0
    tallied = layout.tally.replay(0)
    for f in dataclasses.fields(expected):
        got, want = getattr(tallied, f.name), getattr(expected, f.name)
        assert np.array_equal(got, want) if isinstance(want, np.ndarray) else got == want, f.name


def test_a_placement_with_frees_requested_first_is_replayed_alike():
    layout = lay_out(_events([("alloc", 1, 1000), ("alloc", 2, 3 * MIB), ("free", 1, 1000),
                              ("alloc", 3, 600), ("free", 2, 3 * MIB)]))
    snapshot = normalize({"segments": layout.segments,
                          "device_traces": [as_snapshot_events(layout.trace)]})
    expected = replay(snapshot.traces[0], snapshot.segments_of(0))
    assert layout.tally is not None
    tallied = layout.tally.replay(0)
    assert np.array_equal(tallied.allocated, expected.allocated)
    assert np.array_equal(tallied.end, expected.end)
    assert tallied.peak == expected.peak and tallied.final == expected.final


@pytest.mark.parametrize("freed", ["tail", "head"])
def test_pages_unmapped_from_an_expandable_range_are_traced_as_the_allocator_gives_them_back(
        freed: str):
    """Expandable segments: 60 + 60 MiB mapped as one range, one tensor freed and its pages
    given back (``empty_cache()``, as ``torch.cuda.graph`` does on entering, or the last
    out-of-memory retry), then 100 MiB more. Giving back the range's tail keeps its start
    (the old trace had no unmap for it); its head cuts it (the old trace unmapped all of it).
    The trace's map and unmap events sum to what the allocator reserves, at every step,
    and its own replay reproduces it."""
    from memprof.analysis.allocator import CachingAllocator
    from memprof.analysis.layout import Placer

    placer = Placer(CachingAllocator(parse_alloc_conf("expandable_segments:True")))
    gone = 2 if freed == "tail" else 1

    def traced() -> int:
        signs = {"segment_map": 1, "segment_unmap": -1}
        return sum(signs.get(e[0], 0) * e[2] for e in placer.trace)

    for event in _events([("alloc", 1, 60 * MIB), ("alloc", 2, 60 * MIB),
                          ("free", gone, 60 * MIB)]):
        placer.add(event)
    assert traced() == placer.alloc.reserved == 120 * MIB
    placer.release_cached(0)
    assert traced() == placer.alloc.reserved == 60 * MIB
    for event in _events([("alloc", 3, 100 * MIB)]):
        placer.add(event)
    assert traced() == placer.alloc.reserved == 160 * MIB
    layout = placer.layout()
    trace = as_snapshot_events(layout.trace)
    d = explain(normalize({"segments": layout.segments, "device_traces": [trace]})).devices[0]
    assert d.replay.inconsistencies == 0 and d.peak_reserved_bytes == 160 * MIB
