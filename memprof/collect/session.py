"""Run a target under a recorder and return its trace in PyTorch's snapshot format."""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memprof.analysis.layout import Layout, lay_out
from memprof.analysis.tally import Tally
from memprof.collect import cuda
from memprof.collect.alloc_events import AllocatorEvents
from memprof.collect.apply import applied, requested
from memprof.collect.cpu_recorder import CpuRecorder
from memprof.collect.endings import stops
from memprof.collect.labeller import HookLabeller
from memprof.collect.launch import Outcome, Target, run
from memprof.collect.profiler import StepWindowProfiler
from memprof.collect.storages import StorageTracker, requested_peak
from memprof.errors import MemprofError
from memprof.heap import frozen, trim
from memprof.trace.model import AllocatorSettings


@dataclass
class Recording:
    """A finished run: its snapshot (with exact labels), how it ended, and facts about it."""

    snapshot: dict[str, Any]
    outcome: Outcome
    device: str
    predicted: bool  # the CUDA layout is the allocator model's prediction (no GPU was used)
    seconds: float
    facts: dict[str, Any] = field(default_factory=dict)
    oom_snapshot: dict[str, Any] | None = None
    virtual_gpu: dict[str, Any] | None = None  # the card a virtual-GPU run predicted for
    tally: Tally | None = None  # the predicted layout's replay, tallied as it was placed


def record(target: Target, use_cuda: bool, max_entries: int, settings: AllocatorSettings,
           profile_to: Path | None = None, steps: int | None = None,
           seconds: float | None = None, ended: Callable[[], None] | None = None) -> Recording:
    """Run ``target`` once under memprof's recorders (and torch.profiler, with ``profile_to``),
    stopping it after ``steps`` optimizer steps or ``seconds`` when given; ``ended`` is
    called as soon as the script has ended, before memprof's own work on the trace."""
    if use_cuda:
        return record_cuda(target, max_entries, profile_to, steps, seconds, ended)
    recorder = CpuRecorder(StorageTracker(max_entries))
    with recorder:
        outcome, seconds = run_profiled(target, profile_to, steps, seconds, ended)
    trim()  # what the script freed, before memprof's own work on the trace
    with frozen():
        snapshot, tally = predict_cuda_layout(recorder.snapshot(), settings)
    return Recording(snapshot, outcome, "cpu (CUDA memory predicted)", True, seconds,
                     tally=tally)


def record_cuda(target: Target, max_entries: int, profile_to: Path | None, steps: int | None,
                seconds: float | None, ended: Callable[[], None] | None = None) -> Recording:
    """The GPU path: the caching allocator's history is the trace, labelled by role hooks
    alone (no dispatch mode: the program runs as it would without memprof)."""
    history = cuda.CudaHistory(max_entries)
    labeller = HookLabeller()
    history.start()
    with labeller:
        outcome, seconds = run_profiled(target, profile_to, steps, seconds, ended)
        gc.collect()  # what the script left in reference cycles is freed while recording,
        # as the CPU recorder does: what the trace leaves alive is what is still held
    device = torch_device()
    snapshots = [s for s in (history.stop(), history.oom_snapshot) if s is not None]
    workspaces = cuda.blas_workspaces(device)
    for snapshot in snapshots:
        snapshot["memprof"] = {**labeller.labels(snapshot["device_traces"][device],
                                                 workspaces=workspaces), "device": device}
    facts = cuda.device_facts()
    return Recording(snapshots[0], outcome, f"cuda ({facts['name']})", False, seconds, facts,
                     history.oom_snapshot)


