"""Expandable segments (``expandable_segments:True``): each stream's pool is one range of
virtual addresses that grows by mapping pages at its end, and gives free pages back by
unmapping them (``ExpandableSegment`` in ``c10/cuda/CUDACachingAllocator.cpp``)."""

from __future__ import annotations

from memprof.analysis.blocks import (
    ADDR_MASK,
    DEFAULT_POOL,
    KEY_SHIFT,
    LARGE_BUFFER,
    SMALL_BUFFER,
    SMALL_SIZE,
    Block,
    Segment,
)

# The address space an expandable segment reserves beyond its mapped pages (about 1.125x
# the device's memory): larger than any block, which is all the best-fit rule needs.
_UNMAPPED_SPACE = 1 << 60


class ExpandableSegments:
    """The expandable-segment operations of :class:`~memprof.analysis.allocator.CachingAllocator`
    (a mixin: it works on the allocator's blocks, free lists and counters)."""

    def _growable_size(self, key: int) -> int:
        block = self._blocks[key & ADDR_MASK]
        return (key >> KEY_SHIFT) + (_UNMAPPED_SPACE if block.seg.expandable
                                      and block.next is None else 0)

    @staticmethod
    def page_size(small: bool) -> int:
        return SMALL_BUFFER if small else LARGE_BUFFER

    def map_pages(self, addr: int, size: int, stream: int = 0,
                  pool: tuple[int, int] = DEFAULT_POOL, small: bool | None = None) -> Segment:
        """Map ``size`` bytes at ``addr`` (segment_map): grow the range it extends, or start one.

        Each contiguous mapped range is one segment, as snapshots report them.
        """
        seg = self.range_ends.pop((stream, addr), None)
        if seg is None:
            small = size % LARGE_BUFFER != 0 if small is None else small
            return self.add_segment(addr, size, stream, pool, small, expandable=True)
        last = seg.last
        assert last is not None
        if last.cached:
            self._remove_free(last)
            last.size += size
            self._insert_free(last)
        else:
            tail = Block(addr, size, seg)
            tail.prev, last.next = last, tail
            seg.last = tail
            self._index(tail)
            self._insert_free(tail)
        seg.total += size
        self.range_ends[stream, seg.addr + seg.total] = seg
        self.segment_changes += 1
        self.reserved += size
        seg.group[1] += size
        return seg

    def unmap_pages(self, addr: int, size: int) -> None:
        """Unmap free pages ``[addr, addr + size)`` (segment_unmap), cutting their range in two."""
        block = self._take(addr, size)
        seg, before, after = block.seg, block.prev, block.next
        self._unindex(block.addr)
        group = seg.group
        group[0] -= 1
        group[1] -= seg.total
        self.reserved -= seg.total
        del self.segments[seg.addr]
        del self.range_ends[seg.stream, seg.addr + seg.total]
        self.segment_changes += 1
        for first, last in ((seg.first if before else None, before), (after, None)):
            if first is None:
                continue
            first.prev = None
            if last is not None:
                last.next = None
            part = Segment(first.addr, 0, seg.stream, seg.pool, seg.small, True)
            part.free_keys, part.group = seg.free_keys, group
            part.first, b = first, first
            while b is not None:
                b.seg = part
                part.total += b.size
                part.last, b = b, b.next
            self.segments[part.addr] = part
            self.range_ends[part.stream, part.addr + part.total] = part
            self.reserved += part.total
            group[0] += 1
            group[1] += part.total

    def grow_plan(self, rounded: int, stream: int, pool: tuple[int, int]) -> tuple[int, int]:
        """Where a block of ``rounded`` bytes would start and how many bytes must be mapped.

        The pages go at the end of the stream's last range, after its free tail; -1 for
        the address means a new range.
        """
        small = rounded <= SMALL_SIZE
        page = self.page_size(small)
        ranges = [s for s in self.segments.values()
                  if s.expandable and s.stream == stream and s.pool == pool and s.small == small]
        seg = max(ranges, key=lambda s: s.addr, default=None)
        if seg is None:
            return -1, -(-rounded // page) * page
        last = seg.last
        assert last is not None
        free_tail = last.size if last.cached else 0
        return seg.addr + seg.total - free_tail, -(-(rounded - free_tail) // page) * page

    def _grow(self, rounded: int, stream: int, pool: tuple[int, int]) -> Block:
        addr, need = self.grow_plan(rounded, stream, pool)
        last = self.block_at(addr) if addr >= 0 else None
        map_at = self._synthetic_address(1 << 40) if addr < 0 else addr + (last.size if last else 0)
        last = self.map_pages(map_at, need, stream, pool, rounded <= SMALL_SIZE).last
        assert last is not None
        return last
