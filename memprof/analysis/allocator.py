"""A simulator of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``).

It applies the allocator's rules to segments split into blocks (``block_table.py``):
request rounding, small/large pools per stream and private pool, best fit (smallest
block, then lowest address), splitting, oversize blocks under ``max_split_size``,
garbage collection and expandable segments. Given an address it follows a recording;
without one it predicts where the allocator would place a block.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from memprof.analysis.block_table import BlockTable
from memprof.analysis.blocks import (
    ADDR_MASK,
    DEFAULT_POOL,
    KEY_SHIFT,
    LARGE_BUFFER,
    MIN_BLOCK,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    Block,
    OutOfMemory,
)
from memprof.analysis.expandable import ExpandableSegments
from memprof.analysis.release import CacheRelease
from memprof.trace.model import AllocatorSettings


class CachingAllocator(BlockTable, ExpandableSegments, CacheRelease):
    """The allocator state of one device, with the policy of PyTorch's native backend.

    ``limit`` caps reserved memory, as ``set_per_process_memory_fraction`` (or a smaller
    card) does: growing past it first collects garbage (``garbage_collection_threshold``),
    then releases oversize and then all cached segments, then raises :class:`OutOfMemory`.
    """

    def __init__(self, settings: AllocatorSettings | None = None, limit: int | None = None
                 ) -> None:
        super().__init__()
        self.settings = settings or AllocatorSettings()
        self.limit = limit
        self.max_split = self.settings.max_split_size or (1 << 63) - 1
        self._oversize = self.settings.max_split_size is not None  # blocks may be oversize
        self._any_divisions = any(d > 1 for d in self.settings.roundup_power2_divisions)
        self._expandable = self.settings.expandable_segments
        # private pools with live users (CUDA graphs: ``cuda_graphs.py``) -> their count; their
        # cached segments are never released, as PyTorch frees a pool only once unused
        self.pools_in_use: dict[tuple[int, int], int] = {}
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

    def round_sizes(self, sizes: np.ndarray) -> list[int]:
        """:meth:`round_size` of each of ``sizes`` (int64 request sizes)."""
        if self._any_divisions:
            return list(map(self.round_size, sizes.tolist()))
        return np.maximum((sizes + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK, MIN_BLOCK).tolist()

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

    # -- policy --------------------------------------------------------------------------

    def find_free(self, rounded: int, stream: int, pool: tuple[int, int]) -> Block | None:
        """The cached block best fit would take for ``rounded`` bytes, or None."""
        small = rounded <= SMALL_SIZE
        if self.limit is not None and not small and pool == DEFAULT_POOL:
            self._gc_clock += 1
        keys = self._free.get((pool, small, stream))
        if not keys:
            return None
        i = bisect_left(keys, rounded << KEY_SHIFT)
        if i == len(keys):
            return None
        if self._expandable:
            # A block before unmapped pages counts as big as it could grow: holes come first.
            while (i + 1 < len(keys)
                   and self._growable_size(keys[i + 1]) < self._growable_size(keys[i])):
                i += 1
        key = keys[i]
        return self._blocks[key & ADDR_MASK] if self._may_take(key >> KEY_SHIFT, rounded) \
            else None

    def take_best_fit(self, at: int, requested: int, rounded: int, stream: int,
                      pool: tuple[int, int]) -> Block | None:
        """Allocate the block at ``at`` if best fit takes it, searching the free list once
        (a replay's common case); else None, with nothing changed. For an allocator
        without a memory limit."""
        if self._expandable:
            found = self.find_free(rounded, stream, pool)
            return self.allocate_from(found, requested, rounded) \
                if found is not None and found.addr == at else None
        keys = self._free.get((pool, rounded <= SMALL_SIZE, stream))
        if not keys:
            return None
        i = bisect_left(keys, rounded << KEY_SHIFT)
        if i == len(keys) or keys[i] & ADDR_MASK != at:
            return None
        if self._oversize and not self._may_take(keys[i] >> KEY_SHIFT, rounded):
            return None
        del keys[i]
        block = self._blocks[at]
        self.cached_bytes -= block.size
        return self._take_front(block, requested, rounded)

    def _may_take(self, size: int, rounded: int) -> bool:
        """Whether a free block of ``size`` bytes may serve ``rounded`` bytes (oversize rules)."""
        max_split = self.max_split
        if rounded < max_split:
            return size < max_split  # no oversize block for a request that would split it
        return size < rounded + LARGE_BUFFER  # an oversize request takes one only if close

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

    def allocate_from(self, block: Block, requested: int, rounded: int) -> Block:
        """Allocate ``requested`` (rounded to ``rounded``) bytes from the free ``block``."""
        self._remove_free(block)
        return self._take_front(block, requested, rounded)

    def _take_front(self, block: Block, requested: int, rounded: int) -> Block:
        """Hand out the front ``rounded`` bytes of ``block``, just taken off its free list."""
        seg = block.seg
        remaining = block.size - rounded
        if (remaining >= MIN_BLOCK if seg.small or self._expandable
                else rounded < self.max_split and remaining > SMALL_SIZE):  # should_split
            self._split(block, rounded)
        size = block.size
        block.cached = False
        block.allocated = True
        block.requested = requested
        self.allocated += size
        seg.group[2] += size
        return block

    def occupy(self, addr: int, size: int, requested: int, counted: bool = True) -> Block:
        """Take ``[addr, addr + size)`` as found in a recording's state.

        ``counted=False`` is a block whose free was requested but not yet completed:
        not allocated any more, not reusable yet.
        """
        block = self._take_front(self._take(addr, size), requested, size)
        if not counted:
            self.release_stats(block)
        return block

    def _synthetic_address(self, size: int) -> int:
        """An address for a segment the simulator creates, apart from every other one and
        below the last, as the CUDA driver hands out device memory."""
        self._next_synthetic -= max(self.segment_size(size), size) + ROUND_LARGE
        return self._next_synthetic
