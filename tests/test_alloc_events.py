"""The light CPU recorder: the CPU allocator's own events (torch.profiler's memory reporting)
labelled by the role hooks, checked against the exact recorder on the samples."""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_hook_labels import SAMPLES, _exact, at_peak
from test_run_cli import load_sample

from memprof.collect.cpu.alloc_events import AllocatorEvents
from memprof.collect.hooks.labeller import HookLabeller
from memprof.errors import MemprofError
from memprof.trace.events import as_snapshot_events

F32 = torch.float32.itemsize
Recorded = tuple[list[dict[str, Any]], dict[str, Any]]  # a trace as dicts, and its labels


def _light(main: Callable[[list[str]], object], argv: list[str]) -> Recorded:
    events = AllocatorEvents()
    events.start()
    with HookLabeller(time.time_ns) as labeller:
        main(argv)
    trace, times = events.stop()
    return as_snapshot_events(trace), labeller.labels(trace, times)


def test_allocations_and_frees_come_in_order_with_their_bytes(capfd) -> None:
    before = torch.ones(1000)  # allocated before: its free is left out
    events = AllocatorEvents()
    events.start()
    a = torch.empty(300, dtype=torch.float32)
    b = torch.empty(50, dtype=torch.int64)
    del a, before
    c = b.clone()
    trace, times = events.stop()
    assert [(e[0], e[2]) for e in trace] == [
        ("alloc", 300 * F32), ("alloc", 50 * 8), ("free_completed", 300 * F32),
        ("alloc", 50 * 8)]
    assert trace[1][1] == b.data_ptr() and trace[3][1] == c.data_ptr()
    assert trace[2][1] == trace[0][1]
    assert times == sorted(times) and [e[4] for e in trace] == [t // 1000 for t in times]
    # Kineto's log lines and the allocator's warning about `before` stay out of the script's
    assert capfd.readouterr() == ("", "")


def test_python_numbers_wrapped_as_tensors_are_left_out_as_a_gpu_never_holds_them() -> None:
    x = torch.ones(16, 16)
    w = torch.ones(16, 16, requires_grad=True)
    events = AllocatorEvents()
    events.start()
    half = 0.5 * x  # a double and its float cast, then the result
    x.add_(1)  # in place: the number and its cast alone
    mask = x > 0  # the comparison frees the cast after the number
    (x @ w * 0.25).sum().backward()  # the number is saved for backward
    longs = torch.arange(4) + 1  # an integer number needs no cast: kept (8 bytes)
    trace, _ = events.stop()
    sizes = [e[2] for e in trace if e[0] == "alloc"]
    assert sizes[:2] == [half.nbytes, mask.nbytes]  # x.add_(1) allocated nothing
    assert sizes.count(8) == 1 and sizes[-3:] == [longs.nbytes, 8, longs.nbytes]


def test_each_optimizer_step_drains_the_profiler_and_frees_still_pair(monkeypatch) -> None:
    taken = []
    take = AllocatorEvents._take
    monkeypatch.setattr(AllocatorEvents, "_take", lambda self: taken.append(take(self)))
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    events = AllocatorEvents()
    events.start()
    a = torch.empty(1000)
    weight.grad = torch.ones(4)
    optimizer.step()
    assert len(taken) == 1  # drained at the step: the profiler holds no earlier event
    del a
    optimizer.step()
    trace, times = events.stop()
    assert len(taken) == 3
    assert [(e[0], e[2]) for e in trace] == [("alloc", 4000), ("alloc", 16),
                                             ("free_completed", 4000)]
    assert trace[2][1] == trace[0][1] and times == sorted(times)


def test_a_compiled_model_compiles_whole_and_warns_nothing(monkeypatch) -> None:
    monkeypatch.setattr(AllocatorEvents, "DRAIN_S", 0.0)  # a drain due at every forward
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # counted since the process started
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters())
    compiled = torch.compile(model, backend="aot_eager")
    events = AllocatorEvents()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning the script would see
        events.start()
        with HookLabeller(time.time_ns) as labeller:
            for _ in range(3):
                compiled(torch.randn(5, 8)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        trace, times = events.stop()
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert [str(w.message) for w in caught] == []
    labels = Counter(c for _, c in labeller.labels(trace, times)["labels"])
    # Adam's two moments and step count per parameter; a gradient per parameter each step
    assert labels["optimizer_state"] == 3 * 4 and labels["gradients"] == 3 * 4
    assert labels["activations"] > 0


def test_batches_from_worker_processes_are_seen_as_the_exact_recorder_sees_them() -> None:
    # a worker's batch arrives through shared memory, which no operator of this process
    # made (the exact recorder adopts it, worker_batches.py); the allocator reports the
    # mapping here, as it reports the batch num_workers=0 makes
    data = torch.utils.data.TensorDataset(torch.ones(64, 32))
    batches = {}
    for workers in (0, 2):
        events = AllocatorEvents()
        events.start()
        for _ in torch.utils.data.DataLoader(data, batch_size=16, num_workers=workers):
            pass
        trace, _ = events.stop()
        batches[workers] = [e[0] for e in trace if e[2] == 16 * 32 * 4]
    assert batches[0].count("alloc") == batches[2].count("alloc") == 4
    assert batches[2].count("free_completed") == 3  # each dropped for the next; the last held


def test_the_ring_buffer_keeps_the_newest_events_and_what_is_still_alive(monkeypatch) -> None:
    monkeypatch.setattr(AllocatorEvents, "DRAIN_S", 0.0)
    layer = torch.nn.Identity()  # each call is a forward: a drain, and a trim when due
    events = AllocatorEvents(max_entries=100)
    events.start()
    kept = [torch.empty(1000)]  # allocated first, alive at the end
    for i in range(300):
        layer(torch.empty(10 + i))  # made and freed: 600 events
    kept.append(torch.empty(5000))  # the peak: 4000 + 20000 bytes
    trace, times = events.stop()
    assert len(trace) <= 110 and len(times) == len(trace)
    assert trace[0][:3] == ("alloc", kept[0].data_ptr(), 4000)  # kept, though oldest
    assert trace[-1][:3] == ("alloc", kept[1].data_ptr(), 20000)
    assert events.dropped == 2 + 600 - len(trace)
    assert events.max_live_bytes == 24000 and times == sorted(times)


def test_a_running_profiler_is_refused() -> None:
    with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]),
          pytest.raises(MemprofError, match="already running")):
        AllocatorEvents().start()


