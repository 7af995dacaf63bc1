"""The allocator replay: exact on real snapshots, PyTorch's rules on synthetic sequences."""

from __future__ import annotations

import pytest

from memprof.analysis.allocator import CachingAllocator
from memprof.analysis.explain import explain
from memprof.analysis.replay import replay
from memprof.analysis.settings import parse_alloc_conf, unmodelled
from memprof.trace import load_snapshot
from memprof.trace.model import AllocatorSettings
from tests.conftest import fixture, fixture_files, load_raw, needs_fixtures

MIB = 1 << 20


def _has_allocs(path) -> bool:
    raw = load_raw(path)
    traces = raw.get("device_traces") or [] if isinstance(raw, dict) else []
    return any(e["action"] == "alloc" for t in traces for e in t)


TRACED = [p for p in fixture_files() if _has_allocs(p)]


@needs_fixtures
@pytest.mark.parametrize("path", TRACED, ids=[p.name[:40] for p in TRACED])
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
