"""The CUDA path's categories and modules: role hooks that note storage addresses and the
moments modules start and end, no dispatch mode.

    labeller = HookLabeller(clock)
    with labeller:
        train()
    meta = labeller.labels(trace)  # the snapshot's ``memprof`` entry for ``trace``

Each sighting is cheap (a data pointer, a size, a clock reading), and so is each module
mark (a clock reading and a path); the trace is labelled afterwards by
``trace_labels.label_trace`` and ``trace_modules.module_trace``. The program runs as it
would without memprof: no operator goes through Python, so ``torch.compile`` and the
kernels are unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memprof.collect.hooks.module_stack import ModuleStack
from memprof.collect.hooks.roles import RoleHooks
from memprof.collect.hooks.trace_labels import (
    READ,
    Allocs,
    Event,
    Sighting,
    event_times,
    label_trace,
    step_ends,
    tag_trace,
)
from memprof.collect.hooks.trace_modules import Mark, Owner, module_trace
from memprof.collect.hooks.warning_filters import COMPILE_WITH_GLOBAL_HOOKS, ignore, restore
from memprof.collect.hooks.weak_ids import WeakIdMap
from memprof.collect.recording import SNAPSHOT_VERSION
from memprof.collect.tensors import storages_behind
from memprof.trace.model import ACTIVATIONS, EVAL_ACTIVATIONS, GRADIENTS, WORKSPACE

_Noted = WeakIdMap[tuple[object, str]]


def epoch_us() -> int:
    """The CUDA allocator's trace clock: microseconds since the epoch (CLOCK_REALTIME)."""
    return time.time_ns() // 1000


class HookLabeller(RoleHooks):
    """Role hooks that record each storage seen and when each module ran, for labelling
    an allocator trace."""

    def __init__(self, clock: Callable[[], int] = epoch_us) -> None:
        super().__init__()
        self.sightings: list[Sighting] = []
        self.tags: list[Sighting] = []  # saved by an eval-mode forward, or READ in backward
        self._eval_saved = False
        self.marks: list[Mark] = []
        self.owners: list[Owner] = []
        self._clock = clock
        self._stack = ModuleStack()
        self._owner: str | None = None  # the module whose pre-hook marks its own tensors
        self._in_backward = False  # an end-of-backward callback is queued
        self._filter: object = None
        # tensor -> (data pointer, category) last noted: a parameter
        # seen at every forward is noted once while its storage stays (activations are new
        # tensors every time); and likewise for its module
        self._noted: _Noted = WeakIdMap()
        self._owned: _Noted = WeakIdMap()

    def __enter__(self) -> HookLabeller:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def install(self) -> None:
        """Register the role hooks."""
        super().install()
        self._filter = ignore(COMPILE_WITH_GLOBAL_HOOKS)  # the script's, not memprof's

    def remove(self) -> None:
        """Remove every hook (the role hooks mark what the script holds first)."""
        try:
            super().remove()
        finally:
            restore(self._filter)

    def labels(self, trace: Sequence[Event], times: Sequence[int] | None = None,
               workspaces: tuple[int, int] = (0, 0)) -> dict[str, Any]:
        """The snapshot's ``memprof`` entry for ``trace``, whose events happened at
        ``times`` on this labeller's clock (their ``time_us`` by default); ``workspaces``:
        the BLAS workspaces' sizes (``label_trace``)."""
        times = event_times(trace) if times is None else times
        allocs = Allocs(trace, times)
        labels = label_trace(trace, self.sightings, times, workspaces, allocs)
        library = {i for i, category in labels if category == WORKSPACE}  # not the module's
        return {
            "version": SNAPSHOT_VERSION,
            "recorder": "cuda",
            "complete": False,
            "labels": labels,
            "tags": tag_trace(trace, self.tags, labels, times, allocs),
            "steps": step_ends(times, self.steps),
            "model": self.model,
            "modules": [m for m in module_trace(trace, self.marks, self.owners, times, allocs)
                        if m[0] not in library],
            "model_files": sorted(self._stack.files),
        }

    def _position(self) -> int:
        return self._clock()

    def _on_forward(self, module: torch.nn.Module, args: object) -> None:
        if torch.compiler.is_compiling():  # traced into a compiled graph: leave it as it is
            return
        self._owner = path = self._stack.enter(module)
        try:
            self._see(module, args)
        finally:
            self._owner = None
        self.marks.append((self._clock(), path, True))  # after the hook's own work

    def _on_exit(self, module: torch.nn.Module, args: object, output: object) -> None:
        if torch.compiler.is_compiling():
            return
        at = self._clock()
        self._exit(module)
        self._stack.exit(module)
        self.marks.append((at, self._stack.current(), False))

    def _end_step(self) -> None:
        super()._end_step()
        self._stack.forget()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # attention scores are not tagged: which operator made a tensor takes a dispatch mode
        if self._forward.tag(t, False) == EVAL_ACTIVATIONS:
            self._eval_saved = True
            self._sight(self.tags, t, EVAL_ACTIVATIONS)
        return super()._pack(t)

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        self._blocks.stop()
        if self._eval_saved:  # a backward reads it: that eval forward was backpropagated
            self._sight(self.tags, t, READ)
        # a backward node unpacks what it saved before it computes: its module starts
        if not self._in_backward:
            if torch._C._current_autograd_node() is None:  # read outside a backward
                return t
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        path = self._stack.current()
        if not self.marks or self.marks[-1][1] != path:
            self.marks.append((self._clock(), path, True))
        return t

    def _backward_done(self) -> None:
        self._in_backward = False
        self.marks.append((self._clock(), self._stack.current(), False))

    def _mark(self, t: torch.Tensor, category: str) -> None:
        owner = self._owner if category != GRADIENTS else None
        if owner is not None and not self._noted_before(self._owned, t, owner):
            at = self._clock()
            self.owners += [(at, st.data_ptr(), st.nbytes(), owner)
                            for st in storages_behind(t)]
        if category == ACTIVATIONS or not self._noted_before(self._noted, t, category):
            self._sight(self.sightings, t, category)

    def _sight(self, into: list[Sighting], t: torch.Tensor, category: str) -> None:
        at = self._clock()
        for st in storages_behind(t):
            nbytes = st.nbytes()
            if nbytes:
                into.append((at, st.data_ptr(), nbytes, category))

    @staticmethod
    def _noted_before(noted: _Noted, t: torch.Tensor, what: str) -> bool:
        """Whether ``noted`` has ``t`` as ``what`` at its present address (and note it)."""
        try:
            where: object = t.data_ptr()
        except RuntimeError:  # a wrapper subclass: no storage of its own
            where = tuple(st.data_ptr() for st in storages_behind(t))
        if noted.get(t) == (where, what):
            return True
        noted[t] = (where, what)
        return False