def record_light(target: Target, max_entries: int, settings: AllocatorSettings,
                 steps: int | None = None, seconds: float | None = None,
                 ended: Callable[[], None] | None = None) -> Recording:
    """The light CPU path: the CPU allocator's own events (``alloc_events.py``) labelled by
    the role hooks, as on a GPU; no dispatch mode, so no Python stacks per allocation and
    no operator facts, and the script runs at nearly its own speed."""
    events = AllocatorEvents(max_entries)
    labeller = HookLabeller(time.time_ns)
    events.start()
    try:
        with labeller:
            outcome, seconds = run_profiled(target, None, steps, seconds, ended)
            gc.collect()  # as record_cuda: what the trace leaves alive is what is still held
        with frozen():  # the script's objects: out of the collector's way from here on
            trace, times = events.stop()
            snapshot = {"segments": [], "device_traces": [trace], "allocator_settings": None,
                        "external_annotations": [],
                        "memprof": {**labeller.labels(trace, times), "recorder": "cpu-light",
                                    "dropped_events": events.dropped,
                                    "run_peak": requested_peak(events.max_live_bytes)}}
            del times
            trim()
            snapshot, tally = predict_cuda_layout(snapshot, settings)
    except BaseException:
        if events.recording:  # the script never ended (a second Ctrl-C): drop the events
            with contextlib.suppress(MemprofError):
                events.stop()
        raise
    return Recording(snapshot, outcome, "cpu, light (CUDA memory predicted)", True, seconds,
                     tally=tally)


def run_profiled(target: Target, profile_to: Path | None, steps: int | None,
                 seconds: float | None, ended: Callable[[], None] | None = None
                 ) -> tuple[Outcome, float]:
    """Run ``target`` (under torch.profiler with ``profile_to``; stopped after ``steps`` or
    ``seconds``; then call ``ended``): how it ended and how long it took."""
    profiler = StepWindowProfiler(profile_to) if profile_to is not None else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.start()
    try:
        with stops(steps, seconds), applied(requested()):
            outcome = run(target)
        took = time.perf_counter() - start
        if ended is not None:
            ended()
    finally:
        if profiler is not None:
            profiler.stop()
    return outcome, took


def predict_cuda_layout(snapshot: dict[str, Any], settings: AllocatorSettings,
                        layout: Layout | None = None) -> tuple[dict[str, Any], Tally | None]:
    """Place a GPU-less recording in CUDA memory as the caching allocator would
    (or as ``layout``, placed while it ran, already has); the recording's trace is
    consumed, so ``snapshot`` is the prediction's to keep. Its ``memprof`` key gains
    ``segment_pools``, ``[address, pool id]`` of every private-pool segment placed. With
    the prediction, the placement's ``Tally`` when it kept one (``lay_out``'s does)."""
    layout = layout or lay_out(snapshot["device_traces"][0], settings, consume=True)
    meta = snapshot["memprof"]
    at = layout.position
    for key in ("labels", "modules", "tags"):  # [event index, value] pairs, renumbered in place
        for pair in meta.get(key, []):
            pair[0] = at[pair[0]]
    return {
        **snapshot,
        "segments": layout.segments,
        "device_traces": [layout.trace],
        "allocator_settings": settings_dict(settings),
        "memprof": {
            **meta,
            # steps are exclusive ends: the event after the step's last one
            "steps": [at[end - 1] + 1 if end else 0 for end in meta["steps"]],
            "segment_pools": [[addr, list(pool)] for addr, pool in sorted(layout.pools.items())],
        },
    }, layout.tally


def settings_dict(settings: AllocatorSettings) -> dict[str, Any]:
    """``allocator_settings`` as PyTorch writes it in a snapshot."""
    divisions = settings.roundup_power2_divisions or (0,) * 16
    return {
        "PYTORCH_CUDA_ALLOC_CONF": settings.conf,
        "max_split_size": settings.max_split_size or -1,
        "garbage_collection_threshold": settings.garbage_collection_threshold,
        "expandable_segments": settings.expandable_segments,
        "roundup_power2_divisions": {str(1 << i): d for i, d in enumerate(divisions)},
    }


def torch_device() -> int:
    import torch

    return torch.cuda.current_device()


def rank() -> tuple[int, int]:
    """This process's (rank, world size) under torchrun; (0, 1) otherwise."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
