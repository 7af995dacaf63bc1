"""The CUDA path's categories: role hooks that note storage addresses, no dispatch mode.

    labeller = HookLabeller(clock)
    with labeller:
        train()
    meta = labeller.labels(trace)  # the snapshot's ``memprof`` entry for ``trace``

Each sighting is cheap (a data pointer, a size, a clock reading); the trace is labelled
afterwards by ``hook_labels.label_trace``. The program runs as it would without memprof:
no operator goes through Python, so ``torch.compile`` and the kernels are unchanged.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memprof.collect.cpu_recorder import SNAPSHOT_VERSION
from memprof.collect.hook_labels import Event, Sighting, event_times, label_trace, step_ends
from memprof.collect.roles import RoleHooks
from memprof.collect.storages import storages_behind
from memprof.trace.model import ACTIVATIONS


def epoch_us() -> int:
    """The CUDA allocator's trace clock: microseconds since the epoch (CLOCK_REALTIME)."""
    return time.time_ns() // 1000


class HookLabeller(RoleHooks):
    """Role hooks that record each storage seen, for labelling an allocator trace."""

    def __init__(self, clock: Callable[[], int] = epoch_us) -> None:
        super().__init__()
        self.sightings: list[Sighting] = []
        self._clock = clock
        # id(tensor) -> (weak reference, (data pointer, category) last noted): a parameter
        # seen at every forward is noted once while its storage stays (activations are new
        # tensors every time)
        self._noted: dict[int, tuple[weakref.ref, tuple[object, str]]] = {}

    def __enter__(self) -> HookLabeller:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def labels(self, trace: Sequence[Event], times: Sequence[int] | None = None
               ) -> dict[str, Any]:
        """The snapshot's ``memprof`` entry for ``trace``, whose events happened at
        ``times`` on this labeller's clock (their ``time_us`` by default)."""
        times = event_times(trace) if times is None else times
        return {
            "version": SNAPSHOT_VERSION,
            "recorder": "cuda",
            "complete": False,
            "labels": label_trace(trace, self.sightings, times),
            "tags": [],
            "steps": step_ends(times, self.steps),
            "model": self.model,
            "modules": [],
            "model_files": [],
        }

    def _position(self) -> int:
        return self._clock()

    def _mark(self, t: torch.Tensor, category: str) -> None:
        if category != ACTIVATIONS and self._noted_before(t, category):
            return
        at = self._clock()
        for st in storages_behind(t):
            nbytes = st.nbytes()
            if nbytes:
                self.sightings.append(Sighting(at, st.data_ptr(), nbytes, category))

    def _noted_before(self, t: torch.Tensor, category: str) -> bool:
        """Whether ``t`` was noted in ``category`` at its present address (and note it)."""
        try:
            where: object = t.data_ptr()
        except RuntimeError:  # a wrapper subclass: no storage of its own
            where = tuple(st.data_ptr() for st in storages_behind(t))
        # a dict by id with a weak reference to check: torch's WeakIdKeyDictionary costs
        # a tenth of a training step of small operators here
        key = id(t)
        noted = self._noted.get(key)
        if noted is not None and noted[0]() is t:
            if noted[1] == (where, category):
                return True
            self._noted[key] = (noted[0], (where, category))
            return False
        self._noted[key] = (weakref.ref(t, functools.partial(self._forget, key)),
                            (where, category))
        return False

    def _forget(self, key: int, ref: weakref.ref) -> None:
        noted = self._noted.get(key)
        if noted is not None and noted[0] is ref:
            del self._noted[key]
