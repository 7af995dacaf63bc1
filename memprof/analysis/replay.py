"""Replay a device's trace through the allocator simulator.

The trace is a ring buffer: blocks and segments may predate its first event. The
state at the first event is rebuilt backwards from the final segments, then the
events are replayed forwards. At each allocation the simulator's own choice is
compared with the recorded one (check mode), then the recorded choice is applied,
so one divergence never cascades. The result gives exact block bytes per
allocation, the allocated/reserved timelines and the allocator state at the peak.
"""

from __future__ import annotations

import bisect
from array import array
from dataclasses import dataclass, field

import numpy as np

from memprof.analysis.allocator import (
    DEFAULT_POOL,
    LARGE_BUFFER,
    SMALL_BUFFER,
    SMALL_SIZE,
    Block,
    CachingAllocator,
    FreeBlockStats,
)
from memprof.trace.model import Action, AllocatorSettings, DeviceTrace, Frames, Segment


@dataclass(slots=True)
class InitialBlock:
    """A block already allocated when the recorded window opened."""

    addr: int
    size: int
    requested: int
    end: int  # index of the event that released it; len(trace) if alive at the end
    frames: Frames
    counted: bool  # False: its free was requested before the window, not yet completed


@dataclass(slots=True)
class Check:
    """How well the simulator's own decisions reproduce a recording."""

    decisions_total: int = 0
    decisions_matched: int = 0
    segments_predicted: int = 0
    segments_recorded: int = 0
    addresses_total: int = 0
    addresses_matched: int = 0
    inconsistencies: int = 0
    first_mismatch: int | None = None  # first decision the simulator got wrong
    first_address_mismatch: int | None = None


@dataclass(slots=True)
class PoolState:
    """Segments of one pool and stream at a moment."""

    pool: str
    stream: int
    segments: int
    reserved_bytes: int
    allocated_bytes: int


@dataclass(slots=True)
class Moment:
    """Allocator state captured at one event (the peak, an OOM)."""

    index: int
    allocated: int
    reserved: int
    free: FreeBlockStats
    pools: list[PoolState]


@dataclass(slots=True)
class Replay:
    """The result of replaying one device's trace."""

    device: int
    allocated: np.ndarray  # int64 block bytes after each event
    reserved: np.ndarray  # int64 after each event
    reserved_predicted: np.ndarray  # int64: reserved had the simulator taken every decision
    block_size: np.ndarray  # int64 block size of each alloc event, 0 elsewhere
    end: np.ndarray  # int64: for alloc events, the index of its free (len if alive at the end)
    initial: list[InitialBlock]
    initial_allocated: int
    initial_reserved: int
    peak: Moment
    ooms: list[Moment]
    check: Check
    final: Moment
    notes: list[str] = field(default_factory=list)


def pool_name(pool: tuple[int, int], small: bool) -> str:
    kind = "small" if small else "large"
    return kind if pool == (0, 0) else f"{kind} (private pool {pool[0]},{pool[1]})"


def capture(alloc: CachingAllocator, index: int) -> Moment:
    """Summarise the allocator state now."""
    pools = [PoolState(pool_name(pool, small), stream, *v)
             for (pool, small, stream), v in sorted(alloc.groups.items()) if v[0]]
    return Moment(index, alloc.allocated, alloc.reserved, alloc.free_stats(), pools)


_ALLOC, _FREE_REQUESTED, _FREE_COMPLETED = int(Action.ALLOC), int(Action.FREE_REQUESTED), \
    int(Action.FREE_COMPLETED)
_SEGMENT_ALLOC, _SEGMENT_FREE = int(Action.SEGMENT_ALLOC), int(Action.SEGMENT_FREE)
_SEGMENT_MAP, _SEGMENT_UNMAP, _OOM = int(Action.SEGMENT_MAP), int(Action.SEGMENT_UNMAP), \
    int(Action.OOM)
_CHUNK = 1 << 16  # events converted to Python ints at a time, to bound memory


