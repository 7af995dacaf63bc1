"""The caching allocator's units: segments from the device, blocks that tile them, and
the sizes that govern them (``c10/cuda/CUDACachingAllocator.cpp``)."""

from __future__ import annotations

from dataclasses import dataclass

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20  # requests up to this size use the small pool
SMALL_BUFFER = 2 << 20  # small-pool segment size
MIN_LARGE_ALLOC = 10 << 20
LARGE_BUFFER = 20 << 20
ROUND_LARGE = 2 << 20
DEFAULT_POOL = (0, 0)
# A free list orders its blocks by (size, address), packed in one int: ints compare faster
# than tuples, and a free list is searched at every allocation and free.
KEY_SHIFT = 64
ADDR_MASK = (1 << KEY_SHIFT) - 1


class Block:
    """A contiguous range of a segment, allocated or free (``slots`` for speed)."""

    __slots__ = ("addr", "allocated", "cached", "gc_base", "next", "prev", "requested", "seg",
                 "size")

    def __init__(self, addr: int, size: int, seg: Segment) -> None:
        self.addr = addr
        self.size = size
        self.seg = seg
        self.requested = 0
        self.allocated = False  # counted in the allocated stat (until free_requested)
        self.cached = True  # in its pool's free list (from free_completed on)
        self.gc_base = 0  # the large pool's search count when it was last freed
        self.prev: Block | None = None
        self.next: Block | None = None


class Segment:
    """Device memory from one cudaMalloc (or one expandable range); blocks tile it."""

    __slots__ = ("addr", "expandable", "first", "free_keys", "group", "last", "pool", "small",
                 "stream", "total")

    def __init__(self, addr: int, total: int, stream: int, pool: tuple[int, int], small: bool,
                 expandable: bool = False) -> None:
        self.addr = addr
        self.total = total
        self.stream = stream
        self.pool = pool
        self.small = small
        self.expandable = expandable
        self.first: Block | None = None
        self.last: Block | None = None  # where an expandable range grows
        self.free_keys: list[int] = []  # its pool and stream's free list, set on adding
        self.group: list[int] = [0, 0, 0]  # its (pool, stream)'s counters, set on adding

    def blocks(self) -> list[Block]:
        out, b = [], self.first
        while b is not None:
            out.append(b)
            b = b.next
        return out


@dataclass(frozen=True, slots=True)
class FreeBlockStats:
    """Cached (reserved, unallocated) memory: total, largest block, count."""

    free_bytes: int
    largest_block: int
    blocks: int


class OutOfMemory(Exception):
    """The simulated device cannot hold a request: ``torch.OutOfMemoryError`` on a real one."""

    def __init__(self, requested: int, device_alloc: int, allocated: int, reserved: int) -> None:
        super().__init__(f"out of memory: {requested} bytes requested")
        self.requested = requested
        self.device_alloc = device_alloc
        self.allocated = allocated
        self.reserved = reserved