def test_a_profiler_the_script_starts_ends_the_recording_and_says_so() -> None:
    events = AllocatorEvents()
    events.start()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        torch.ones(8)
    with pytest.raises(MemprofError, match=r"the script ran torch\.profiler"):
        events.stop()


def _both(name: str) -> tuple[Recorded, Recorded]:
    """A sample on the CPU under the light recorder, then under the exact one."""
    main = load_sample(name).main
    argv = [*SAMPLES[name], "--device", "cpu"]
    torch.manual_seed(0)
    light = _light(main, argv)
    torch.manual_seed(0)
    return light, _exact(main, argv)


@pytest.mark.parametrize("name", sorted(set(SAMPLES) - {"ddp_gloo", "cnn"}))
def test_light_labels_equal_the_exact_recorder(name: str) -> None:
    (trace, meta), (exact_trace, exact_meta) = _both(name)
    peak = at_peak(trace, meta["labels"])
    exact = at_peak(exact_trace, exact_meta["labels"])
    assert peak["parameters"] > 0 and peak["activations"] > 0
    # every role the same at the peak, the temporaries too: the Python numbers that
    # operators wrap as CPU tensors are left out, as no dispatch mode sees them
    assert {k: v for k, v in peak.items() if k != "temporaries"} == {
        k: v for k, v in exact.items() if k != "temporaries"}
    assert peak["temporaries"] == exact["temporaries"]
    assert len(meta["steps"]) == len(exact_meta["steps"])
    assert meta["model_files"] == exact_meta["model_files"]
    assert {path for _, path in meta["modules"]} == {path for _, path in exact_meta["modules"]}


def test_cpu_convolution_scratch_is_seen_and_model_state_is_the_same() -> None:
    # CPU convolutions unfold their input into a scratch buffer (im2col) inside the kernel:
    # the allocator reports it, a dispatch mode never sees it, and it moves the peak
    (trace, meta), (exact_trace, exact_meta) = _both("cnn")
    peak = at_peak(trace, meta["labels"])
    exact = at_peak(exact_trace, exact_meta["labels"])
    for role in ("parameters", "buffers", "optimizer_state"):
        assert peak[role] == exact[role] > 0
    allocs = [e for e in trace if e["action"] == "alloc"]
    exact_allocs = [e for e in exact_trace if e["action"] == "alloc"]
    assert len(allocs) > len(exact_allocs)
    assert len(meta["steps"]) == len(exact_meta["steps"])