class _Decisions:
    """Allocations off the common path: the simulator's choice differs from the recorded one,
    or segment growth came before it. Keeps the check's tallies and applies the recorded
    choice, so one divergence never cascades."""

    def __init__(self, alloc: CachingAllocator, pools: dict[int, tuple[int, int]],
                 delta_pred: array) -> None:
        self.alloc = alloc
        self.pools = pools
        self.delta_pred = delta_pred
        self.check = Check()
        self.pending: list[tuple[int, int, int, int]] = []  # growth, applied after predicting

    def flush(self) -> None:
        """Apply segment growth that no allocation followed."""
        _apply_growth(self.alloc, self.pending, self.pools)
        self.pending = []

    def add_reproduced(self, count: int) -> None:
        """Count ``count`` allocations of the common path: the recorded block, predicted."""
        c = self.check
        c.decisions_total += count
        c.decisions_matched += count
        c.addresses_total += count
        c.addresses_matched += count

    def allocate(self, i: int, addr: int, size: int, stream: int, rounded: int,
                 pool: tuple[int, int], predicted: Block | None) -> tuple[Block | None, int]:
        """Tally the decision at event ``i`` and apply the recorded one: (block, its size)."""
        alloc, c, pending = self.alloc, self.check, self.pending
        if predicted is not None:
            guess_addr, guess_growth = predicted.addr, 0
        elif alloc.settings.expandable_segments:
            guess_addr, guess_growth = alloc.grow_plan(rounded, stream, pool)
        else:
            guess_addr, guess_growth = -1, alloc.segment_size(rounded)
        grown = 0
        if pending:
            if guess_addr < 0:
                guess_addr = pending[0][1]  # a new segment's address is the device's
            grown = sum(p[2] for p in pending)
            self.flush()
        c.decisions_total += 1
        c.addresses_total += 1
        if guess_growth == grown:
            c.decisions_matched += 1
        elif c.first_mismatch is None:
            c.first_mismatch = i
        if predicted is None:
            c.segments_predicted += 1
        if grown:
            c.segments_recorded += 1
        if guess_addr == addr:
            c.addresses_matched += 1
        elif c.first_address_mismatch is None:
            c.first_address_mismatch = i
        self.delta_pred[i] = guess_growth
        try:
            block = alloc.allocate_from(predicted, size, rounded) \
                if predicted is not None and guess_addr == addr and not grown \
                else alloc.malloc(size, stream, at=addr)
        except KeyError:
            c.inconsistencies += 1
            alloc.allocated += rounded
            return None, rounded
        return block, block.size


def replay(trace: DeviceTrace | None, segments: list[Segment],
           settings: AllocatorSettings | None = None) -> Replay:
    """Replay ``trace`` (which ends in the state ``segments``) and check it against them."""
    settings = settings or AllocatorSettings()
    n = 0 if trace is None else len(trace)
    alloc = CachingAllocator(settings)
    initial = _rebuild_start(alloc, segments, trace)
    initial_allocated, initial_reserved = alloc.allocated, alloc.reserved
    # private pools only: most snapshots have none, and then allocations look nothing up
    pools = {s.address: s.pool_id for s in segments if s.pool_id != DEFAULT_POOL}

    zeros = bytes(8 * n)
    block_size, delta_alloc = array("q", zeros), array("q", zeros)
    delta_res, delta_pred = array("q", zeros), array("q", zeros)
    end = array("q", [n]) * n
    live: dict[int, tuple[Block | None, int]] = {b.addr: (alloc.block_at(b.addr), -1)
                                                 for b in initial}
    initial_by_addr = {b.addr: b for b in initial}
    decisions = _Decisions(alloc, pools, delta_pred)
    check, pending = decisions.check, decisions.pending
    reproduced = 0  # allocations where the simulator chose the recorded block, no growth
    peak_value, peak = alloc.allocated, capture(alloc, -1)
    ooms: list[Moment] = []
    round_size, find_free, allocate_from = alloc.round_size, alloc.find_free, alloc.allocate_from
    release_stats, free = alloc.release_stats, alloc.free

    for base in range(0, n, _CHUNK):
        assert trace is not None
        chunk = slice(base, base + _CHUNK)
        columns = (trace.action[chunk].tolist(), trace.addr[chunk].tolist(),
                   trace.size[chunk].tolist(), trace.stream[chunk].tolist())
        for i, (action, addr, size, stream) in enumerate(zip(*columns, strict=True), base):
            if action == _ALLOC:
                rounded = round_size(size)
                pool = _pool_of(alloc, pools, addr) if pools else DEFAULT_POOL
                predicted = find_free(rounded, stream, pool)
                if predicted is not None and predicted.addr == addr and not pending:
                    reproduced += 1
                    block: Block | None = allocate_from(predicted, size, rounded)
                    taken = block.size
                else:
                    block, taken = decisions.allocate(i, addr, size, stream, rounded, pool,
                                                      predicted)
                    pending = decisions.pending
                block_size[i] = delta_alloc[i] = taken
                live[addr] = (block, i)
                if alloc.allocated > peak_value:
                    peak_value, peak = alloc.allocated, capture(alloc, i)
                continue
            if pending and action != _SEGMENT_ALLOC and action != _SEGMENT_MAP:
                decisions.flush()  # growth no allocation followed
                pending = decisions.pending
            if action in (_FREE_REQUESTED, _FREE_COMPLETED):
                completed = action == _FREE_COMPLETED
                entry = live.pop(addr, None) if completed else live.get(addr)
                if entry is None:
                    check.inconsistencies += 1
                    continue
                block, start = entry
                if block is None or block.allocated:
                    taken = block.size if block is not None else block_size[start]
                    delta_alloc[i] = -taken
                    if block is None:
                        alloc.allocated -= taken
                    else:
                        release_stats(block)
                    if start >= 0:
                        end[start] = i
                    else:
                        initial_by_addr[addr].end = i
                if completed and block is not None:
                    free(block)
            elif action in (_SEGMENT_ALLOC, _SEGMENT_MAP):
                delta_res[i] = size
                pending.append((action, addr, size, stream))
            elif action in (_SEGMENT_FREE, _SEGMENT_UNMAP):
                try:
                    if action == _SEGMENT_FREE:
                        alloc.remove_segment(alloc.segments[addr])
                    else:
                        alloc.unmap_pages(addr, size)
                    delta_res[i] = delta_pred[i] = -size
                except (KeyError, AssertionError):
                    check.inconsistencies += 1
            elif action == _OOM:
                ooms.append(capture(alloc, i))
    decisions.add_reproduced(reproduced)

    def cumulative(start: int, deltas: array) -> np.ndarray:
        return start + np.cumsum(np.frombuffer(deltas, np.int64))

    return Replay(
        device=-1 if trace is None else trace.device,
        allocated=cumulative(initial_allocated, delta_alloc),
        reserved=cumulative(initial_reserved, delta_res),
        reserved_predicted=cumulative(initial_reserved, delta_pred),
        block_size=np.frombuffer(block_size, np.int64),
        end=np.frombuffer(end, np.int64),
        initial=initial,
        initial_allocated=initial_allocated,
        initial_reserved=initial_reserved,
        peak=peak,
        ooms=ooms,
        check=check,
        final=capture(alloc, n - 1),
    )


