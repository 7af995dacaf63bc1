"""The caching allocator's bookkeeping: segments split into blocks, free lists, counters.

No policy here: :class:`~memprof.analysis.allocator.CachingAllocator` decides which
block a request gets and when to grow; these operations apply its decisions.
"""

from __future__ import annotations

import bisect
from bisect import bisect_left, insort

from memprof.analysis.blocks import (
    DEFAULT_POOL,
    KEY_SHIFT,
    SMALL_BUFFER,
    Block,
    FreeBlockStats,
    Segment,
)


class BlockTable:
    """Segments and the blocks that tile them, free lists and counters (a base of
    :class:`~memprof.analysis.allocator.CachingAllocator`)."""

    def __init__(self) -> None:
        # free blocks per (pool id, small?, stream), as sorted keys (see KEY_SHIFT)
        self._free: dict[tuple[tuple[int, int], bool, int], list[int]] = {}
        self._blocks: dict[int, Block] = {}  # every block, by start address
        # the same addresses, sorted: which block holds an address (built on first use, as
        # most replays never ask)
        self._starts: list[int] | None = None
        self._gc_clock = 0  # searches of the default large pool, the garbage collector's clock
        self.segments: dict[int, Segment] = {}
        self.range_ends: dict[tuple[int, int], Segment] = {}  # expandable, by (stream, end)
        self.segment_changes = 0  # counts every change to ``segments`` (a segment's size too)
        self.allocated = 0  # block bytes held by tensors (max_memory_allocated's stat)
        self.reserved = 0
        self.cached_bytes = 0  # reserved bytes in free lists
        # per (pool, small?, stream): [segments, reserved bytes, allocated bytes]
        self.groups: dict[tuple[tuple[int, int], bool, int], list[int]] = {}

    def add_segment(self, addr: int, total: int, stream: int = 0,
                    pool: tuple[int, int] = DEFAULT_POOL, small: bool | None = None,
                    expandable: bool = False) -> Segment:
        """Add a segment of ``total`` free bytes (a cudaMalloc, or one found in a recording)."""
        small = total <= SMALL_BUFFER if small is None else small
        seg = Segment(addr, total, stream, pool, small, expandable)
        seg.free_keys = self._free.setdefault((pool, small, stream), [])
        block = Block(addr, total, seg)
        seg.first = seg.last = block
        self.segments[addr] = seg
        if expandable:
            self.range_ends[stream, addr + total] = seg
        self.segment_changes += 1
        self._index(block)
        self._insert_free(block)
        self.reserved += total
        group = seg.group = self.groups.setdefault((pool, seg.small, stream), [0, 0, 0])
        group[0] += 1
        group[1] += total
        return seg

    def remove_segment(self, seg: Segment) -> None:
        """Give a wholly free segment back to the device (cudaFree)."""
        block = seg.first
        assert block is not None and block.next is None and block.cached
        self._remove_free(block)
        self._unindex(block.addr)
        del self.segments[seg.addr]
        if seg.expandable:
            del self.range_ends[seg.stream, seg.addr + seg.total]
        self.segment_changes += 1
        self.reserved -= seg.total
        seg.group[0] -= 1
        seg.group[1] -= seg.total

    def state(self) -> tuple:
        """Everything later decisions depend on, comparable with another moment's: the
        counters, and each segment and block (free lists follow from the blocks)."""
        return (self.allocated, self.reserved, self.cached_bytes, self._gc_clock,
                sorted((s.addr, s.total, s.stream, s.pool, s.small, s.expandable)
                       for s in self.segments.values()),
                sorted((b.addr, b.size, b.allocated, b.cached, b.requested, b.gc_base)
                       for b in self._blocks.values()))

    def block_at(self, addr: int) -> Block | None:
        return self._blocks.get(addr)

    def containing(self, addr: int) -> Block | None:
        """The block whose range holds ``addr``."""
        starts = self._starts
        if starts is None:
            starts = self._starts = sorted(self._blocks)
        i = bisect.bisect_right(starts, addr) - 1
        block = self._blocks[starts[i]] if i >= 0 else None
        return block if block is not None and addr < block.addr + block.size else None

    @property
    def requested(self) -> int:
        """Bytes the allocated blocks were asked for (counted when asked: seldom)."""
        return sum(b.requested for b in self._blocks.values() if b.allocated)

    def free_stats(self) -> FreeBlockStats:
        """Cached free memory now: total, largest block (what a request can get), count."""
        largest, count = 0, 0
        for keys in self._free.values():
            if keys:
                count += len(keys)
                largest = max(largest, keys[-1] >> KEY_SHIFT)
        return FreeBlockStats(self.cached_bytes, largest, count)

    def free(self, block: Block) -> None:
        """Return a block to its pool, merging it with free neighbours (free_completed)."""
        if block.allocated:
            self.release_stats(block)
        before, after = block.prev, block.next
        if before is not None and before.cached:
            self._merge(block, before)
        if after is not None and after.cached:
            self._merge(block, after)
        block.cached = True
        self._insert_free(block)

    def release_stats(self, block: Block) -> None:
        """Stop counting ``block`` as allocated (free_requested); it is reused only once freed."""
        size = block.size
        block.allocated = False
        self.allocated -= size
        block.seg.group[2] -= size

    def _merge(self, block: Block, other: Block) -> None:
        """Join the free neighbour ``other`` to ``block``."""
        self._remove_free(other)
        if other is block.prev:
            self._unindex(block.addr)
            block.addr = other.addr
            block.prev = other.prev
            if other.prev is not None:
                other.prev.next = block
            else:
                block.seg.first = block
            self._blocks[block.addr] = block
        else:
            self._unindex(other.addr)
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
            else:
                block.seg.last = block
        block.size += other.size

    def _take(self, addr: int, size: int) -> Block:
        """Remove exactly ``[addr, addr + size)`` from the free blocks."""
        block = self._blocks.get(addr)
        if block is None or not block.cached:
            block = self._carve(addr)
        self._remove_free(block)
        if block.size > size:
            self._split(block, size)
        return block

    def _carve(self, addr: int) -> Block:
        """Split a free block so that one starts at ``addr`` (a recording diverged from us)."""
        block = self.containing(addr)
        if block is None or not block.cached:
            raise KeyError(addr)
        self._remove_free(block)
        tail = self._split(block, addr - block.addr)
        self._insert_free(block)
        return tail

    def _split(self, block: Block, size: int) -> Block:
        """Cut ``block`` to ``size`` bytes; the rest becomes a free block after it."""
        rest = Block(block.addr + size, block.size - size, block.seg)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        else:
            block.seg.last = rest
        block.next = rest
        block.size = size
        self._index(rest)
        self._insert_free(rest)
        return rest

    def _index(self, block: Block) -> None:
        self._blocks[block.addr] = block
        if self._starts is not None:
            insort(self._starts, block.addr)

    def _unindex(self, addr: int) -> None:
        del self._blocks[addr]
        if self._starts is not None:
            del self._starts[bisect_left(self._starts, addr)]

    def _insert_free(self, block: Block) -> None:
        size = block.size
        insort(block.seg.free_keys, size << KEY_SHIFT | block.addr)
        block.gc_base = self._gc_clock
        self.cached_bytes += size

    def _remove_free(self, block: Block) -> None:
        size = block.size
        keys = block.seg.free_keys
        key = size << KEY_SHIFT | block.addr
        i = bisect_left(keys, key)
        if i < len(keys) and keys[i] == key:
            del keys[i]
            self.cached_bytes -= size
