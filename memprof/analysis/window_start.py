"""The allocator's state when a trace begins: a ring buffer keeps only the newest events.

Segments are the final ones with the recorded segment events undone, newest first.
Blocks: an address whose first event is a free was allocated before the window (its
size is worked out from the segment and the trace); one with no event at all kept its
final block.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from memprof.analysis.allocator import CachingAllocator
from memprof.analysis.blocks import DEFAULT_POOL, LARGE_BUFFER, SMALL_BUFFER, SMALL_SIZE
from memprof.trace.model import Action, DeviceTrace, Frames, Segment

_ALLOC, _FREE_REQUESTED, _FREE_COMPLETED = int(Action.ALLOC), int(Action.FREE_REQUESTED), \
    int(Action.FREE_COMPLETED)
_SEGMENT_ALLOC, _SEGMENT_FREE = int(Action.SEGMENT_ALLOC), int(Action.SEGMENT_FREE)
_SEGMENT_MAP, _SEGMENT_UNMAP = int(Action.SEGMENT_MAP), int(Action.SEGMENT_UNMAP)


@dataclass(slots=True)
class InitialBlock:
    """A block already allocated when the recorded window opened."""

    addr: int
    size: int
    requested: int
    end: int  # index of the event that released it; len(trace) if alive at the end
    frames: Frames
    counted: bool  # False: its free was requested before the window, not yet completed



def rebuild_start(alloc: CachingAllocator, segments: list[Segment],
                   trace: DeviceTrace | None, repeated: range = range(0)
                   ) -> list[InitialBlock]:
    """Load ``alloc`` with the state before the first event; return the blocks live then.

    Segments: the final ones with the recorded segment events undone, newest first.
    Blocks: an address whose first event is a free was allocated before the window;
    one with no event at all kept its final block. ``repeated``: events that repeat earlier
    ones (``repeats.py``), so none is an address's first.
    """
    n = 0 if trace is None else len(trace)
    segs = segments_after(segments, trace, -1)
    known = {b.address: b for s in segments for b in s.blocks if b.occupied}
    live: dict[int, tuple[int | None, int, bool]] = {
        a: (b.size, b.requested_size, b.allocated) for a, b in known.items()}
    if trace is not None and n:
        action = trace.action
        touched = np.flatnonzero(action <= _FREE_COMPLETED)
        if repeated:
            cut = np.searchsorted(touched, [repeated.start, repeated.stop])
            touched = np.concatenate((touched[:cut[0]], touched[cut[1]:]))
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


def segments_after(segments: list[Segment], trace: DeviceTrace | None, index: int
                   ) -> dict[int, tuple[int, int, tuple[int, int], bool, bool]]:
    """The segments after event ``index`` (-1: before the first): the final ``segments`` with
    the later segment events undone, newest first; by address, ``(size, stream, pool,
    small, expandable)`` (an expandable segment's mapped ranges, each apart)."""
    segs = {s.address: (s.total_size, s.stream, s.pool_id, s.is_small, s.is_expandable)
            for s in segments}
    if trace is None or not len(trace):
        return segs
    action = trace.action[index + 1:]
    for k in np.flatnonzero((action >= _SEGMENT_ALLOC) & (action <= _SEGMENT_UNMAP))[::-1]:
        i = index + 1 + int(k)
        act, addr, size = int(action[k]), int(trace.addr[i]), int(trace.size[i])
        if act == _SEGMENT_ALLOC:
            segs.pop(addr, None)
        elif act == _SEGMENT_FREE:
            segs[addr] = (size, int(trace.stream[i]), DEFAULT_POOL, size <= SMALL_BUFFER, False)
        elif act == _SEGMENT_MAP:
            _cut(segs, addr, size)
        else:
            _join(segs, addr, size, int(trace.stream[i]))
    return segs


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
