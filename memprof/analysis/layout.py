"""Lay a trace recorded without a GPU out in CUDA memory: the caching allocator's prediction.

A trace from memprof's CPU recorder has sizes and lifetimes but no CUDA addresses and
no segments. Replaying it through the allocator simulator places every block as the
CUDA caching allocator would, and yields a complete PyTorch snapshot: ``alloc`` events
at predicted addresses, ``segment_alloc`` (or ``segment_map``) where the allocator
would grow, and the final segments with their blocks. ``explain`` and PyTorch's
memory viewer read it like a snapshot recorded on a GPU.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from memprof.analysis.allocator import CachingAllocator
from memprof.analysis.blocks import DEFAULT_POOL, Block, Segment
from memprof.analysis.tally import Tally
from memprof.trace.events import (
    ACTION,
    ADDR,
    SIZE,
    STACK,
    STREAM,
    TIME_US,
    OomEvent,
    Stack,
    TraceEvent,
    snapshot_stack,
)
from memprof.trace.model import AllocatorSettings

Event = TraceEvent | OomEvent


@dataclass(frozen=True, slots=True)
class Layout:
    """A trace placed in predicted CUDA memory."""

    trace: list[Event]
    segments: list[dict[str, Any]]
    position: array[int]  # where each input event landed in ``trace`` (-1: dropped)
    # every private-pool segment the trace grew (a CUDA graph's), by address: the trace's
    # events do not say, and the final segments lack those already freed
    pools: dict[int, tuple[int, int]]
    tally: Tally | None = None  # what ``replay`` would find in ``trace``, when tallied
    device: int = 0  # the CUDA device index it was placed on


def lay_out(events: Iterable[Event], settings: AllocatorSettings | None = None,
            device: int = 0, consume: bool = False) -> Layout:
    """Place ``events`` (alloc/free_requested/free_completed, any ids as addresses).

    The trace gets predicted addresses and the growth events the allocator would
    record; event fields other than ``addr`` are kept. ``consume``: ``events`` is a list
    emptied as it is placed, so a long trace is never held twice.
    """
    placer = Placer(CachingAllocator(settings), tally=True)
    if consume and isinstance(events, list):
        events.reverse()
        while events:
            placer.add(events.pop())
    else:
        for event in events:
            placer.add(event)
    return placer.layout(device)


class Placer:
    """Places events one at a time, so that the allocator's state can be read between them.

    ``add`` raises the allocator's :class:`OutOfMemory` for an allocation that cannot be
    placed under its limit; the event is then not placed. With ``tally`` (a placement
    that is never trimmed, ``forget``), the layout carries what ``replay`` would find
    (``Tally``).
    """

    def __init__(self, alloc: CachingAllocator, tally: bool = False) -> None:
        self.alloc = alloc
        self.pool = DEFAULT_POOL  # where allocations go: a private pool while a CUDA graph captures
        self.trace: list[Event] = []
        self.position: array[int] = array("q")  # 8 bytes an event, not an int object
        self._blocks: dict[int, Block] = {}
        self._stacks: dict[int, Stack] = {}  # alloc stacks of live blocks, by predicted address
        # the allocator's segments and their sizes when the trace last caught up with them
        self._segments: dict[int, Segment] = {}
        self._totals: dict[int, int] = {}
        self._changes = alloc.segment_changes
        self._pools: dict[int, tuple[int, int]] = {}
        self._tally = Tally(alloc) if tally else None
        self._placed_at: dict[int, int] = {}  # with a tally: each live block's alloc number

    def add(self, event: Event) -> None:
        """Place one event of the input trace."""
        alloc, out = self.alloc, self.trace
        action = event[ACTION]
        if action == "alloc":
            try:
                block = alloc.malloc(event[SIZE], event[STREAM], self.pool)
            except BaseException:  # under a limit, cached segments went back to the device
                self._catch_up(event[TIME_US], None)
                raise
            if alloc.segment_changes != self._changes:  # (most allocations change none)
                self._catch_up(event[TIME_US], event[STACK])
            self.position.append(len(out))
            self._blocks[event[ADDR]] = block
            self._stacks[block.addr] = event[STACK]
            out.append((action, block.addr, *event[SIZE:]))
            if self._tally is not None:
                self._placed_at[event[ADDR]] = self._tally.alloc(block, alloc)
        elif action in ("free_requested", "free_completed"):
            recorded = event[ADDR]
            block = self._blocks.get(recorded)
            if block is None:
                self.position.append(-1)
                return
            self.position.append(len(out))
            out.append((action, block.addr, *event[SIZE:]))  # before a merge moves the block
            if self._tally is not None:  # the first of a free's two events releases it
                self._tally.release(self._placed_at[recorded] if action == "free_completed"
                                    or block.allocated else None)
            if action == "free_completed":
                del self._blocks[recorded]
                self._placed_at.pop(recorded, None)
                self._stacks.pop(block.addr, None)
                alloc.free(block)
            elif block.allocated:
                alloc.release_stats(block)
        else:
            self.position.append(len(out))
            out.append(event)
            if self._tally is not None:
                self._tally.event()

    def forget(self, dropped: list[int]) -> None:
        """Drop the placed copies of the input events at ``dropped`` (ascending indices;
        a ring buffer's oldest events), keeping the segment events; later positions shift."""
        self._tally = None  # a trimmed trace is replayed as it is left
        gone_set = {self.position[i] for i in dropped} - {-1}
        gone = sorted(gone_set)
        self.trace = [e for j, e in enumerate(self.trace) if j not in gone_set]
        dropped_set = set(dropped)
        self.position = array("q", (p - bisect.bisect_left(gone, p) if p >= 0 else -1
                                    for i, p in enumerate(self.position)
                                    if i not in dropped_set))

    def release_cached(self, time_us: int) -> None:
        """``empty_cache()``: return cached segments to the device, with their trace events."""
        self.alloc.release_cached()
        self._catch_up(time_us, None)

    def _catch_up(self, time_us: int, grown_by: Stack | None) -> None:
        """Trace the segments the allocator has given back since the last catch-up, and with
        ``grown_by`` (the stack of the allocation that grew them) those it has grown.

        Segments are compared only when they changed: a pass over all of them at every
        allocation would cost more than placing it.
        """
        alloc, before, totals = self.alloc, self._segments, self._totals
        if alloc.segment_changes == self._changes:
            return
        # an expandable range's pages: unmapping some keeps the range's start (or cuts it in
        # two), so what changed is the pages each side covers that the other does not
        mapped = sorted((s.addr, s.addr + s.total) for s in alloc.segments.values()
                        if s.expandable)
        was_mapped = sorted((a, a + totals[a]) for a, s in before.items() if s.expandable)
        for addr, seg in before.items():
            if seg.expandable:
                for lo, hi in _uncovered(addr, addr + totals[addr], mapped):
                    self._segment_event(("segment_unmap", lo, hi - lo, seg.stream, time_us,
                                         ()), -1)
            elif addr not in alloc.segments:
                self._segment_event(("segment_free", addr, seg.total, seg.stream, time_us,
                                     ()), -1)
        for seg in alloc.segments.values() if grown_by is not None else ():
            grown = _uncovered(seg.addr, seg.addr + seg.total, was_mapped) if seg.expandable \
                else [] if seg.addr in totals else [(seg.addr, seg.addr + seg.total)]
            for lo, hi in grown:
                action = "segment_map" if seg.expandable else "segment_alloc"
                self._segment_event((action, lo, hi - lo, seg.stream, time_us, grown_by), 1)
            if grown and seg.pool != DEFAULT_POOL:
                self._pools[seg.addr] = seg.pool
        self._segments = dict(alloc.segments)
        self._totals = {addr: seg.total for addr, seg in alloc.segments.items()}
        self._changes = alloc.segment_changes

    def _segment_event(self, event: TraceEvent, sign: int) -> None:
        if self._tally is not None:
            self._tally.segment(sign * event[SIZE])
        self.trace.append(event)

    def layout(self, device: int = 0) -> Layout:
        """The trace so far and the allocator's segments now."""
        if self._tally is not None:
            self._tally.finish(self.alloc)
        return Layout(list(self.trace), snapshot_segments(self.alloc, device, self._stacks),
                      array("q", self.position), dict(self._pools), self._tally, device)


def _uncovered(lo: int, hi: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``[lo, hi)`` that none of ``ranges`` (sorted, disjoint) covers."""
    gaps, at = [], lo
    for start, end in ranges[max(0, bisect.bisect_right(ranges, (lo, lo)) - 1):]:
        if start >= hi:
            break
        if end <= at:
            continue
        if start > at:
            gaps.append((at, start))
        at = max(at, end)
    if at < hi:
        gaps.append((at, hi))
    return gaps


def snapshot_segments(alloc: CachingAllocator, device: int = 0,
                      stacks: dict[int, Stack] | None = None) -> list[dict[str, Any]]:
    """The allocator's segments in the form ``torch.cuda.memory._snapshot()`` gives them
    (``stacks``: the recorded stacks of the blocks allocated, by address)."""
    stacks = stacks or {}
    frames: dict[int, dict[str, Any]] = {}  # shared between the blocks' lists
    out = []
    for seg in sorted(alloc.segments.values(), key=lambda s: s.addr):
        blocks = seg.blocks()
        held = [b for b in blocks if b.allocated]
        out.append({
            "device": device, "address": seg.addr, "total_size": seg.total,
            "allocated_size": sum(b.size for b in held),
            "active_size": sum(b.size for b in blocks if not b.cached),
            "requested_size": sum(b.requested for b in held),
            "stream": seg.stream, "segment_type": "small" if seg.small else "large",
            "segment_pool_id": seg.pool, "is_expandable": seg.expandable, "frames": [],
            "blocks": [{"address": b.addr, "size": b.size, "requested_size": b.requested,
                        "state": "active_allocated" if b.allocated else
                        "inactive" if b.cached else "active_pending_free",
                        "frames": snapshot_stack(stacks.get(b.addr, ()), frames)}
                       for b in blocks],
        })
    return out
