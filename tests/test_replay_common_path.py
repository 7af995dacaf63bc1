"""The replay's speed rests on its common path (``take_best_fit``: the recorded block is the
best fit, found with one search). Counted, not timed: on every real trace and on the
benchmark's generated one, every allocation that does not grow the pool takes it, and on a
long real trace and the benchmark's, at least 99% of all allocations do."""

from __future__ import annotations

import sys
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, fixture, fixture_files, fixture_id, needs_fixtures

from memprof.analysis.layout import lay_out
from memprof.analysis.repeats import MIN_SKIPPED
from memprof.analysis.replay import Replay, replay
from memprof.trace.events import TraceEvent, as_snapshot_events
from memprof.trace.load import load_snapshot
from memprof.trace.model import Action, DeviceTrace, Snapshot
from memprof.trace.normalize import normalize


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


def _replays(snapshot: Snapshot, monkeypatch: pytest.MonkeyPatch) -> tuple[Replay, Replay]:
    """The replay of device 0, as it runs and with every event replayed one by one."""
    import memprof.analysis.replay as replaying

    args = (snapshot.traces[0], snapshot.segments_of(0), snapshot.settings)
    skipping = replay(*args)
    with monkeypatch.context() as patch:
        patch.setattr(replaying, "find_repeat", lambda *_: None)
        every = replay(*args)
    return skipping, every


def _same(skipping: Replay, every: Replay) -> None:
    for field in fields(Replay):
        ours, theirs = getattr(skipping, field.name), getattr(every, field.name)
        if field.name == "check":
            ours = replace(ours, repeated=0)
        same = np.array_equal(ours, theirs) if isinstance(ours, np.ndarray) else ours == theirs
        assert same, field.name


def _cut(snapshot: Snapshot, events: int) -> Snapshot:
    """The snapshot as a ring buffer of its last ``events`` events would have kept it."""
    trace = snapshot.traces[0]
    kept = DeviceTrace(**{f.name: getattr(trace, f.name)[-events:] if isinstance(
        getattr(trace, f.name), np.ndarray) else getattr(trace, f.name) for f in fields(trace)})
    return replace(snapshot, traces={0: kept})


@needs_fixtures
@pytest.mark.parametrize("window", ["whole", "ring buffer"])
def test_a_repeating_trace_is_replayed_once_a_period_and_exactly(
        generated: Snapshot, window: str, monkeypatch: pytest.MonkeyPatch):
    """The benchmark's trace repeats a real step: once the allocator settles, its periods
    are filled from the last one replayed. Every timeline, block, release, tally and state
    is what replaying each event gives; a ring buffer's blocks from before it too."""
    snapshot = generated if window == "whole" else _cut(generated, 77_777)
    skipping, every = _replays(snapshot, monkeypatch)
    # all but the first steps, replayed until the allocator settles (three of 5,163
    # events here), and the part of a step at the end
    assert skipping.check.repeated >= 0.8 * len(snapshot.traces[0])
    assert every.check.repeated == 0
    _same(skipping, every)


def test_a_trace_that_leaks_every_step_is_replayed_event_by_event(
        monkeypatch: pytest.MonkeyPatch):
    """A block kept every step moves each later one: nothing repeats, nothing is skipped."""
    program: list[TraceEvent] = []
    for step in range(400):
        program.append(("alloc", ("kept", step), 4096 * (step % 7 + 1), 0, step, ()))
        for k in range(30):
            program.append(("alloc", (step, k), 1 << (10 + k % 12), 0, step, ()))
        for k in range(30):
            program += [(a, (step, k), 1 << (10 + k % 12), 0, step, ())
                        for a in ("free_requested", "free_completed")]
    layout = lay_out(program)
    snapshot = normalize({"segments": layout.segments,
                          "device_traces": [as_snapshot_events(layout.trace)]})
    assert len(snapshot.traces[0]) > MIN_SKIPPED
    skipping, every = _replays(snapshot, monkeypatch)
    assert skipping.check.repeated == 0
    _same(skipping, every)
