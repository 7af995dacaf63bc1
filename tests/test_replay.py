"""The allocator replay: exact on real snapshots, PyTorch's rules on synthetic sequences."""

from __future__ import annotations

from dataclasses import replace

import pytest

from memprof.analysis.allocator import CachingAllocator
from memprof.analysis.blocks import OutOfMemory
from memprof.analysis.explain import explain
from memprof.analysis.replay import replay
from memprof.analysis.settings import parse_alloc_conf, unmodelled
from memprof.trace import load_snapshot
from memprof.trace.model import AllocatorSettings
from memprof.trace.normalize import normalize
from tests.conftest import fixture, fixture_files, fixture_id, load_raw, needs_fixtures
from tests.independent import peak_allocated

MIB = 1 << 20


def _has_allocs(path) -> bool:
    raw = load_raw(path)
    traces = raw.get("device_traces") or [] if isinstance(raw, dict) else []
    return any(e["action"] == "alloc" for t in traces for e in t)


TRACED = [p for p in fixture_files() if _has_allocs(p)]


@needs_fixtures
@pytest.mark.parametrize("path", TRACED, ids=[fixture_id(p) for p in TRACED])
def test_every_decision_and_address_is_reproduced(path):
    snapshot = load_snapshot(path)
    for device in snapshot.devices:
        segments = snapshot.segments_of(device)
        result = replay(snapshot.traces.get(device), segments, snapshot.settings)
        c = result.check
        assert c.decisions_total > 0 or device not in snapshot.traces
        assert c.decisions_matched == c.decisions_total
        assert c.addresses_matched == c.addresses_total
        assert c.segments_predicted == c.segments_recorded
        assert c.inconsistencies == 0
        assert result.final.reserved == sum(s.total_size for s in segments)
        assert result.final.allocated == sum(s.allocated_size for s in segments)


@needs_fixtures
def test_new_segment_decisions_are_counted_against_the_recording():
    path = fixture("MercuryB1")
    raw = load_raw(path)
    recorded = sum(e["action"] == "segment_alloc" for e in raw["device_traces"][0])
    summary = explain(load_snapshot(path), str(path)).devices[0].replay
    assert summary.segments_recorded == summary.segments_predicted == recorded
    assert summary.reserved_bytes_predicted_peak == summary.reserved_bytes_recorded_peak


@needs_fixtures
def test_expandable_segments_mapped_bytes_equal_reserved():
    path = fixture("Constructor-Sun")
    raw = load_raw(path)
    snapshot = load_snapshot(path)
    assert snapshot.settings.expandable_segments
    for device in snapshot.devices:
        events = raw["device_traces"][device]
        assert any(e["action"] == "segment_map" for e in events)
        result = replay(snapshot.traces[device], snapshot.segments_of(device), snapshot.settings)
        mapped = sum(s["total_size"] for s in raw["segments"] if s["device"] == device)
        assert result.final.reserved == mapped
        # reserved grows only by the mapped pages: 2 MiB (small) or 20 MiB (large) multiples
        for e in events:
            if e["action"] in ("segment_map", "segment_unmap"):
                assert e["size"] % (2 * MIB) == 0


