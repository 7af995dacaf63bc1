"""Label an allocator trace from what the role hooks saw: storage addresses at moments.

On a GPU there is no dispatch mode: the allocator's own history is the trace, and the
role hooks (``labeller.py``) only note *sightings*: at a moment (a clock reading or a
sequence position), the storage at ``addr`` of ``nbytes`` had a role. An address is
reused, so a sighting belongs to the alloc at that address that is live at that moment:
the last one made at or before it (with a block of at least ``nbytes``), or, when that
one was already freed (clocks that disagree by a microsecond), the next one.

    labels = label_trace(trace, sightings)  # [[alloc_event_index, category], ...]
    steps = step_ends(event_times(trace), labeller.steps)

Pure: no torch, no GPU; the CPU recorder's traces test it against the exact labels.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import itemgetter
from typing import Any

import numpy as np

from memprof.analysis.categories import communication_overrides
from memprof.trace.events import ACTION, ADDR, SIZE, STACK, TraceEvent, is_recorded
from memprof.trace.model import (
    ACTIVATIONS,
    CATEGORIES,
    COMMUNICATION,
    EVAL_ACTIVATIONS,
    OTHER,
    TEMPORARIES,
    WORKSPACE,
)

Event = dict[str, Any]
READ = "read"  # a tag sighting: a backward unpacked the storage
_RANK = {category: rank for rank, category in enumerate(CATEGORIES)}
_OTHER, _ALLOC, _FREE = 0, 1, 2  # an event's kind, as Allocs reads it
_KINDS = {"alloc": _ALLOC, "free_requested": _FREE, "free_completed": _FREE}
_NEVER = float("inf")  # the end of a block the trace never frees


# A storage seen in a role: (when, where, how large, which category). A plain tuple, made in
# every saved-tensor hook: the garbage collector stops tracking a tuple of ints and strings,
# never a named tuple, whose millions would make each full collection longer.
Sighting = tuple[int, int, int, str]


class Allocs:
    """A trace's allocs: in trace order (``events``, ``times``, whether each is ``freed``),
    and by address, for ``live``."""

    def __init__(self, trace: Sequence[Event], times: Sequence[int]) -> None:
        kind, addr, size = _columns(trace)
        clock = np.asarray(times, np.int64)
        moved = np.flatnonzero(kind != _OTHER)
        order = moved[np.argsort(addr[moved], kind="stable")]  # by address, then trace order
        at_addr, kinds = addr[order], kind[order]
        first = np.flatnonzero(kinds == _ALLOC)
        # a block's life ends at the free right after it at its address (a free_completed
        # after a free_requested, or a free with no alloc before it, ends nothing)
        last = len(order) - 1
        ended = first[(first < last) & (kinds[np.minimum(first + 1, last)] == _FREE)
                      & (at_addr[np.minimum(first + 1, last)] == at_addr[first])]
        ends = np.full(len(first), _NEVER)
        ends[np.searchsorted(first, ended)] = clock[order[ended + 1]]
        by_addr = order[first]
        self._events: list[int] = by_addr.tolist()
        self._times: list[int] = clock[by_addr].tolist()
        self._sizes: list[int] = size[by_addr].tolist()
        self._ends: list[float] = ends.tolist()
        addresses, starts, counts = np.unique(at_addr[first], return_index=True,
                                              return_counts=True)
        self._range = dict(zip(addresses.tolist(),
                               zip(starts.tolist(), (starts + counts).tolist(), strict=True),
                               strict=True))
        self.events = np.flatnonzero(kind == _ALLOC)  # in trace order
        self.times = clock[self.events]
        freed = np.zeros(len(trace), bool)
        freed[by_addr[ends != _NEVER]] = True
        self.freed = freed[self.events]

    def live(self, addr: int, at: int, nbytes: int) -> int | None:
        """The alloc event at ``addr`` live at ``at`` that can hold a storage of ``nbytes``:
        the last one made at or before it, or when that one was already freed (clocks that
        disagree by a microsecond), the next one."""
        span = self._range.get(addr)
        if span is None:
            return None
        lo, hi = span
        k = bisect_right(self._times, at, lo, hi) - 1
        if k >= lo and self._ends[k] < at:
            k += 1
        k = max(k, lo)
        if k < hi and self._sizes[k] >= nbytes:
            return self._events[k]
        return None


def _columns(trace: Sequence[Event]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each event's kind (``_ALLOC``, ``_FREE``, ``_OTHER``), address and size."""
    n = len(trace)
    if n and is_recorded(trace[0]):  # a recorder's tuples: read a column at a time
        actions, addr, size = (map(itemgetter(k), trace) for k in (ACTION, ADDR, SIZE))
    else:
        actions, addr, size = zip(*map(fields, trace), strict=True) if n else ((), (), ())
    return (np.fromiter(map(_KINDS.get, actions, repeat(_OTHER)), np.int8, n),
            np.fromiter(addr, np.uint64, n), np.fromiter(size, np.int64, n))


def fields(event: Event | TraceEvent) -> tuple[str, int, int]:
    """An event's action, address and size: a snapshot's dict or a recorder's tuple."""
    if type(event) is tuple:
        return event[ACTION], event[ADDR], event[SIZE]
    return event["action"], event.get("addr", 0), event.get("size", 0)  # "oom" has no addr


