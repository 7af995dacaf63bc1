"""The CPU recorder: every tensor storage alloc/free of a run, as a labelled snapshot.

    recording = record(target, options)  # memprof run --device cpu

or, around any code:

    with CpuRecorder() as recorder:
        runpy.run_path("train.py", run_name="__main__")
    snapshot = recorder.snapshot()  # as torch.cuda.memory._snapshot() returns it

The snapshot has one device trace and no segments (there is no caching allocator on
this path). Its `memprof` entry holds `labels`, `[alloc_event_index, category]` for
every alloc event (categories in `memprof.trace.model.CATEGORIES`), `tags`,
`[alloc_event_index, tag]` for the activations a savings model needs to know (`TAGS`),
and `steps`:
for each optimizer step, the number of trace events recorded when it ended, so that
`events[steps[k - 1]:steps[k]]` is step k's slice; `modules`, `[alloc_event_index, path]`
for the allocations made while a module ran (`module_scope.py`), and `model_files`, the
files that define those modules' forward.
"""

from __future__ import annotations

import gc
from typing import Any

from memprof.collect.cpu.labels import LabelHooks
from memprof.collect.cpu.module_scope import ModuleScope
from memprof.collect.cpu.storages import StorageTracker
from memprof.collect.cpu.worker_batches import WorkerBatches
from memprof.collect.launch.eager_compile import EagerCompile
from memprof.collect.launch.script import Target
from memprof.collect.launch.threads import ThreadModes, inherited
from memprof.collect.recording import (
    SNAPSHOT_VERSION,
    Recording,
    RunOptions,
    predict_cuda_layout,
    run_profiled,
)
from memprof.heap import frozen, trim
from memprof.trace.events import ACTION


class CpuRecorder:
    """Record tensor storage allocations and frees, with Python stacks and categories.

    Records the thread that starts it; single use: start once, stop once.
    """

    def __init__(self, tracker: StorageTracker | None = None) -> None:
        self._tracker = tracker or StorageTracker()
        self._hooks = LabelHooks(self._tracker)
        self._scope = ModuleScope(self._tracker)
        self._compile = EagerCompile("CPU recorder")
        self._workers = WorkerBatches(self._tracker)
        self._threads = ThreadModes()
        inherited(self._tracker)
        self._labels: list[list[Any]] | None = None
        self._tags: list[list[Any]] = []
        self._started = False
        self._taken = False

    def start(self) -> None:
        """Install the hooks and begin recording."""
        if self._started:
            raise RuntimeError("a CpuRecorder records once; create a new one")
        self._started = True
        self._hooks.install()
        self._scope.install()
        self._compile.install()
        self._workers.install()
        self._threads.__enter__()
        try:
            self._tracker.__enter__()
        except BaseException:
            self._threads.__exit__(None, None, None)
            self._workers.remove()
            self._compile.remove()
            self._scope.remove()
            self._hooks.remove()
            raise

    def stop(self) -> None:
        """Stop recording, remove the hooks and resolve the labels."""
        if not self._started or self._labels is not None:
            raise RuntimeError("stop() needs a recording CpuRecorder")
        # What the script left in reference cycles is freed now, while recording, not
        # whenever the collector next happens to run: survivors are what is still held.
        gc.collect()
        try:
            self._threads.__exit__(None, None, None)
            self._workers.remove()
            self._compile.remove()
            self._scope.remove()
            self._hooks.remove()
        finally:
            self._tracker.__exit__(None, None, None)
        self._labels = self._hooks.resolve(self._tracker.events, self._tracker.survivors)
        self._tags = self._hooks.resolve_tags(self._tracker.events, self._labels)

    def __enter__(self) -> CpuRecorder:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def snapshot(self) -> dict[str, Any]:
        """Return the recording in PyTorch's snapshot format, its trace events as tuples
        (``memprof.trace.events``; ``dump_snapshot`` writes them as dicts). After `stop`;
        once: the trace moves into it."""
        if self._labels is None or self._taken:
            raise RuntimeError("snapshot() needs a stopped CpuRecorder, once")
        self._taken = True
        modules = self._modules()  # before the trace is taken: keyed by the events' identity
        for table in self._tracker.per_event:  # and of no use after: a long run's are large
            table.clear()
        return {
            "segments": [],
            "device_traces": [self._tracker.take_trace()],
            "allocator_settings": None,
            "external_annotations": [],
            "memprof": {
                "version": SNAPSHOT_VERSION,
                "recorder": "cpu",
                "complete": True,
                "labels": self._labels,
                "tags": self._tags,
                "steps": list(self._tracker.steps),
                "dropped_events": self._tracker.dropped,
                "run_peak": self._tracker.run_peak(),
                "model": self._hooks.model,
                "modules": modules,
                "model_files": sorted(self._scope.files),
            },
        }

    def _modules(self) -> list[list[Any]]:
        paths = self._tracker.modules
        return [[i, paths[id(e)]] for i, e in enumerate(self._tracker.events)
                if e[ACTION] == "alloc" and id(e) in paths]


def record(target: Target, options: RunOptions) -> Recording:
    """Run ``target`` under the CPU recorder: its host tensors, laid out in CUDA memory as
    the caching allocator would place them."""
    recorder = CpuRecorder(StorageTracker(options.max_entries))
    with recorder:
        outcome, seconds = run_profiled(target, options)
    trim()  # what the script freed, before memprof's own work on the trace
    with frozen():
        snapshot, tally = predict_cuda_layout(recorder.snapshot(), options.settings)
    return Recording(snapshot, outcome, "cpu (CUDA memory predicted)", True, seconds,
                     tally=tally)
