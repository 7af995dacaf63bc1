"""Giving cached memory back to the device: under a memory limit before growing (garbage
collection, oversize blocks) and on ``torch.cuda.empty_cache()``."""

from __future__ import annotations

from bisect import bisect_left

from memprof.analysis.blocks import ADDR_MASK, DEFAULT_POOL, KEY_SHIFT, SMALL_SIZE, Block


class CacheRelease:
    """The cache-releasing operations of :class:`~memprof.analysis.allocator.CachingAllocator`
    (a mixin: it works on the allocator's segments and free lists)."""

    def _collect_garbage(self) -> None:
        """Free cached whole segments of the default large pool, oldest first, down to
        ``garbage_collection_threshold`` of the limit (``garbage_collect_cached_blocks``)."""
        assert self.limit is not None
        threshold = int(self.settings.garbage_collection_threshold * self.limit)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        # in the order of (stream, size, address)
        candidates = [self._blocks[k & ADDR_MASK]
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
        i = bisect_left(keys, want << KEY_SHIFT)
        if i < len(keys):
            self._release_whole(self._blocks[keys[i] & ADDR_MASK])
            return
        released = 0
        for key in reversed(keys[:i]):
            size = key >> KEY_SHIFT
            if released >= want or size < self.max_split:
                break
            released += size
            self._release_whole(self._blocks[key & ADDR_MASK])

    def _release_whole(self, block: Block) -> None:
        """Give a free block's segment back, if the block is all of it (oversize blocks are)."""
        if block.prev is None and block.next is None and not block.seg.expandable:
            self.remove_segment(block.seg)

    def release_cached(self) -> int:
        """Free every wholly free segment and unmap the free pages of expandable ones.

        What ``torch.cuda.empty_cache()`` and the last out-of-memory retry do (but for the
        segments of private pools in use); returns the bytes released.
        """
        before = self.reserved
        pages = []
        for seg in list(self.segments.values()):
            if seg.pool in self.pools_in_use:
                continue
            if seg.expandable:
                # pages count from the range's start (each part a cut left starts on one),
                # not from address 0: ExpandableSegment::segmentLeft/segmentRight
                page, base = self.page_size(seg.small), seg.addr
                for b in seg.blocks():
                    lo = base + -(-(b.addr - base) // page) * page
                    hi = base + (b.addr + b.size - base) // page * page
                    if b.cached and hi > lo:
                        pages.append((lo, hi - lo))
            elif seg.first is not None and seg.first.next is None and seg.first.cached:
                self.remove_segment(seg)
        for addr, size in pages:
            self.unmap_pages(addr, size)
        return before - self.reserved
