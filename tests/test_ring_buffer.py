"""`memprof run --max-entries`: the CPU recorder's and the virtual GPU's ring buffer.

A run with a small ring buffer must tell the user that its trace is one, and still give
the exact peak (here, in the last step) and the exact categories of what is alive, as the
same run with a buffer large enough for every event does, and keep the script's exit code.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Jobs

from memprof.collect.cpu.recorder import CpuRecorder
from memprof.collect.cpu.storages import StorageTracker
from memprof.trace.events import as_snapshot_events
from tests.test_run_cli import F32, block, memprof_run, report

# ~7,000 events: churn of temporaries, then a step whose batch (so peak) grows each time
SCRIPT = """\
import sys
import torch

device = sys.argv[1]
model = torch.nn.Linear(64, 64, device=device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for step in range(6):
    for _ in range(200):
        torch.ones(8, device=device) + 1
    optimizer.zero_grad()
    model(torch.ones(32 * (step + 1), 64, device=device)).sum().backward()
    optimizer.step()
sys.exit(3)
"""
SMALL = 1000
ALL = 1_000_000
MODEL_BYTES = block(64 * 64 * F32) + block(64 * F32)


# --- the runs: every test's, started together on first use ------------------------------

jobs = Jobs()
WHERE = {"cpu": ["--device", "cpu"], "cuda": ["--virtual-gpu", "H100"]}


def _ring(device: str, entries: int) -> None:
    def one(where: Path) -> tuple[Any, dict[str, Any]]:
        (where / "train.py").write_text(SCRIPT)
        out = f"{device}-{entries}"
        result = memprof_run(where, *WHERE[device], "--max-entries", str(entries), "-o", out,
                             "train.py", device)
        return result, report(Path(where, out))

    one.__name__ = f"{device}-{entries}"
    jobs(one)


def _early_peak(device: str) -> None:
    def one(where: Path) -> tuple[Any, Path]:
        (where / "early.py").write_text(EARLY_PEAK)
        return memprof_run(where, *WHERE[device], "--max-entries", str(SMALL), "--max-peak",
                           "8MiB", "-o", "out", "early.py", device), where

    one.__name__ = f"early-{device}"
    jobs(one)


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Any]]]:
    yield from jobs.started(tmp_path_factory, "ring")


@pytest.fixture(scope="module")
def runs(processes: dict[str, Future[Any]]) -> dict[tuple[str, int], Any]:
    return {(device, entries): processes[f"{device}-{entries}"].result()
            for device in WHERE for entries in (SMALL, ALL)}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_small_ring_buffer_says_so_and_keeps_the_peak_exact(runs: dict, device: str) -> None:
    (small, bounded), (full, unbounded) = runs[device, SMALL], runs[device, ALL]
    assert small.code == full.code == 3
    d, whole = bounded["devices"][0], unbounded["devices"][0]
    assert whole["window"]["events_dropped"] == 0
    assert d["window"]["events_dropped"] > 4 * SMALL
    assert d["events"] < whole["events"] - 4 * SMALL
    assert "The trace is a ring buffer (--max-entries)" in small.stderr
    assert "ring buffer" not in full.stderr
    assert d["peak"]["allocated_bytes"] == whole["peak"]["allocated_bytes"]
    assert d["categories"] == whole["categories"]
    assert d["categories"]["parameters"] == MODEL_BYTES
    assert d["categories"]["optimizer_state"] == MODEL_BYTES  # momentum buffers, still alive
    assert d["end"]["allocated_bytes"] == whole["end"]["allocated_bytes"]
    assert bounded["run"]["optimizer_steps"] == unbounded["run"]["optimizer_steps"] == 6
    assert d["steps"][-1]["peak_allocated_bytes"] == whole["steps"][-1]["peak_allocated_bytes"]


def test_tracker_keeps_live_allocations_and_their_labels() -> None:
    kept = []
    tracker = StorageTracker(max_entries=100)
    with CpuRecorder(tracker) as recorder:
        for i in range(300):
            x = torch.ones(1000 + i)
            if i % 50 == 0:
                kept.append(x)
            x + 1
        del x
    snapshot = recorder.snapshot()
    events = as_snapshot_events(snapshot["device_traces"][0])
    # trimmed before an operator once a quarter past its last trim; an op adds a few events
    assert len(events) <= (100 + len(kept)) * 1.25 + 10
    # each iteration: two allocs and, but for the kept ones, their two free events each
    recorded = 300 * 2 * 3 - 2 * len(kept)
    assert snapshot["memprof"]["dropped_events"] == tracker.dropped == recorded - len(events)
    live = {e["size"] for e in events[:len(kept)]}
    assert live == {(1000 + i) * F32 for i in range(0, 300, 50)}
    assert [label for _, label in snapshot["memprof"]["labels"][:len(kept)]] == ["other"] * 6


EARLY_PEAK = """\
import sys
import torch

device = sys.argv[1]
big = torch.ones(4 << 20, device=device)  # 16 MiB, the run's peak, freed at once
del big
for _ in range(1000):  # then enough small events to push it out of the ring buffer
    torch.ones(8, device=device) + 1
"""


for _device in WHERE:
    _ring(_device, SMALL)
    _ring(_device, ALL)
    _early_peak(_device)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_peak_the_ring_buffer_dropped_is_still_reported_and_gated(
        processes: dict[str, Future[Any]], device: str) -> None:
    result, where = processes[f"early-{device}"].result()
    d = report(where / "out")["devices"][0]
    assert d["peak"]["allocated_bytes"] < 1 << 20  # the kept events' peak
    run_peak = d["window"]["run_peak"]
    assert run_peak["requested_bytes"] == 16 << 20
    if device == "cuda":  # the virtual GPU's allocator counted it
        assert run_peak["allocated_bytes"] == 16 << 20
        assert run_peak["reserved_bytes"] >= run_peak["allocated_bytes"]
        assert "The run's peak came before them: 16.00 MiB allocated" in result.stderr
    else:
        assert run_peak["allocated_bytes"] is None
        assert "The run's peak came before them: at least 16.00 MiB allocated" in result.stderr
    assert result.code == 1 and "exceeds --max-peak 8.00 MiB" in result.stderr
    assert "so the replay starts without the segments they made" in d["replay"]["note"]


def test_a_virtual_snapshot_per_step_is_the_trace_then_even_after_a_trim() -> None:
    # torch.cuda.memory._snapshot() on the virtual GPU converts only the events new since
    # the last call, and starts over once the ring buffer dropped some
    from types import SimpleNamespace

    from memprof.collect.virtual.cuda_api import HistoryWindow

    stack = (("train.py", 3, "main"),)
    trace: list[tuple] = []
    placer = SimpleNamespace(trace=trace,
                             layout=lambda: SimpleNamespace(trace=list(trace), segments=[]))
    window = HistoryWindow(SimpleNamespace(placer=placer), {})
    window.record()  # from the first event on
    trace += [("alloc", 512 * i, 512, 0, i, stack) for i in range(6)]
    for _ in range(2):
        trace.append(("free_requested", 0, 512, 0, len(trace), stack))
        assert window.snapshot()["device_traces"][0] == as_snapshot_events(trace)
    del trace[2:4]  # the ring buffer keeps the first event, drops two after it, and
    trace += [("alloc", 512 * i, 512, 0, i, stack) for i in range(8, 11)]  # goes on
    assert window.snapshot()["device_traces"][0] == as_snapshot_events(trace)
