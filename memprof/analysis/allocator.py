"""A simulator of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``).

It holds segments split into blocks and applies the allocator's rules: request
rounding, small/large pools per stream and private pool, best fit (smallest block,
then lowest address), splitting, merging on free, oversize blocks under
``max_split_size``, garbage collection and expandable segments. Given an address it
follows a recording; without one it predicts where the allocator would place a block.
"""

from __future__ import annotations

import bisect
from bisect import bisect_left, insort

from memprof.analysis.blocks import (
    DEFAULT_POOL,
    LARGE_BUFFER,
    MIN_BLOCK,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    Block,
    FreeBlockStats,
    OutOfMemory,
    Segment,
)
from memprof.trace.model import AllocatorSettings

# The address space an expandable segment reserves beyond its mapped pages (about 1.125x
# the device's memory): larger than any block, which is all the best-fit rule needs.
_UNMAPPED_SPACE = 1 << 60
# A free list orders its blocks by (size, address), packed in one int: ints compare faster
# than tuples, and a free list is searched at every allocation and free.
_KEY_SHIFT = 64
_ADDR_MASK = (1 << _KEY_SHIFT) - 1


class CachingAllocator:
    """The allocator state of one device, with the policy of PyTorch's native backend.

    ``limit`` caps reserved memory, as ``set_per_process_memory_fraction`` (or a smaller
    card) does: growing past it first collects garbage (``garbage_collection_threshold``),
    then releases oversize and then all cached segments, then raises :class:`OutOfMemory`.
    """

    def __init__(self, settings: AllocatorSettings | None = None, limit: int | None = None
                 ) -> None:
        self.settings = settings or AllocatorSettings()
        self.limit = limit
        self._gc_clock = 0  # searches of the default large pool, the garbage collector's clock
        self.max_split = self.settings.max_split_size or (1 << 63) - 1
        self._any_divisions = any(d > 1 for d in self.settings.roundup_power2_divisions)
        self._expandable = self.settings.expandable_segments
        # free blocks per (pool id, small?, stream), as sorted keys (see _KEY_SHIFT)
        self._free: dict[tuple[tuple[int, int], bool, int], list[int]] = {}
        self._blocks: dict[int, Block] = {}  # every block, by start address
        self._starts: list[int] = []  # the same addresses, sorted: which block holds an address
        self.segments: dict[int, Segment] = {}
        self.allocated = 0  # block bytes held by tensors (max_memory_allocated's stat)
        self.requested = 0
        self.reserved = 0
        self.cached_bytes = 0  # reserved bytes in free lists
        # per (pool, small?, stream): [segments, reserved bytes, allocated bytes]
        self.groups: dict[tuple[tuple[int, int], bool, int], list[int]] = {}
        self._next_synthetic = 1 << 48

    # -- sizes -------------------------------------------------------------------------

    def round_size(self, size: int) -> int:
        """The block size a request of ``size`` bytes is rounded to."""
        if size < MIN_BLOCK:
            return MIN_BLOCK
        if not self._any_divisions:
            return (size + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK
        divisions = self._divisions(size)
        if divisions > 1 and size > MIN_BLOCK * divisions:
            return self._roundup_power2_next_division(size, divisions)
        return MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)

    def _divisions(self, size: int) -> int:
        table = self.settings.roundup_power2_divisions
        if not table:
            return 0
        # slot i covers [2^i MiB, 2^(i+1) MiB); smaller sizes use slot 0, larger the last
        index = max(0, size.bit_length() - 21)
        return table[min(index, len(table) - 1)]

    @staticmethod
    def _roundup_power2_next_division(size: int, divisions: int) -> int:
        if size & (size - 1) == 0:
            return size
        power2_floor = 1 << (size.bit_length() - 1)
        step = max(power2_floor // divisions, 1)
        return power2_floor + step * ((size - power2_floor + step - 1) // step)

    @staticmethod
    def segment_size(rounded: int) -> int:
        """How much a new segment for a block of ``rounded`` bytes obtains from the device."""
        if rounded <= SMALL_SIZE:
            return SMALL_BUFFER
        if rounded < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return ROUND_LARGE * ((rounded + ROUND_LARGE - 1) // ROUND_LARGE)

    # -- state ---------------------------------------------------------------------------

    def add_segment(self, addr: int, total: int, stream: int = 0,
                    pool: tuple[int, int] = DEFAULT_POOL, small: bool | None = None,
                    expandable: bool = False) -> Segment:
        """Add a segment of ``total`` free bytes (a cudaMalloc, or one found in a recording)."""
        small = total <= SMALL_BUFFER if small is None else small
        seg = Segment(addr, total, stream, pool, small, expandable)
        seg.free_keys = self._free.setdefault((pool, small, stream), [])
        block = Block(addr, total, seg)
        seg.first = block
        self.segments[addr] = seg
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
        self.reserved -= seg.total
        seg.group[0] -= 1
        seg.group[1] -= seg.total

    def block_at(self, addr: int) -> Block | None:
        return self._blocks.get(addr)

    def containing(self, addr: int) -> Block | None:
        """The block whose range holds ``addr``."""
        i = bisect.bisect_right(self._starts, addr) - 1
        block = self._blocks[self._starts[i]] if i >= 0 else None
        return block if block is not None and addr < block.addr + block.size else None

    def free_stats(self) -> FreeBlockStats:
        """Cached free memory now: total, largest block (what a request can get), count."""
        largest, count = 0, 0
        for keys in self._free.values():
            if keys:
                count += len(keys)
                largest = max(largest, keys[-1] >> _KEY_SHIFT)
        return FreeBlockStats(self.cached_bytes, largest, count)

    # -- policy --------------------------------------------------------------------------

    def find_free(self, rounded: int, stream: int, pool: tuple[int, int]) -> Block | None:
        """The cached block best fit would take for ``rounded`` bytes, or None."""
        small = rounded <= SMALL_SIZE
        if self.limit is not None and not small and pool == DEFAULT_POOL:
            self._gc_clock += 1
        keys = self._free.get((pool, small, stream))
        if not keys:
            return None
        i = bisect_left(keys, rounded << _KEY_SHIFT)
        if i == len(keys):
            return None
        if self._expandable:
            # A block before unmapped pages counts as big as it could grow: holes come first.
            while (i + 1 < len(keys)
                   and self._growable_size(keys[i + 1]) < self._growable_size(keys[i])):
                i += 1
        key = keys[i]
        size = key >> _KEY_SHIFT
        if rounded < self.max_split <= size:
            return None  # no oversize block for a request that would split it
        if rounded >= self.max_split and size >= rounded + LARGE_BUFFER:
            return None  # an oversize request takes an oversize block only if it is close
        return self._blocks[key & _ADDR_MASK]

    def _growable_size(self, key: int) -> int:
        block = self._blocks[key & _ADDR_MASK]
        return (key >> _KEY_SHIFT) + (_UNMAPPED_SPACE if block.seg.expandable
                                      and block.next is None else 0)

    def malloc(self, requested: int, stream: int = 0, pool: tuple[int, int] = DEFAULT_POOL,
               at: int | None = None) -> Block:
        """Allocate ``requested`` bytes; ``at`` forces the address a recording chose."""
        rounded = self.round_size(requested)
        if at is None:
            block = self.find_free(rounded, stream, pool)
            if block is None:
                block = self._grow_for(rounded, stream, pool, requested)
        else:
            block = self._blocks.get(at)
            if block is None or not block.cached:
                block = self._carve(at)
        assert block is not None
        return self.allocate_from(block, requested, rounded)

    def _grow_for(self, rounded: int, stream: int, pool: tuple[int, int], requested: int
                  ) -> Block:
        """Obtain device memory for ``rounded`` bytes, releasing cache under a limit first."""
        expandable = self._expandable
        need = self.grow_plan(rounded, stream, pool)[1] if expandable else \
            self.segment_size(rounded)
        if self.limit is not None and self.reserved + need > self.limit:
            if self.settings.garbage_collection_threshold > 0:
                self._collect_garbage()
            if self.reserved + need > self.limit:
                self._release_oversize(rounded, stream, pool)
            if self.reserved + need > self.limit:
                self.release_cached()
                need = self.grow_plan(rounded, stream, pool)[1] if expandable else need
            if self.reserved + need > self.limit:
                raise OutOfMemory(requested, self.segment_size(rounded), self.allocated,
                                  self.reserved)
        if expandable:
            return self._grow(rounded, stream, pool)
        seg = self.add_segment(self._synthetic_address(rounded), need, stream, pool,
                               rounded <= SMALL_SIZE)
        assert seg.first is not None
        return seg.first

    def _collect_garbage(self) -> None:
        """Free cached whole segments of the default large pool, oldest first, down to
        ``garbage_collection_threshold`` of the limit (``garbage_collect_cached_blocks``)."""
        assert self.limit is not None
        threshold = int(self.settings.garbage_collection_threshold * self.limit)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        # in the order of (stream, size, address)
        candidates = [self._blocks[k & _ADDR_MASK]
                      for (pool, small, _), keys in sorted(self._free.items())
                      if pool == DEFAULT_POOL and not small for k in keys]
        candidates = [b for b in candidates if b.prev is None and b.next is None
                      and not b.seg.expandable]
        ages = {b.addr: self._gc_clock - b.gc_base for b in candidates}
        total_age, count, reclaimed, freed = sum(ages.values()), len(candidates), 0, True
        while reclaimed < target and freed and count:
            average, freed = total_age / count, False
            for block in list(candidates):
                if ages[block.addr] >= average:
                    freed = True
                    reclaimed += block.size
                    total_age -= ages[block.addr]
                    count -= 1
                    candidates.remove(block)
                    self.remove_segment(block.seg)

    def _release_oversize(self, rounded: int, stream: int, pool: tuple[int, int]) -> None:
        """Free cached oversize segments of the request's pool and stream, the smallest one
        that is big enough, else the largest down (``release_available_cached_blocks``)."""
        if self.settings.max_split_size is None:
            return
        keys = self._free.get((pool, rounded <= SMALL_SIZE, stream), [])
        want = max(rounded, self.max_split)
        i = bisect_left(keys, want << _KEY_SHIFT)
        if i < len(keys):
            self._release_whole(self._blocks[keys[i] & _ADDR_MASK])
            return
        released = 0
        for key in reversed(keys[:i]):
            size = key >> _KEY_SHIFT
            if released >= want or size < self.max_split:
                break
            released += size
            self._release_whole(self._blocks[key & _ADDR_MASK])

    def _release_whole(self, block: Block) -> None:
        """Give a free block's segment back, if the block is all of it (oversize blocks are)."""
        if block.prev is None and block.next is None and not block.seg.expandable:
            self.remove_segment(block.seg)

    def allocate_from(self, block: Block, requested: int, rounded: int) -> Block:
        """Allocate ``requested`` (rounded to ``rounded``) bytes from the free ``block``."""
        self._remove_free(block)
        remaining = block.size - rounded
        if (remaining >= MIN_BLOCK if block.seg.small or self._expandable
                else rounded < self.max_split and remaining > SMALL_SIZE):  # should_split
            self._split(block, rounded)
        return self._hand_out(block, requested)

    def occupy(self, addr: int, size: int, requested: int, counted: bool = True) -> Block:
        """Take ``[addr, addr + size)`` as found in a recording's state.

        ``counted=False`` is a block whose free was requested but not yet completed:
        not allocated any more, not reusable yet.
        """
        block = self._hand_out(self._take(addr, size), requested)
        if not counted:
            self.release_stats(block)
        return block

    def free(self, block: Block) -> None:
        """Return a block to its pool, merging it with free neighbours (free_completed)."""
        if block.allocated:
            self.release_stats(block)
        before, after = block.prev, block.next
        if before is not None and before.cached and before.mapped == block.mapped:
            self._merge(block, before)
        if after is not None and after.cached and after.mapped == block.mapped:
            self._merge(block, after)
        block.cached = True
        self._insert_free(block)

    def release_stats(self, block: Block) -> None:
        """Stop counting ``block`` as allocated (free_requested); it is reused only once freed."""
        size = block.size
        block.allocated = False
        self.allocated -= size
        block.seg.group[2] -= size
        self.requested -= block.requested

    # -- expandable segments --------------------------------------------------------------

    @staticmethod
    def page_size(small: bool) -> int:
        return SMALL_BUFFER if small else LARGE_BUFFER

    def map_pages(self, addr: int, size: int, stream: int = 0,
                  pool: tuple[int, int] = DEFAULT_POOL, small: bool | None = None) -> Segment:
        """Map ``size`` bytes at ``addr`` (segment_map): grow the range it extends, or start one.

        Each contiguous mapped range is one segment, as snapshots report them.
        """
        for seg in self.segments.values():
            if seg.expandable and seg.stream == stream and seg.addr + seg.total == addr:
                break
        else:
            small = size % LARGE_BUFFER != 0 if small is None else small
            return self.add_segment(addr, size, stream, pool, small, expandable=True)
        last = seg.first
        while last is not None and last.next is not None:
            last = last.next
        assert last is not None
        if last.cached:
            self._remove_free(last)
            last.size += size
            self._insert_free(last)
        else:
            tail = Block(addr, size, seg)
            tail.prev, last.next = last, tail
            self._index(tail)
            self._insert_free(tail)
        seg.total += size
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
                b = b.next
            self.segments[part.addr] = part
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
        last = seg.blocks()[-1]
        free_tail = last.size if last.cached else 0
        return seg.addr + seg.total - free_tail, -(-(rounded - free_tail) // page) * page

    def _grow(self, rounded: int, stream: int, pool: tuple[int, int]) -> Block:
        addr, need = self.grow_plan(rounded, stream, pool)
        last = self.block_at(addr) if addr >= 0 else None
        map_at = self._synthetic_address(1 << 40) if addr < 0 else addr + (last.size if last else 0)
        seg = self.map_pages(map_at, need, stream, pool, rounded <= SMALL_SIZE)
        return seg.blocks()[-1]

    def release_cached(self) -> int:
        """Free every wholly free segment and unmap the free pages of expandable ones.

        What ``torch.cuda.empty_cache()`` and the last out-of-memory retry do; returns
        the bytes released.
        """
        before = self.reserved
        pages = []
        for seg in list(self.segments.values()):
            if seg.expandable:
                page = self.page_size(seg.small)
                for b in seg.blocks():
                    lo, hi = -(-b.addr // page) * page, (b.addr + b.size) // page * page
                    if b.cached and hi > lo:
                        pages.append((lo, hi - lo))
            elif seg.first is not None and seg.first.next is None and seg.first.cached:
                self.remove_segment(seg)
        for addr, size in pages:
            self.unmap_pages(addr, size)
        return before - self.reserved

    # -- internals -----------------------------------------------------------------------

    def _merge(self, block: Block, other: Block) -> None:
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
        rest = Block(block.addr + size, block.size - size, block.seg, block.mapped)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        self._index(rest)
        self._insert_free(rest)
        return rest

    def _hand_out(self, block: Block, requested: int) -> Block:
        size = block.size
        block.cached = False
        block.allocated = True
        block.requested = requested
        self.allocated += size
        block.seg.group[2] += size
        self.requested += requested
        return block

    def _index(self, block: Block) -> None:
        self._blocks[block.addr] = block
        insort(self._starts, block.addr)

    def _unindex(self, addr: int) -> None:
        del self._blocks[addr]
        del self._starts[bisect_left(self._starts, addr)]

    def _insert_free(self, block: Block) -> None:
        size = block.size
        insort(block.seg.free_keys, size << _KEY_SHIFT | block.addr)
        block.gc_base = self._gc_clock
        self.cached_bytes += size

    def _remove_free(self, block: Block) -> None:
        size = block.size
        keys = block.seg.free_keys
        key = size << _KEY_SHIFT | block.addr
        i = bisect_left(keys, key)
        if i < len(keys) and keys[i] == key:
            del keys[i]
            self.cached_bytes -= size

    def _synthetic_address(self, size: int) -> int:
        """An address for a segment the simulator creates, apart from every other one."""
        addr = self._next_synthetic
        self._next_synthetic += max(self.segment_size(size), size) + ROUND_LARGE
        return addr