def _pool_of(alloc: CachingAllocator, pools: dict[int, tuple[int, int]], addr: int
             ) -> tuple[int, int]:
    """The private pool of the segment that holds ``addr`` (``pools`` is keyed by segment
    address; a block inside a segment has an address of its own)."""
    block = alloc.containing(addr)
    return block.seg.pool if block is not None else pools.get(addr, DEFAULT_POOL)


def _apply_growth(alloc: CachingAllocator, growth: list[tuple[int, int, int, int]],
                  pools: dict[int, tuple[int, int]]) -> None:
    for action, addr, size, stream in growth:
        pool = pools.get(addr, DEFAULT_POOL)
        if action == _SEGMENT_ALLOC:
            alloc.add_segment(addr, size, stream, pool, size <= SMALL_BUFFER)
        else:
            alloc.map_pages(addr, size, stream, pool)


def _rebuild_start(alloc: CachingAllocator, segments: list[Segment],
                   trace: DeviceTrace | None) -> list[InitialBlock]:
    """Load ``alloc`` with the state before the first event; return the blocks live then.

    Segments: the final ones with the recorded segment events undone, newest first.
    Blocks: an address whose first event is a free was allocated before the window;
    one with no event at all kept its final block.
    """
    n = 0 if trace is None else len(trace)
    segs = {s.address: (s.total_size, s.stream, s.pool_id, s.is_small, s.is_expandable)
            for s in segments}
    known = {b.address: b for s in segments for b in s.blocks if b.occupied}
    live: dict[int, tuple[int | None, int, bool]] = {
        a: (b.size, b.requested_size, b.allocated) for a, b in known.items()}
    if trace is not None and n:
        action = trace.action
        for i in np.flatnonzero((action >= _SEGMENT_ALLOC) & (action <= _SEGMENT_UNMAP))[::-1]:
            act, addr, size = int(action[i]), int(trace.addr[i]), int(trace.size[i])
            if act == _SEGMENT_ALLOC:
                segs.pop(addr, None)
            elif act == _SEGMENT_FREE:
                segs[addr] = (size, int(trace.stream[i]), DEFAULT_POOL, size <= SMALL_BUFFER,
                              False)
            elif act == _SEGMENT_MAP:
                _cut(segs, addr, size)
            else:
                _join(segs, addr, size, int(trace.stream[i]))
        touched = np.flatnonzero(action <= _FREE_COMPLETED)
        addrs = trace.addr[touched]
        _, first = np.unique(addrs, return_index=True)
        for k in first.tolist():
            addr = int(addrs[k])
            i = int(touched[k])
            live.pop(addr, None)
            if action[i] != _ALLOC:  # freed before being allocated: it predates the window
                live[addr] = (None, int(trace.size[i]), bool(action[i] == _FREE_REQUESTED))
    for addr, (total, stream, pool, small, expandable) in sorted(segs.items()):
        if expandable:
            alloc.map_pages(addr, total, stream, pool, small)
        else:
            alloc.add_segment(addr, total, stream, pool, small)
    sizes = _pre_window_sizes(alloc, segs, live, trace)
    blocks = []
    for addr in sorted(live):
        size, requested, counted = live[addr]
        size = sizes.get(addr, size)
        assert size is not None
        try:
            alloc.occupy(addr, size, requested, counted)
        except KeyError:
            continue  # outside every known segment: the trace lost its segment event
        frames = known[addr].frames if addr in known and live[addr][0] is not None else ()
        blocks.append(InitialBlock(addr, size, requested, n, frames, counted))
    return blocks


