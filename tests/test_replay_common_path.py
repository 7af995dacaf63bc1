"""The replay's speed rests on its common path (``take_best_fit``: the recorded block is the
best fit, found with one search). Counted, not timed: on every real trace and on the
benchmark's generated one, every allocation that does not grow the pool takes it, and on a
long real trace and the benchmark's, at least 99% of all allocations do."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, fixture, fixture_files, fixture_id, needs_fixtures

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


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Snapshot:
    """A snapshot built as the benchmark builds its large ones: 100,000 events, of which the
    first step's 187 allocations grow the pool."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from large_snapshot import build
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return load_snapshot(build(tmp_path_factory.mktemp("large") / "large.pickle", 100_000))


@needs_fixtures
def test_so_does_the_benchmarks_generated_trace(generated: Snapshot):
    _check(generated)


@needs_fixtures
@pytest.mark.parametrize("source", ["real", "generated"])
def test_the_common_path_places_99_percent_of_allocations(source: str,
                                                          request: pytest.FixtureRequest):
    """A long real training trace and the benchmark's: the share that keeps the replay fast."""
    snapshot = request.getfixturevalue("generated") if source == "generated" else \
        load_snapshot(fixture("Wedsonlin+assignment2-systems+results_medium_1024_training"))
    trace = snapshot.traces[0]
    allocations = int((trace.action == Action.ALLOC).sum())
    common = replay(trace, snapshot.segments_of(0), snapshot.settings).check.common_path
    assert allocations > 5_000 and common >= 0.99 * allocations, (common, allocations)
