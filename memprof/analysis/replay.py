"""Replay a device's trace through the allocator simulator.

The trace is a ring buffer: blocks and segments may predate its first event. The
state at the first event is rebuilt backwards from the final segments, then the
events are replayed forwards. At each allocation the simulator's own choice is
compared with the recorded one (check mode), then the recorded choice is applied,
so one divergence never cascades. The result gives exact block bytes per
allocation, the allocated/reserved timelines and the allocator state at the peak.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from memprof.analysis.allocator import CachingAllocator
from memprof.analysis.blocks import DEFAULT_POOL, SMALL_BUFFER, Block, FreeBlockStats
from memprof.analysis.repeats import Boundary, Skipper, find_repeat
from memprof.analysis.window_start import InitialBlock, rebuild_start
from memprof.trace.model import Action, AllocatorSettings, DeviceTrace, Segment


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
    # allocations placed by the common path (``take_best_fit``: the recorded block is the
    # best fit, one search): nearly all of a real trace's, and what keeps the replay fast
    common_path: int = 0
    # events of a repeating span filled from the period before them (``repeats.py``), not
    # replayed one by one: with the common path, what keeps a long trace's replay fast
    repeated: int = 0


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
    # int64 timelines, n + 1 long: the state before the first event, then after each event
    allocated: np.ndarray  # block bytes
    reserved: np.ndarray
    reserved_predicted: np.ndarray  # reserved had the simulator taken every decision
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
    oom_events: int = 0  # the trace's out-of-memory events; ``ooms`` holds the first MAX_OOMS


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
_FREE_BOTH = -1  # a free_requested and its free_completed, replayed as one event
_CHUNK = 1 << 16  # events converted to Python ints at a time, to bound memory
MAX_OOMS = 16  # out-of-memory events described: a run that retries after each has more


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
        c.common_path += count
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
           settings: AllocatorSettings | None = None,
           pools: dict[int, tuple[int, int]] | None = None) -> Replay:
    """Replay ``trace`` (which ends in the state ``segments``) and check it against them;
    ``pools``: the private pool of segments the final ones lack, by address, where known."""
    settings = settings or AllocatorSettings()
    n = 0 if trace is None else len(trace)
    alloc = CachingAllocator(settings)
    codes, kept = _fuse_frees(trace) if trace is not None else (None, np.zeros(0, np.int64))
    skipper = _skipper(trace, codes, kept, settings)
    initial = rebuild_start(alloc, segments, trace,
                            range(0) if skipper is None else skipper.repeated_events())
    initial_allocated, initial_reserved = alloc.allocated, alloc.reserved
    # private pools only: most snapshots have none, and then allocations look nothing up
    pools = {**(pools or {}),
             **{s.address: s.pool_id for s in segments if s.pool_id != DEFAULT_POOL}}

    zeros = array("q", [0])
    block_size, delta_res, delta_pred = zeros * n, zeros * n, zeros * n
    end = array("q", [n]) * n
    # releases that ``end`` does not show (see allocated_changes): event -> bytes
    other_releases: dict[int, int] = {}
    unplaced: list[int] = []  # alloc events whose block the simulator could not place
    live: dict[int, tuple[Block | None, int]] = {b.addr: (alloc.block_at(b.addr), -1)
                                                 for b in initial}
    initial_by_addr = {b.addr: b for b in initial}
    decisions = _Decisions(alloc, pools, delta_pred)
    check, pending = decisions.check, decisions.pending
    reproduced = 0  # allocations where the simulator chose the recorded block, no growth
    peak_value, peak = alloc.allocated, capture(alloc, -1)
    ooms: list[Moment] = []
    oom_events = 0
    take, find_free, release_stats, free = alloc.take_best_fit, alloc.find_free, \
        alloc.release_stats, alloc.free
    alloc_code, requested_code = _ALLOC, _FREE_REQUESTED  # locals: the loop's hottest names

    position = 0
    while position < len(kept):
        assert trace is not None and codes is not None
        if skipper is not None and position == skipper.mark:
            periods = skipper.boundary(position, Boundary(
                alloc.state(), {a: start for a, (_, start) in live.items()},
                (reproduced, alloc.segment_changes, *(getattr(check, t) for t in _TALLIES)),
                (check.inconsistencies, len(unplaced), len(other_releases), len(pending),
                 check.first_mismatch or 0, check.first_address_mismatch or 0)))
            if periods:
                grown = skipper.skip(position, periods, live, _as_arrays(
                    block_size, delta_res, delta_pred), np.frombuffer(end, np.int64))
                reproduced += grown[0]
                alloc.segment_changes += grown[1]
                for name, more in zip(_TALLIES, grown[2:], strict=True):
                    setattr(check, name, getattr(check, name) + more)
                position += periods * skipper.repeat.period
                check.repeated += periods * skipper.repeat.stride
                continue
        stop = min(position + _CHUNK, len(kept))
        if skipper is not None and skipper.mark > position:
            stop = min(stop, skipper.mark)
        index = kept[position:stop]
        position = stop
        sizes = trace.size[index]
        columns = (index.tolist(), codes[index].tolist(), trace.addr[index].tolist(),
                   sizes.tolist(), trace.stream[index].tolist(), alloc.round_sizes(sizes))
        for i, action, addr, size, stream, rounded in zip(*columns, strict=True):
            if action == alloc_code:
                pool = _pool_of(alloc, pools, addr) if pools else DEFAULT_POOL
                block: Block | None = None if pending else take(addr, size, rounded, stream,
                                                                  pool)
                if block is not None:
                    reproduced += 1
                    taken = block.size
                else:
                    block, taken = decisions.allocate(i, addr, size, stream, rounded, pool,
                                                      find_free(rounded, stream, pool))
                    pending = decisions.pending
                    if block is None:
                        unplaced.append(i)
                block_size[i] = taken
                live[addr] = (block, i)
                if alloc.allocated > peak_value:
                    peak_value, peak = alloc.allocated, capture(alloc, i)
                continue
            if pending and action != _SEGMENT_ALLOC and action != _SEGMENT_MAP:
                decisions.flush()  # growth no allocation followed
                pending = decisions.pending
            if action <= _FREE_COMPLETED:  # a free requested, completed, or both at once
                entry = live.get(addr) if action == requested_code else live.pop(addr, None)
                if entry is None:
                    check.inconsistencies += 2 if action == _FREE_BOTH else 1
                    continue
                block, start = entry
                if start >= 0 and block is not None and block.allocated:  # the common case
                    end[start] = i
                    if action == requested_code:
                        release_stats(block)
                    else:
                        free(block)
                    continue
                if block is None or block.allocated:  # released now
                    if block is None:
                        alloc.allocated -= block_size[start]
                        other_releases[i] = block_size[start]
                    elif action == requested_code:
                        release_stats(block)  # else free() does it
                    if start >= 0:
                        end[start] = i
                    else:
                        initial_by_addr[addr].end = i
                        if block is not None:
                            other_releases[i] = block.size
                if action != requested_code and block is not None:
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
                oom_events += 1
                if oom_events <= MAX_OOMS:
                    ooms.append(capture(alloc, i))
    decisions.add_reproduced(reproduced)
    sizes, ends = np.frombuffer(block_size, np.int64), np.frombuffer(end, np.int64)
    return Replay(
        device=-1 if trace is None else trace.device,
        allocated=cumulative(initial_allocated,
                              allocated_changes(sizes, ends, unplaced, other_releases)),
        reserved=cumulative(initial_reserved, np.frombuffer(delta_res, np.int64)),
        reserved_predicted=cumulative(initial_reserved, np.frombuffer(delta_pred, np.int64)),
        block_size=sizes,
        end=ends,
        initial=initial,
        initial_allocated=initial_allocated,
        initial_reserved=initial_reserved,
        peak=peak,
        ooms=ooms,
        check=check,
        final=capture(alloc, n - 1),
        oom_events=oom_events,
    )


_TALLIES = ("decisions_total", "decisions_matched", "segments_predicted", "segments_recorded",
            "addresses_total", "addresses_matched")


def _skipper(trace: DeviceTrace | None, codes: np.ndarray | None, kept: np.ndarray,
             settings: AllocatorSettings) -> Skipper | None:
    """What skips the periods of the trace's repeating span, if it has one the replay can
    skip (not with expandable segments, whose mapped pages the state does not compare)."""
    if trace is None or codes is None or settings.expandable_segments:
        return None
    columns = (codes[kept], trace.addr[kept], trace.size[kept], trace.stream[kept])
    repeat = find_repeat(columns, kept, _OOM)
    return None if repeat is None else Skipper(repeat, kept)


def _as_arrays(*values: array) -> tuple[np.ndarray, ...]:
    return tuple(np.frombuffer(v, np.int64) for v in values)


def allocated_changes(block_size: np.ndarray, end: np.ndarray, unplaced: list[int],
               other_releases: dict[int, int]) -> np.ndarray:
    """The change of allocated bytes at each event, worked out after the replay rather than
    stored at each event: each placed block counts from its alloc event until ``end`` (the
    event that released it, if any); the releases of unplaced and pre-window blocks are
    ``other_releases`` (an unplaced block is released by its free request and again by its
    completion, as the replay counts it)."""
    delta = block_size.copy()
    released = np.flatnonzero(end < len(end))
    if unplaced:
        released = np.setdiff1d(released, unplaced, assume_unique=True)
    delta[end[released]] -= block_size[released]  # one block per release event
    for i, size in other_releases.items():
        delta[i] -= size
    return delta


def cumulative(start: int, deltas: np.ndarray) -> np.ndarray:
    """``start``, then ``start`` plus the running sum of ``deltas`` (one array, no copy)."""
    out = np.empty(len(deltas) + 1, np.int64)
    out[0] = 0
    np.cumsum(deltas, out=out[1:])
    out += start
    return out


def _fuse_frees(trace: DeviceTrace) -> tuple[np.ndarray, np.ndarray]:
    """The events to replay: their action codes, and their indices into ``trace``.

    A free_requested directly followed by its free_completed (the common case: no other
    stream used the block) becomes one event, ``_FREE_BOTH`` at the request's index.
    """
    action, addr = trace.action, trace.addr
    both = np.flatnonzero((action[:-1] == _FREE_REQUESTED) & (action[1:] == _FREE_COMPLETED)
                          & (addr[:-1] == addr[1:]))
    codes = action.copy()
    codes[both] = _FREE_BOTH
    keep = np.ones(len(action), bool)
    keep[both + 1] = False
    return codes, np.flatnonzero(keep)


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