def _cut(segs: dict[int, tuple], addr: int, size: int) -> None:
    """Remove ``[addr, addr + size)`` from the expandable ranges holding it (undo a map)."""
    stop = addr + size
    for start, (total, stream, pool, small, expandable) in list(segs.items()):
        end = start + total
        if expandable and start < stop and addr < end:
            del segs[start]
            if start < addr:
                segs[start] = (addr - start, stream, pool, small, True)
            if stop < end:
                segs[stop] = (end - stop, stream, pool, small, True)


def _join(segs: dict[int, tuple], addr: int, size: int, stream: int) -> None:
    """Add ``[addr, addr + size)`` to the expandable ranges, merging neighbours (undo an unmap)."""
    small = size % LARGE_BUFFER != 0
    for start, (total, _, _, small_, expandable) in list(segs.items()):
        if expandable and start + total == addr:
            del segs[start]
            addr, size, small = start, size + total, small_
    after = segs.pop(addr + size, None)
    if after is not None and after[4]:
        size += after[0]
    elif after is not None:
        segs[addr + size] = after
    segs[addr] = (size, stream, (0, 0), small, True)


def _pre_window_sizes(alloc: CachingAllocator, segs: dict[int, tuple],
                      live: dict[int, tuple[int | None, int, bool]],
                      trace: DeviceTrace | None) -> dict[int, int]:
    """Block sizes of the blocks allocated before the window, which no snapshot records.

    A request is rounded up; in the large pool of a non-expandable segment, PyTorch's
    ``should_split`` keeps a remainder of 1 MiB or less in the block. The block then ends
    where the next block begins: the next one alive at the window's start or, sooner, an
    allocation inside the window placed after it while it was still held (an allocation
    always takes the front of a free block, so the byte before it was occupied).
    """
    unknown = [(a, alloc.round_size(r)) for a, (size, r, _) in live.items() if size is None]
    if not unknown:
        return {}
    starts = sorted(segs)
    occupied = sorted(live)
    evidence = _allocated_after(trace, unknown)
    sizes = {}
    for addr, rounded in unknown:
        i = bisect.bisect_right(starts, addr) - 1
        start = starts[i] if i >= 0 else -1
        total, _, _, small, expandable = segs[start] if start >= 0 else (0, 0, 0, True, False)
        if small or expandable or addr >= start + total:
            sizes[addr] = rounded
            continue
        k = bisect.bisect_right(occupied, addr)
        end = min(occupied[k] if k < len(occupied) else start + total, start + total,
                  evidence.get(addr, start + total))
        gap = end - (addr + rounded)
        whole = 0 <= gap <= SMALL_SIZE or (rounded >= alloc.max_split and gap >= 0)
        sizes[addr] = end - addr if whole else rounded
    return sizes


def _allocated_after(trace: DeviceTrace | None, blocks: list[tuple[int, int]]) -> dict[int, int]:
    """For each pre-window block ``(addr, rounded)``: the lowest address in
    ``[addr + rounded, addr + rounded + 1 MiB]`` that the trace allocates while it is held."""
    if trace is None or not len(trace):
        return {}
    action = trace.action
    completed = np.flatnonzero(action == _FREE_COMPLETED)
    done_addr, first = np.unique(trace.addr[completed], return_index=True)
    allocs = np.flatnonzero(action == _ALLOC)
    order = np.argsort(trace.addr[allocs], kind="stable")
    alloc_addr, alloc_index = trace.addr[allocs][order], allocs[order]
    addr = np.array([b[0] for b in blocks], np.int64)
    low = addr + np.array([b[1] for b in blocks], np.int64)
    lo = np.searchsorted(alloc_addr, low, "left")
    hi = np.searchsorted(alloc_addr, low + SMALL_SIZE, "right")
    k = np.searchsorted(done_addr, addr)
    found = (k < len(done_addr)) & (done_addr[np.minimum(k, len(done_addr) - 1)] == addr) \
        if len(done_addr) else np.zeros(len(addr), bool)
    freed = np.where(found, completed[first[np.minimum(k, max(len(first) - 1, 0))]]
                     if len(first) else 0, len(trace))
    out = {}
    for j in np.flatnonzero(hi > lo).tolist():
        held = np.flatnonzero(alloc_index[lo[j]:hi[j]] < freed[j])
        if held.size:
            out[int(addr[j])] = int(alloc_addr[lo[j] + held[0]])
    return out