def test_rounding_follows_pytorch():
    a = CachingAllocator()
    assert [a.round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    four = CachingAllocator(AllocatorSettings(roundup_power2_divisions=(4,) * 16))
    # 1.1 MiB rounds up to the next quarter between 1 and 2 MiB
    assert four.round_size(int(1.1 * MIB)) == int(1.25 * MIB)
    assert four.round_size(2 * MIB) == 2 * MIB  # powers of two stay
    assert four.round_size(600) == 1024  # at most 512 * divisions: plain rounding
    assert [a.segment_size(n) for n in (MIB, MIB + 512, 10 * MIB, 11 * MIB + 512)] == \
        [2 * MIB, 20 * MIB, 10 * MIB, 12 * MIB]


def test_large_blocks_keep_a_small_remainder():
    a = CachingAllocator()
    split = a.malloc(int(10.5 * MIB))  # 12 MiB segment, 1.5 MiB left: split
    whole = a.malloc(11 * MIB)  # another 12 MiB segment, 1 MiB left: kept whole
    assert split.size == int(10.5 * MIB)
    assert whole.size == 12 * MIB
    assert a.allocated == int(10.5 * MIB) + 12 * MIB
    assert a.reserved == 24 * MIB


def test_best_fit_reuses_the_smallest_block_then_the_lowest_address():
    a = CachingAllocator()
    blocks = [a.malloc(n * MIB) for n in (30, 40, 30)]
    a.free(blocks[1])
    a.free(blocks[2])
    reused = a.malloc(25 * MIB)
    assert reused.addr == blocks[2].addr  # the 30 MiB hole, not the 40 MiB one
    assert a.reserved == 100 * MIB


def test_a_stream_reuses_only_its_own_cached_blocks():
    a = CachingAllocator()
    mine, other = a.malloc(30 * MIB, stream=1), a.malloc(40 * MIB, stream=2)
    a.free(mine)
    a.free(other)
    assert a.free_stats().largest_block == 40 * MIB and a.free_stats().blocks == 2
    assert a.malloc(35 * MIB, stream=1).seg not in (mine.seg, other.seg)  # 30 MiB too small
    assert a.malloc(25 * MIB, stream=2).addr == other.addr
    assert a.reserved == (30 + 40 + 36) * MIB


def test_max_split_size_keeps_oversize_blocks_whole():
    a = CachingAllocator(parse_alloc_conf("max_split_size_mb:64"))
    big = a.malloc(100 * MIB)
    a.free(big)
    small = a.malloc(30 * MIB)  # may not split the oversize block: a new segment
    assert small.seg is not big.seg
    close = a.malloc(90 * MIB)  # within 20 MiB of the oversize block: takes it whole
    assert close.addr == big.addr and close.size == 100 * MIB


def test_expandable_segments_map_pages_instead_of_segments():
    a = CachingAllocator(parse_alloc_conf("expandable_segments:True"))
    first = a.malloc(25 * MIB)
    second = a.malloc(10 * MIB)
    assert a.reserved == 40 * MIB  # two 20 MiB pages hold both, in one range
    assert second.addr == first.addr + 25 * MIB
    assert len(a.segments) == 1


def test_unknown_settings_are_reported_not_modelled():
    assert unmodelled(AllocatorSettings(conf="backend:cudaMallocAsync", backend="cudaMallocAsync"))
    assert unmodelled(AllocatorSettings(conf="max_non_split_rounding_mb:512"))
    assert not unmodelled(parse_alloc_conf("expandable_segments:True,max_split_size_mb:128"))
    with pytest.raises(ValueError, match="not modelled"):
        parse_alloc_conf("large_segment_size_mb:64")


@needs_fixtures
def test_what_if_expandable_segments_reports_a_peak():
    path = fixture("HugePandaCoder")
    findings = explain(load_snapshot(path), str(path),
                       what_ifs=[parse_alloc_conf("expandable_segments:True")])
    what_if = findings.devices[0].replay.what_if[0]
    assert what_if.settings == "expandable_segments:True"
    # the replayed trace's live bytes are the same under any settings; only the cache differs
    assert what_if.peak_reserved_bytes >= what_if.peak_allocated_bytes > 0


def test_a_device_limit_releases_the_cache_then_runs_out():
    a = CachingAllocator(limit=100 * MIB)
    a.free(a.malloc(60 * MIB))
    big = a.malloc(70 * MIB)  # 60 + 70 > 100: the cached 60 MiB segment is released first
    assert a.reserved == 70 * MIB and big.size == 70 * MIB
    with pytest.raises(OutOfMemory) as oom:
        a.malloc(40 * MIB)  # nothing cached is left to release
    assert oom.value.requested == 40 * MIB
    assert (oom.value.allocated, oom.value.reserved) == (70 * MIB, 70 * MIB)


def _aged_cache(threshold: float) -> tuple[CachingAllocator, list]:
    """Four cached segments freed at different times, then a 100 MiB request."""
    a = CachingAllocator(AllocatorSettings(garbage_collection_threshold=threshold),
                         limit=200 * MIB)
    first, second = a.malloc(30 * MIB), a.malloc(30 * MIB)
    a.free(first)
    third = a.malloc(32 * MIB)  # does not fit the cached 30 MiB: a new segment
    a.free(third)
    fourth = a.malloc(34 * MIB)
    a.free(second)
    a.free(fourth)
    a.malloc(100 * MIB)  # 126 MiB cached + 100 MiB > 200 MiB
    return a, [first.seg, second.seg, third.seg, fourth.seg]


def test_garbage_collection_frees_the_oldest_cached_segments_first():
    collected, segs = _aged_cache(0.5)
    # above half of the limit by 26 MiB: the two oldest (62 MiB) go, the young ones stay
    assert [s.addr in collected.segments for s in segs] == [False, True, False, True]
    assert collected.reserved == (30 + 34 + 100) * MIB
    released, _ = _aged_cache(0.0)  # no garbage collector: everything cached is released
    assert released.reserved == 100 * MIB


@needs_fixtures
def test_what_if_on_a_smaller_device():
    path = fixture("HugePandaCoder")
    snapshot = load_snapshot(path)
    free = explain(snapshot, str(path), what_ifs=[AllocatorSettings()]).devices[0]
    unlimited = free.replay.what_if[0]
    fits = explain(snapshot, str(path), device_memory=unlimited.peak_reserved_bytes).devices[0]
    assert fits.replay.what_if[0].oom_event_index is None
    assert fits.replay.what_if[0].peak_reserved_bytes <= unlimited.peak_reserved_bytes
    # no cache policy fits live tensors into 90% of what they occupy
    short = explain(snapshot, str(path), device_memory=int(0.9 * free.peak_allocated_bytes),
                    what_ifs=[parse_alloc_conf("expandable_segments:True")]).devices[0]
    assert all(w.oom_event_index is not None for w in short.replay.what_if)
    assert all(w.oom_requested_bytes for w in short.replay.what_if)


def _segment(base: int, total: int, blocks: list[tuple[int, int, str]]) -> dict:
    """A large-pool segment whose blocks are ``(offset, size, state)``, the rest inactive."""
    out, at = [], 0
    for offset, size, state in blocks:
        if offset > at:
            out.append({"address": base + at, "size": offset - at, "requested_size": 0,
                        "state": "inactive", "frames": []})
        out.append({"address": base + offset, "size": size, "requested_size": size,
                    "state": state, "frames": []})
        at = offset + size
    if at < total:
        out.append({"address": base + at, "size": total - at, "requested_size": 0,
                    "state": "inactive", "frames": []})
    return {"device": 0, "address": base, "total_size": total, "stream": 0,
            "segment_type": "large", "allocated_size": sum(b["size"] for b in out
                                                           if b["state"] != "inactive"),
            "active_size": 0, "requested_size": 0, "blocks": out}


def _event(action: str, addr: int, size: int) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": []}


def test_a_pre_window_block_ends_where_the_trace_allocates_after_it():
    # the case of issue 8: a 12.5 MiB request that held 13.125 MiB (its 640 KiB remainder
    # was not split); a later allocation lands at its true end while it is still held
    base, requested, held, total = 0x7F5AD8000000, 13_107_200, 13_762_560, 20 * MIB
    trace = [_event("alloc", base + held, 2 * MIB),
             _event("free_requested", base, requested),
             _event("free_completed", base, requested)]
    raw = {"segments": [_segment(base, total, [(held, 2 * MIB, "active_allocated")])],
           "device_traces": [trace]}
    d = explain(normalize(raw)).devices[0]
    assert d.blocks_before_window == 1
    assert d.peak_allocated_bytes == held + 2 * MIB == peak_allocated(raw, 0)[0]
    assert (d.replay.addresses_matched, d.replay.addresses_total) == (1, 1)
    assert d.replay.note == "every decision and block address reproduced"


def test_the_verdict_counts_block_addresses_the_model_did_not_reproduce():
    # best fit reuses the freed 2 MiB hole at the segment's start; the recording did not
    base, total = 0x10000000, 20 * MIB
    trace = [_event("alloc", base, 2 * MIB), _event("alloc", base + 2 * MIB, 2 * MIB),
             _event("free_requested", base, 2 * MIB), _event("free_completed", base, 2 * MIB),
             _event("alloc", base + 4 * MIB, 2 * MIB)]
    segment = _segment(base, total, [(2 * MIB, 2 * MIB, "active_allocated"),
                                     (4 * MIB, 2 * MIB, "active_allocated")])
    trace.insert(0, _event("segment_alloc", base, total))
    d = explain(normalize({"segments": [segment], "device_traces": [trace]})).devices[0]
    r = d.replay
    assert (r.decisions_matched, r.decisions_total) == (3, 3)
    assert (r.addresses_matched, r.addresses_total) == (2, 3)
    assert r.note == "1 block addresses differ, the first at event 5"


def test_an_allocation_inside_a_private_pools_segment_is_predicted_in_that_pool():
    # a CUDA graph's private pool: its segment's later blocks belong to it too, so best fit
    # looks there, not in the default pool's free segment at a lower address
    default, private = 0x10000000, 0x20000000
    segments = [_segment(default, 20 * MIB, []),
                {**_segment(private, 20 * MIB, [(0, 2 * MIB, "active_allocated"),
                                                (2 * MIB, 2 * MIB, "active_allocated")]),
                 "segment_pool_id": (0, 1)}]
    trace = [_event("alloc", private + 2 * MIB, 2 * MIB)]
    d = explain(normalize({"segments": segments, "device_traces": [trace]})).devices[0]
    assert (d.replay.addresses_matched, d.replay.addresses_total) == (1, 1)


@needs_fixtures
def test_a_free_requested_and_completed_at_once_replays_as_two_events_apart():
    raw = load_raw(fixture("MAGMA27"))
    events = raw["device_traces"][0]
    # a free of an address never allocated, then every request kept apart from its completion
    # by an event the replay ignores
    stray = [{"action": a, "addr": 1 << 50, "size": 512, "stream": 0}
             for a in ("free_requested", "free_completed")]
    fused = stray + events
    apart, where = [], []
    for e in fused:
        if e["action"] == "free_completed":
            apart.append({"action": "snapshot", "addr": 0, "size": 0, "stream": 0})
        where.append(len(apart))
        apart.append(e)
    results = []
    for trace in (fused, apart):
        snapshot = normalize({**raw, "device_traces": [trace]})
        results.append(replay(snapshot.traces[0], snapshot.segments_of(0), snapshot.settings))
    one, two = results
    assert sum(e["action"] == "free_completed" for e in events) > 1000
    assert one.check == two.check and one.check.inconsistencies == 2
    assert list(one.allocated) == list(two.allocated[[0] + [w + 1 for w in where]])
    assert list(one.block_size) == list(two.block_size[where])
    assert [where[i] if i < len(fused) else len(apart) for i in one.end] == list(two.end[where])
    assert two.peak == replace(one.peak, index=where[one.peak.index])
    assert two.final == replace(one.final, index=len(apart) - 1)
