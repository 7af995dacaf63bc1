"""The replay's speed rests on its common path (``take_best_fit``: the recorded block is the
best fit, found with one search). Counted, not timed: on every real trace and on the
benchmark's generated one, every allocation that does not grow the pool takes it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, fixture_files, fixture_id, needs_fixtures

from memprof.analysis.replay import replay
from memprof.trace.load import load_snapshot
from memprof.trace.model import Action, DeviceTrace, Snapshot


def _without_growth(trace: DeviceTrace) -> int:
    """Allocations not right after a new segment or mapped pages (those grow the pool)."""
    allocs = trace.action == Action.ALLOC
    grew = np.zeros_like(allocs)
    grew[1:] = allocs[1:] & np.isin(trace.action[:-1], [Action.SEGMENT_ALLOC,
                                                        Action.SEGMENT_MAP])
    return int(allocs.sum() - grew.sum())


def _check(snapshot: Snapshot) -> None:
    for device, trace in snapshot.traces.items():
        common = replay(trace, snapshot.segments_of(device), snapshot.settings).check.common_path
        assert common == _without_growth(trace), (device, common, _without_growth(trace))


@needs_fixtures
@pytest.mark.parametrize("path", fixture_files(), ids=fixture_id)
def test_every_allocation_that_does_not_grow_takes_the_common_path(path: Path):
    _check(load_snapshot(path))


@needs_fixtures
def test_so_does_the_benchmarks_generated_trace(tmp_path: Path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from large_snapshot import build
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    snapshot = load_snapshot(build(tmp_path / "large.pickle", 30_000))
    _check(snapshot)
