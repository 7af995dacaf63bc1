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
from dataclasses import dataclass, field
from typing import Any

from memprof.trace.events import ACTION, ADDR, SIZE, TraceEvent
from memprof.trace.model import (
    ACTIVATIONS,
    CATEGORIES,
    EVAL_ACTIVATIONS,
    OTHER,
    TEMPORARIES,
    WORKSPACE,
)

Event = dict[str, Any]
READ = "read"  # a tag sighting: a backward unpacked the storage
_RANK = {category: rank for rank, category in enumerate(CATEGORIES)}
_FREES = ("free_requested", "free_completed")
_NEVER = float("inf")  # the end of a block the trace never frees


# A storage seen in a role: (when, where, how large, which category). A plain tuple, made in
# every saved-tensor hook: the garbage collector stops tracking a tuple of ints and strings,
# never a named tuple, whose millions would make each full collection longer.
Sighting = tuple[int, int, int, str]


@dataclass
class Blocks:
    """The allocs made at one address, in trace order."""

    times: list[int] = field(default_factory=list)
    events: list[int] = field(default_factory=list)  # alloc event indices
    sizes: list[int] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)  # free time; inf while never freed


def fields(event: Event | TraceEvent) -> tuple[str, int, int]:
    """An event's action, address and size: a snapshot's dict or a recorder's tuple."""
    if type(event) is tuple:
        return event[ACTION], event[ADDR], event[SIZE]
    return event["action"], event.get("addr", 0), event.get("size", 0)  # "oom" has no addr


def action_of(event: Event | TraceEvent) -> str:
    """An event's action: a snapshot's dict or a recorder's tuple."""
    return event[ACTION] if type(event) is tuple else event["action"]


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
                blocks: dict[int, Blocks] | None = None) -> list[list[Any]]:
    """``[event_index, category]`` for every alloc event of ``trace``: the first in
    ``CATEGORIES`` order among its sightings; unseen, ``temporaries`` if the trace frees
    it, ``workspace`` if it is a BLAS library's (``workspaces``: the cuBLAS and the
    separate cuBLASLt workspace's bytes, ``blas_workspace_sizes``) and ``other`` if not.
    ``times``: the clock the sightings used (``event_times`` by default); ``blocks``: the
    trace's ``blocks_by_address``, if made."""
    if blocks is None:
        blocks = blocks_by_address(trace, event_times(trace) if times is None else times)
    best: dict[int, str] = {}
    for at, addr, nbytes, category in sightings:
        here = blocks.get(addr)
        index = live_alloc(here, at, nbytes) if here is not None else None
        if index is not None:
            current = best.get(index)
            if current is None or _RANK[category] < _RANK[current]:
                best[index] = category
    freed = {i for b in blocks.values() for i, end in zip(b.events, b.ends, strict=True)
             if end != _NEVER}
    labels = []
    previous: Event | None = None  # the alloc before, and whether it was a workspace
    was_workspace = False
    for i, e in enumerate(trace):
        if action_of(e) != "alloc":
            continue
        category = best.get(i, TEMPORARIES if i in freed else OTHER)
        if category == OTHER and _is_workspace(e, previous, was_workspace, workspaces):
            category = WORKSPACE
        labels.append([i, category])
        previous, was_workspace = e, category == WORKSPACE
    return labels


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
              blocks: dict[int, Blocks] | None = None) -> list[list[Any]]:
    """``[event_index, EVAL_ACTIVATIONS]`` for every alloc labelled ``activations`` (in
    ``labels``) that an eval-mode forward saved (a sighting ``EVAL_ACTIVATIONS`` in
    ``tags``) and no backward read (no sighting ``READ``)."""
    if blocks is None:
        blocks = blocks_by_address(trace, event_times(trace) if times is None else times)
    saved: set[int | None] = set()
    read: set[int | None] = set()
    for at, addr, nbytes, category in tags:
        here = blocks.get(addr)
        if here is not None:
            (read if category == READ else saved).add(live_alloc(here, at, nbytes))
    return [[i, EVAL_ACTIVATIONS] for i, category in labels
            if category == ACTIVATIONS and i in saved and i not in read]


def step_ends(times: Sequence[int], ends: Sequence[int]) -> list[int]:
    """Step ends as exclusive event indices: the events at or before each end's moment."""
    return [bisect_right(times, at) for at in ends]


def blocks_by_address(trace: Sequence[Event], times: Sequence[int]) -> dict[int, Blocks]:
    """The allocs of ``trace`` at each address, with their times, sizes and ends."""
    by_addr: dict[int, Blocks] = {}
    for i, e in enumerate(trace):
        action, addr, size = fields(e)
        if action == "alloc":
            b = by_addr.setdefault(addr, Blocks())
            b.times.append(times[i])
            b.events.append(i)
            b.sizes.append(size)
            b.ends.append(_NEVER)
        elif action in _FREES:  # the first of the two ends the block's life
            b = by_addr.get(addr)
            if b is not None and b.ends and b.ends[-1] == _NEVER:
                b.ends[-1] = times[i]
    return by_addr


def live_alloc(blocks: Blocks, at: int, nbytes: int) -> int | None:
    """The alloc event among ``blocks`` (one address's) live at ``at`` that can hold a
    storage of ``nbytes``."""
    k = bisect_right(blocks.times, at) - 1
    if k >= 0 and blocks.ends[k] < at:
        k += 1  # freed before the sighting: the clocks disagree, the next one is live
    k = max(k, 0)
    if k < len(blocks.events) and blocks.sizes[k] >= nbytes:
        return blocks.events[k]
    return None
