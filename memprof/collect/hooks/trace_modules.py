"""Attribute an allocator trace's allocs to nn.Modules from the times the modules ran.

The labeller (``labeller.py``) notes *marks*: at a moment on the trace's clock, the module
running changed to ``path`` (None: outside every module). A forward's pre-hook marks its
module, its post-hook the module around it; in backward, a node that unpacks a saved
tensor marks the module whose forward made it, and the end of the backward marks None.
An alloc belongs to the module of the last mark before it. On a microsecond clock a mark
and an alloc can read the same time: the alloc then goes to the innermost candidate (a
mark that starts something claims it; one that ends something does not).

*Owners* are a module's own parameters and buffers, seen when it first ran with them;
they go to the alloc live at that address then, unless that alloc was made inside a
module.

    modules = module_trace(trace, marks, owners)  # [[alloc_event_index, path], ...]

Pure: no torch; the CPU recorder's traces test it against the exact attribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import Any

import numpy as np

from memprof.collect.hooks.trace_labels import Allocs, Event, event_times

# (at, path, claims): from ``at`` on, ``path`` runs; ``claims``: an alloc at the same moment
# is after it. A plain tuple, as ``Sighting``: a run makes two at every module call.
Mark = tuple[int, str | None, bool]
# (at, addr, nbytes, path): the storage at ``addr`` of ``nbytes`` is a parameter or buffer
# of ``path``
Owner = tuple[int, int, int, str]


def module_trace(trace: Sequence[Event], marks: Sequence[Mark], owners: Sequence[Owner],
                 times: Sequence[int] | None = None,
                 allocs: Allocs | None = None) -> list[list[Any]]:
    """``[event_index, path]`` for every alloc event of ``trace`` made inside a module or
    holding a module's own parameter or buffer; ``times``: the clock of the marks
    (``event_times`` by default); ``allocs``: the trace's ``Allocs``, if made."""
    if allocs is None:
        allocs = Allocs(trace, event_times(trace) if times is None else times)
    marks = sorted(marks, key=itemgetter(0))  # threads append in their own order
    starts = np.fromiter(map(itemgetter(0), marks), np.int64, len(marks))
    # the path running at each alloc: of the last mark at that moment that claims it,
    # else of the last mark before it
    first = np.searchsorted(starts, allocs.times, "left")
    running = first - 1
    last = np.searchsorted(starts, allocs.times, "right")
    for j in np.flatnonzero(last > first).tolist():  # a mark at the alloc's very moment
        claims = [k for k in range(int(last[j]) - 1, int(first[j]) - 1, -1) if marks[k][2]]
        if claims:
            running[j] = claims[0]
    path_of = [path for _, path, _ in marks]
    paths = {i: path_of[k] for i, k in zip(allocs.events.tolist(), running.tolist(), strict=True)
             if k >= 0 and path_of[k] is not None}
    for at, addr, nbytes, path in owners:
        index = allocs.live(addr, at, nbytes)
        if index is not None:
            paths.setdefault(index, path)
    return [[i, paths[i]] for i in sorted(paths)]