def event_times(trace: Sequence[Event]) -> list[int]:
    """The allocator's clock: each event's ``time_us``."""
    return [e.get("time_us", 0) for e in trace]


def sequence_times(trace: Sequence[Event]) -> list[int]:
    """A sequence clock (``sequence_clock``): event i happens at 2i + 1."""
    return list(range(1, 2 * len(trace), 2))


def sequence_clock(events: Sequence[Event]) -> Callable[[], int]:
    """A clock that reads 2n while ``events`` holds n events: after events 0..n-1 and
    before event n (``sequence_times``); never the same moment as an event, as a
    microsecond clock would often be."""
    return lambda: 2 * len(events)


def label_trace(trace: Sequence[Event], sightings: Sequence[Sighting],
                times: Sequence[int] | None = None, workspaces: tuple[int, int] = (0, 0),
                allocs: Allocs | None = None) -> list[list[Any]]:
    """``[event_index, category]`` for every alloc event of ``trace``: the first in
    ``CATEGORIES`` order among its sightings; unseen, ``temporaries`` if the trace frees
    it, ``workspace`` if it is a BLAS library's (``workspaces``: the cuBLAS and the
    separate cuBLASLt workspace's bytes, ``blas_workspace_sizes``) and ``other`` if not.
    ``times``: the clock the sightings used (``event_times`` by default); ``allocs``: the
    trace's ``Allocs``, if made. What a collective's code made is ``communication`` unless
    sighted as model state (``communication_call``)."""
    if allocs is None:
        allocs = Allocs(trace, event_times(trace) if times is None else times)
    best: dict[int, str] = {}
    for at, addr, nbytes, category in sightings:
        index = allocs.live(addr, at, nbytes)
        if index is not None:
            current = best.get(index)
            if current is None or _RANK[category] < _RANK[current]:
                best[index] = category
    unseen = [TEMPORARIES if freed else OTHER for freed in allocs.freed.tolist()]
    labels = [[i, best.get(i, category)]
              for i, category in zip(allocs.events.tolist(), unseen, strict=True)]
    if any(workspaces):
        _find_workspaces(trace, labels, workspaces)
    for label in labels:
        if label[1] in _given_up(trace[label[0]]):
            label[1] = COMMUNICATION
    return labels


def _given_up(alloc: Event | TraceEvent) -> tuple[str, ...]:
    """What ``alloc`` gives up to communication, from its stack (``communication_call``)."""
    frames = ((f, n) for n, f, _ in alloc[STACK]) if is_recorded(alloc) else (
        (f.get("filename", ""), f.get("name", "")) for f in alloc.get("frames") or ())
    return communication_overrides((f, n) for f, n in frames
                                   if f.endswith(".py") or f == "<string>")


def _find_workspaces(trace: Sequence[Event], labels: list[list[Any]],
                     workspaces: tuple[int, int]) -> None:
    """Relabel the ``other`` allocs of ``labels`` that are BLAS workspaces, in place."""
    previous: Event | None = None  # the alloc before, and whether it was a workspace
    was_workspace = False
    for label in labels:
        e = trace[label[0]]
        if label[1] == OTHER and _is_workspace(e, previous, was_workspace, workspaces):
            label[1] = WORKSPACE
        previous, was_workspace = e, label[1] == WORKSPACE


def _is_workspace(alloc: Event, previous: Event | None, after_workspace: bool,
                  sizes: tuple[int, int]) -> bool:
    """Whether an unseen block that lives to the end is a BLAS workspace: the cuBLAS
    workspace's size, or the Lt workspace's, requested by the same call right after a
    cuBLAS workspace (a thread's first Lt call makes both); the hooks see no tensor in
    them, and a tensor the script keeps of exactly these sizes is told apart by its
    call."""
    cublas, lt = sizes
    if cublas and alloc["size"] == cublas:
        return True
    return bool(lt and alloc["size"] == lt and after_workspace and previous is not None
                and previous.get("frames") == alloc.get("frames"))


def tag_trace(trace: Sequence[Event], tags: Sequence[Sighting], labels: Sequence[Sequence[Any]],
              times: Sequence[int] | None = None,
              allocs: Allocs | None = None) -> list[list[Any]]:
    """``[event_index, EVAL_ACTIVATIONS]`` for every alloc labelled ``activations`` (in
    ``labels``) that an eval-mode forward saved (a sighting ``EVAL_ACTIVATIONS`` in
    ``tags``) and no backward read (no sighting ``READ``)."""
    if allocs is None:
        allocs = Allocs(trace, event_times(trace) if times is None else times)
    saved: set[int | None] = set()
    read: set[int | None] = set()
    for at, addr, nbytes, category in tags:
        (read if category == READ else saved).add(allocs.live(addr, at, nbytes))
    return [[i, EVAL_ACTIVATIONS] for i, category in labels
            if category == ACTIVATIONS and i in saved and i not in read]


def step_ends(times: Sequence[int], ends: Sequence[int]) -> list[int]:
    """Step ends as exclusive event indices: the events at or before each end's moment."""
    return [bisect_right(times, at) for at in ends]
