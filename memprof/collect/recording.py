"""What every recorder returns, and what they share: how the script is run, and the
prediction of a GPU-less trace's CUDA layout.

Each recorder exposes ``record(target, options) -> Recording``: the CPU recorder
(``cpu/recorder.py``), the light CPU recorder (``cpu/light.py``), the CUDA allocator's
history (``cuda/recorder.py``) and the virtual GPU (``virtual/session.py``);
``session.py`` picks one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memprof.analysis.layout import Layout, lay_out
from memprof.analysis.tally import Tally
from memprof.collect.launch.apply import applied, requested
from memprof.collect.launch.endings import stops
from memprof.collect.launch.profiler import StepWindowProfiler
from memprof.collect.launch.script import Outcome, Target, run
from memprof.trace.model import AllocatorSettings

SNAPSHOT_VERSION = 1  # of the ``memprof`` entry a recording adds to its snapshot


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
    children: list[Path] = field(default_factory=list)  # run folders of followed children
    # the exit code of each followed child that ended, by run folder
    children_exits: dict[Path, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RunOptions:
    """How a recorder runs the script: the allocator settings a prediction assumes, the
    trace's ring buffer (``max_entries`` events), when to stop it (after ``steps``
    optimizer steps or ``seconds``), torch.profiler's output (``profile_to``),
    ``ended``, called as soon as the script has ended, before memprof's work on the trace,
    the run ``folder``, where child processes the virtual GPU follows write theirs, and the
    virtual node's ``cards`` where no launcher set them (``LOCAL_WORLD_SIZE``)."""

    settings: AllocatorSettings
    max_entries: int
    steps: int | None = None
    seconds: float | None = None
    profile_to: Path | None = None
    ended: Callable[[], None] | None = None
    folder: Path | None = None
    cards: int = 1


Recorder = Callable[[Target, RunOptions], Recording]


def run_profiled(target: Target, options: RunOptions) -> tuple[Outcome, float]:
    """Run ``target`` as ``options`` say (under torch.profiler, stopped after steps or
    seconds, then calling ``ended``): how it ended and how long it took."""
    profile_to = options.profile_to
    profiler = StepWindowProfiler(profile_to) if profile_to is not None else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.start()
    try:
        with stops(options.steps, options.seconds), applied(requested()):
            outcome = run(target)
        took = time.perf_counter() - start
        if options.ended is not None:
            options.ended()
    finally:
        if profiler is not None:
            profiler.stop()
    return outcome, took


def predict_cuda_layout(snapshot: dict[str, Any], settings: AllocatorSettings,
                        layout: Layout | None = None) -> tuple[dict[str, Any], Tally | None]:
    """Place a GPU-less recording in CUDA memory as the caching allocator would
    (or as ``layout``, placed while it ran, already has); the recording's trace is
    consumed, so ``snapshot`` is the prediction's to keep, its trace at the layout's device
    index (a rank's ``cuda:LOCAL_RANK``). Its ``memprof`` key gains ``device`` and
    ``segment_pools``, ``[address, pool id]`` of every private-pool segment placed. With
    the prediction, the placement's ``Tally`` when it kept one (``lay_out``'s does)."""
    layout = layout or lay_out(snapshot["device_traces"][0], settings, consume=True)
    meta = snapshot["memprof"]
    at = layout.position
    for key in ("labels", "modules", "tags"):  # [event index, value] pairs, renumbered in place
        for pair in meta.get(key, []):
            pair[0] = at[pair[0]]
    device = layout.device
    return {
        **snapshot,
        "segments": layout.segments,
        "device_traces": [[] for _ in range(device)] + [layout.trace],  # by device index
        "allocator_settings": settings_dict(settings),
        "memprof": {
            **meta,
            "device": device,
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


def requested_peak(nbytes: int) -> dict[str, int | None]:
    """A recording's ``run_peak`` entry: ``nbytes`` requested at once (a CPU recording
    knows no allocator's figures)."""
    return {"requested_bytes": nbytes, "allocated_bytes": None, "reserved_bytes": None}
