"""The light CPU recorder (``memprof run --device cpu --light``): the CPU allocator's own
events (``alloc_events.py``) labelled by the role hooks, as on a GPU.

No dispatch mode, so no Python stacks per allocation and no operator facts, and the
script runs at nearly its own speed.
"""

from __future__ import annotations

import contextlib
import gc
import time

from memprof.collect.cpu.alloc_events import AllocatorEvents
from memprof.collect.hooks.labeller import HookLabeller
from memprof.collect.launch.script import Target
from memprof.collect.recording import (
    Recording,
    RunOptions,
    predict_cuda_layout,
    requested_peak,
    run_profiled,
)
from memprof.errors import MemprofError
from memprof.heap import frozen, trim


def record(target: Target, options: RunOptions) -> Recording:
    """Run ``target`` under the light recorder: its host allocations, laid out in CUDA
    memory as the caching allocator would place them."""
    events = AllocatorEvents(options.max_entries)
    labeller = HookLabeller(time.time_ns)
    events.start()
    try:
        with labeller:
            outcome, seconds = run_profiled(target, options)
            gc.collect()  # as on a GPU: what the trace leaves alive is what is still held
        with frozen():  # the script's objects: out of the collector's way from here on
            trace, times = events.stop()
            snapshot = {"segments": [], "device_traces": [trace], "allocator_settings": None,
                        "external_annotations": [],
                        "memprof": {**labeller.labels(trace, times), "recorder": "cpu-light",
                                    "dropped_events": events.dropped,
                                    "run_peak": requested_peak(events.max_live_bytes)}}
            del times
            trim()
            snapshot, tally = predict_cuda_layout(snapshot, options.settings)
    except BaseException:
        if events.recording:  # the script never ended (a second Ctrl-C): drop the events
            with contextlib.suppress(MemprofError):
                events.stop()
        raise
    return Recording(snapshot, outcome, "cpu, light (CUDA memory predicted)", True, seconds,
                     tally=tally)
