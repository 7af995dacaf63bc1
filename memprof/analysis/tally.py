"""The replay of a trace the allocator simulator placed itself, tallied while placing it.

``lay_out`` places a GPU-less recording event by event. The timelines and allocator
states ``explain`` reads from ``replay`` are the placement's own, so they are noted as it
goes, and the simulator need not run over the placed trace a second time (a fifth of the
analysis of a CPU run). The result is what ``replay`` gives for the placed trace: every
decision and address the simulator's, reproduced. Until ``explain`` asks, a tally holds 24
bytes an allocation (where, what block, what released it); the timelines are made then,
as ``replay`` would make them.

    tally = Tally(allocator)
    k = tally.alloc(block, allocator)   # as the placer writes each event: an alloc,
    tally.release(k)                    # a free (releasing that alloc's block, or None),
    tally.segment(change)               # segment growth and release,
    tally.event()                       # anything else
    tally.finish(allocator)
    result = tally.replay(device)       # in explain
"""

from __future__ import annotations

from array import array

import numpy as np

from memprof.analysis.allocator import CachingAllocator
from memprof.analysis.blocks import Block
from memprof.analysis.replay import (
    Check,
    Moment,
    Replay,
    allocated_changes,
    capture,
    cumulative,
)

_OPEN = -1  # the end of a block nothing has released yet


class Tally:
    """What ``replay`` would find in a trace, noted by the placer that writes it, event by
    event in order."""

    def __init__(self, alloc: CachingAllocator) -> None:
        self.events = 0  # events written
        self._at = array("q")  # each alloc event's position
        self._sizes = array("q")  # its block's bytes
        self._ends = array("q")  # the position of the event that released it
        self._reserved: list[tuple[int, int]] = []  # (position, change) of segment events
        # growth counted at the allocation that asked for it, as replay predicts it
        self._predicted: list[tuple[int, int]] = []
        self._grown = 0  # allocations that grew the reserved memory first
        self._growth = 0  # bytes grown since the last alloc event
        self._peak_value = alloc.allocated
        self._peak = capture(alloc, -1)
        self._final: Moment | None = None

    def alloc(self, block: Block, alloc: CachingAllocator) -> int:
        """The next event is an alloc that got ``block``: its number, for ``release``."""
        position = self.events
        self._at.append(position)
        self._sizes.append(block.size)
        self._ends.append(_OPEN)
        if self._growth:
            self._predicted.append((position, self._growth))
            self._grown += 1
            self._growth = 0
        if alloc.allocated > self._peak_value:
            self._peak_value, self._peak = alloc.allocated, capture(alloc, position)
        self.events += 1
        return len(self._at) - 1

    def release(self, number: int | None) -> None:
        """The next event is a free; it releases the block of alloc ``number`` unless an
        earlier one did (None: it releases nothing)."""
        if number is not None and self._ends[number] == _OPEN:
            self._ends[number] = self.events
        self.events += 1

    def segment(self, change: int) -> None:
        """The next event is a segment's, changing the reserved bytes by ``change``."""
        self._reserved.append((self.events, change))
        if change > 0:
            self._growth += change
        else:
            self._predicted.append((self.events, change))
        self.events += 1

    def event(self) -> None:
        """The next event is none of the above."""
        self.events += 1

    def finish(self, alloc: CachingAllocator) -> None:
        """The placement has ended; the allocator is at the end of the events."""
        self._final = capture(alloc, self.events - 1)

    def replay(self, device: int) -> Replay:
        """``replay``'s result for the events tallied (after ``finish``)."""
        if self._final is None:
            raise ValueError("replay() needs a finished tally")
        n = self.events
        at = np.frombuffer(self._at, np.int64)
        sizes, ends = np.zeros(n, np.int64), np.full(n, n, np.int64)
        sizes[at] = np.frombuffer(self._sizes, np.int64)
        released = np.frombuffer(self._ends, np.int64)
        ends[at] = np.where(released == _OPEN, n, released)
        placed = len(at)
        return Replay(
            device=device, allocated=cumulative(0, allocated_changes(sizes, ends, [], {})),
            reserved=cumulative(0, _sparse(self._reserved, n)),
            reserved_predicted=cumulative(0, _sparse(self._predicted, n)),
            block_size=sizes, end=ends, initial=[], initial_allocated=0, initial_reserved=0,
            peak=self._peak, ooms=[],
            check=Check(decisions_total=placed, decisions_matched=placed,
                        segments_predicted=self._grown, segments_recorded=self._grown,
                        addresses_total=placed, addresses_matched=placed,
                        common_path=placed - self._grown),
            final=self._final)


def _sparse(changes: list[tuple[int, int]], n: int) -> np.ndarray:
    """``n`` changes, zero but at the ``(position, change)`` pairs."""
    out = np.zeros(n, np.int64)
    for position, change in changes:
        out[position] = change
    return out
