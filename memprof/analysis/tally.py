"""The replay of a trace the allocator simulator placed itself, tallied while placing it.

``lay_out`` places a GPU-less recording event by event. The timelines and allocator
states ``explain`` reads from ``replay`` are the placement's own, so they are noted as it
goes, and the simulator need not run over the placed trace a second time (a fifth of the
analysis of a CPU run). The result is what ``replay`` gives for the placed trace: every
decision and address the simulator's, reproduced.

    tally = Tally(allocator)
    tally.alloc(position, block, allocator)  # as the placer emits each event:
    tally.release(alloc_position, position)  # alloc, the free that releases it,
    tally.segment(position, change)          # segment growth and release
    result = tally.replay(allocator, len(trace), device)
"""

from __future__ import annotations

import numpy as np

from memprof.analysis.allocator import CachingAllocator
from memprof.analysis.blocks import Block
from memprof.analysis.replay import Check, Replay, allocated_changes, capture, cumulative


class Tally:
    """What ``replay`` would find in a trace, noted by the placer that writes it."""

    def __init__(self, alloc: CachingAllocator) -> None:
        self._sizes: dict[int, int] = {}  # block bytes, by the position of its alloc event
        self._ends: dict[int, int] = {}  # the event that released it, by the same
        self._reserved: dict[int, int] = {}  # reserved bytes a segment event changed
        # the same, growth counted at the allocation that asked for it, as replay predicts
        self._predicted: dict[int, int] = {}
        self._grown = 0  # allocations that grew the reserved memory first
        self._growth = 0  # bytes grown since the last alloc event
        self._peak_value = alloc.allocated
        self._peak = capture(alloc, -1)

    def alloc(self, position: int, block: Block, alloc: CachingAllocator) -> None:
        """An alloc event at ``position`` got ``block``."""
        self._sizes[position] = block.size
        if self._growth:
            self._predicted[position] = self._growth
            self._grown += 1
            self._growth = 0
        if alloc.allocated > self._peak_value:
            self._peak_value, self._peak = alloc.allocated, capture(alloc, position)

    def release(self, alloc_position: int, position: int) -> None:
        """The event at ``position`` released the block the one at ``alloc_position`` got."""
        self._ends.setdefault(alloc_position, position)

    def segment(self, position: int, change: int) -> None:
        """A segment event at ``position`` changed the reserved bytes by ``change``."""
        self._reserved[position] = change
        if change > 0:
            self._growth += change
        else:
            self._predicted[position] = change

    def replay(self, alloc: CachingAllocator, n: int, device: int) -> Replay:
        """``replay``'s result for the ``n`` events placed, the allocator now at their end."""
        sizes, ends = np.zeros(n, np.int64), np.full(n, n, np.int64)
        reserved, predicted = np.zeros(n, np.int64), np.zeros(n, np.int64)
        for column, values in ((sizes, self._sizes), (ends, self._ends),
                               (reserved, self._reserved), (predicted, self._predicted)):
            if values:
                column[np.fromiter(values, np.int64, len(values))] = \
                    np.fromiter(values.values(), np.int64, len(values))
        placed = len(self._sizes)
        return Replay(
            device=device, allocated=cumulative(0, allocated_changes(sizes, ends, [], {})),
            reserved=cumulative(0, reserved), reserved_predicted=cumulative(0, predicted),
            block_size=sizes, end=ends, initial=[], initial_allocated=0, initial_reserved=0,
            peak=self._peak, ooms=[],
            check=Check(decisions_total=placed, decisions_matched=placed,
                        segments_predicted=self._grown, segments_recorded=self._grown,
                        addresses_total=placed, addresses_matched=placed),
            final=capture(alloc, n - 1))

