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

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

from memprof.collect.hook_labels import (
    Blocks,
    Event,
    action_of,
    blocks_by_address,
    event_times,
    live_alloc,
)

# (at, path, claims): from ``at`` on, ``path`` runs; ``claims``: an alloc at the same moment
# is after it. A plain tuple, as ``Sighting``: a run makes two at every module call.
Mark = tuple[int, str | None, bool]
# (at, addr, nbytes, path): the storage at ``addr`` of ``nbytes`` is a parameter or buffer
# of ``path``
Owner = tuple[int, int, int, str]


def module_trace(trace: Sequence[Event], marks: Sequence[Mark], owners: Sequence[Owner],
                 times: Sequence[int] | None = None,
                 blocks: dict[int, Blocks] | None = None) -> list[list[Any]]:
    """``[event_index, path]`` for every alloc event of ``trace`` made inside a module or
    holding a module's own parameter or buffer; ``times``: the clock of the marks
    (``event_times`` by default); ``blocks``: the trace's ``blocks_by_address``, if made."""
    times = event_times(trace) if times is None else times
    marks = sorted(marks, key=itemgetter(0))  # threads append in their own order
    starts = [m[0] for m in marks]
    paths: dict[int, str] = {}
    for i, e in enumerate(trace):
        if action_of(e) == "alloc" and (path := _running(marks, starts, times[i])) is not None:
            paths[i] = path
    blocks = blocks_by_address(trace, times) if blocks is None else blocks
    for at, addr, nbytes, path in owners:
        here = blocks.get(addr)
        index = live_alloc(here, at, nbytes) if here is not None else None
        if index is not None:
            paths.setdefault(index, path)
    return [[i, paths[i]] for i in sorted(paths)]


def _running(marks: Sequence[Mark], starts: Sequence[int], at: int) -> str | None:
    """The path running at ``at``: of the last mark at that moment that claims it, else
    of the last mark before it."""
    first = bisect_left(starts, at)
    for k in range(bisect_right(starts, at, lo=first) - 1, first - 1, -1):
        if marks[k][2]:  # claims
            return marks[k][1]
    return marks[first - 1][1] if first else None
