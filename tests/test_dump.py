"""Writing recorded traces: the file holds PyTorch's dicts, stacks shared, whatever its length."""

from __future__ import annotations

import io
import pickle
import pickletools
from pathlib import Path

import numpy as np
import pytest

from memprof.trace.dump import dump_snapshot
from memprof.trace.events import OomEvent, as_snapshot_events, snapshot_stack
from memprof.trace.load import load_raw
from memprof.trace.normalize import NotASnapshot, normalize

# The opcodes PyTorch's memory viewer (MemoryViz.js) decodes; any other stops it.
VIEWER_OPCODES = {
    "PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE", "BINGET",
    "BININT", "BININT1", "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME", "LONG1", "LONG_BINGET",
    "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "SETITEMS", "SETITEM", "DICT",
    "SHORT_BINUNICODE", "BINUNICODE", "STOP", "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
    "BINFLOAT",
}


def _recording(events: int) -> dict:
    """A recording's snapshot as memprof holds it: tuples sharing a few stacks, with labels
    and module paths longer than a chunk, and an out-of-memory record."""
    stacks = [((f"f{k}", f"model{k % 3}.py", k),) for k in range(40)]
    trace: list = []
    for i in range(events // 3):
        frames = stacks[i % len(stacks)]
        trace.append(("alloc", 4096 * i, 512 + i, 0, 1_700_000_000_000_000 + i, frames))
        trace += [(a, 4096 * i, 512 + i, 0, 1_700_000_000_000_000 + i, frames)
                  for a in ("free_requested", "free_completed")]
    trace.append(OomEvent("oom", 0, 1 << 40, 0, 123_456, 1_800_000_000_000_000, stacks[0]))
    allocs = range(0, len(trace) - 1, 3)
    return {
        "segments": [], "device_traces": [trace], "allocator_settings": None,
        "external_annotations": [],
        "memprof": {"version": 1, "labels": [[i, "activations"] for i in allocs],
                    "modules": [[i, "blocks.0.attn"] for i in allocs], "steps": [len(trace)]},
    }


def _written(snapshot: dict) -> bytes:
    f = io.BytesIO()
    dump_snapshot(snapshot, f)
    return f.getvalue()


@pytest.mark.parametrize("events", [30, 60_000])  # one chunk, and several
def test_a_recorded_trace_is_written_as_pytorch_dicts(events: int, tmp_path: Path) -> None:
    snapshot = _recording(events)
    data = _written(snapshot)
    (tmp_path / "snapshot.pickle").write_bytes(data)
    loaded = load_raw(tmp_path / "snapshot.pickle")  # memprof's loader: no class referenced
    trace = loaded["device_traces"][0]
    assert trace == as_snapshot_events(snapshot["device_traces"][0])
    assert trace[-1] == {"action": "oom", "addr": 0, "size": 1 << 40, "stream": 0,
                         "device_free": 123_456, "time_us": 1_800_000_000_000_000,
                         "frames": snapshot_stack(snapshot["device_traces"][0][0][-1])}
    assert {k: v for k, v in loaded["memprof"].items() if k != "stacks"} == snapshot["memprof"]
    # each stack once, shared by every event that has it, across chunks, as torch dumps do
    stacks = len({id(e[-1]) for e in snapshot["device_traces"][0]})
    assert len({id(e["frames"]) for e in trace}) == len(loaded["memprof"]["stacks"]) == stacks
    assert {op.name for op, _, _ in pickletools.genops(data)} <= VIEWER_OPCODES


def test_a_snapshot_of_dicts_is_written_as_pickle_writes_it() -> None:
    snapshot = {"segments": [], "device_traces": [as_snapshot_events(
        _recording(30)["device_traces"][0])], "allocator_settings": None}
    assert pickle.loads(_written(snapshot)) == snapshot


def test_normalize_reads_recorded_tuples_as_it_reads_their_dicts() -> None:
    recorded = _recording(3_000)
    as_dicts = {**recorded, "device_traces": [as_snapshot_events(recorded["device_traces"][0])]}
    a, b = normalize(as_dicts).traces[0], normalize(recorded).traces[0]
    for column in ("action", "addr", "size", "stream", "time_us"):
        assert np.array_equal(getattr(a, column), getattr(b, column))
    assert a.device_free == b.device_free == {len(a) - 1: 123_456}
    assert a.frames(0) == b.frames(0)


@pytest.mark.parametrize("other", [{"action": "alloc", "addr": 1, "size": 2, "stream": 0},
                                   ("alloc", 1, 2, 0, 3, (), "extra"), ("alloc", 1)])
def test_a_trace_mixing_recorded_tuples_with_other_things_is_refused(other: object) -> None:
    recorded = _recording(30)
    recorded["device_traces"][0].append(other)
    with pytest.raises(NotASnapshot, match="malformed event"):
        normalize(recorded)
