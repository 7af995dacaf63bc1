"""Replay a trace under other allocator settings, or on a smaller device: the peak reserved
memory they would give, and whether it would run out of memory.

A recorded out-of-memory event is the request that failed: the replay asks for it too
(and gives it back at once: the script never held it), so a device that could not have
placed it runs out there. ``unfragmented`` asks whether a failed request would have fit
the same device with expandable segments: fragmentation if so, else a shortage.

No recorded address is used: the simulator places every block itself. Blocks that
predate the window are allocated first, in address order, since their history under
other settings is unknown. Where the recording released cached memory
(``empty_cache()`` or an out-of-memory retry), the simulation releases too.
"""

from __future__ import annotations

from dataclasses import replace

from memprof.analysis.allocator import CachingAllocator
from memprof.analysis.blocks import DEFAULT_POOL, Block, OutOfMemory
from memprof.analysis.findings import WhatIf
from memprof.analysis.replay import Replay
from memprof.trace.model import Action, AllocatorSettings, DeviceTrace

_RELEASES = (Action.SEGMENT_FREE, Action.SEGMENT_UNMAP)


def what_if(trace: DeviceTrace, result: Replay, settings: AllocatorSettings,
            baseline: WhatIf | None = None, device_memory: int | None = None) -> WhatIf:
    """Peak allocated and reserved bytes if ``trace`` ran under ``settings``; with
    ``device_memory``, also where it would run out of memory on a device that small."""
    alloc = CachingAllocator(settings, device_memory)
    blocks: dict[int, Block] = {}
    name = settings.conf or "defaults"
    try:
        for b in sorted(result.initial, key=lambda b: b.addr):
            blocks[b.addr] = alloc.malloc(b.requested)
            if not b.counted:
                alloc.release_stats(blocks[b.addr])
    except OutOfMemory as oom:
        return WhatIf(name, alloc.reserved, alloc.allocated, 0, device_memory, -1, oom.requested)
    peak_allocated, peak_reserved = alloc.allocated, alloc.reserved
    releasing = False
    oom_at, oom_size = None, None
    for i, (action, addr, size, stream) in enumerate(zip(
            trace.action.tolist(), trace.addr.tolist(), trace.size.tolist(),
            trace.stream.tolist(), strict=True)):
        if action == Action.OOM:  # the request that failed: placed and given back, if it can be
            try:
                probe = alloc.malloc(size, stream)
            except OutOfMemory:
                oom_at, oom_size = i, size
                break
            peak_allocated = max(peak_allocated, alloc.allocated)
            peak_reserved = max(peak_reserved, alloc.reserved)
            alloc.release_stats(probe)
            alloc.free(probe)
        elif action == Action.ALLOC:
            try:
                blocks[addr] = alloc.malloc(size, stream)
            except OutOfMemory:
                oom_at, oom_size = i, size
                break
            if alloc.allocated > peak_allocated:
                peak_allocated = alloc.allocated
            if alloc.reserved > peak_reserved:
                peak_reserved = alloc.reserved
        elif action == Action.FREE_REQUESTED:
            block = blocks.get(addr)
            if block is not None and block.allocated:
                alloc.release_stats(block)
        elif action == Action.FREE_COMPLETED:
            block = blocks.pop(addr, None)
            if block is not None:
                alloc.free(block)
        elif action in _RELEASES and not releasing:
            alloc.release_cached()
        releasing = action in _RELEASES
    saved = baseline.peak_reserved_bytes - peak_reserved if baseline else 0
    return WhatIf(name, peak_reserved, peak_allocated, saved, device_memory, oom_at, oom_size)


def unfragmented(trace: DeviceTrace, result: Replay, settings: AllocatorSettings, oom: int,
                 limit: int) -> tuple[bool, int, int]:
    """Whether out-of-memory event ``oom`` would have fit ``limit`` bytes of reserved memory
    under expandable segments (then it was fragmentation), the bytes reserved just before
    it there, and the bytes a larger device would have needed to place it under
    ``settings`` (0 if it fits)."""
    fits, reserved, _ = _retried(trace, result, replace(settings, expandable_segments=True),
                                 oom, limit)
    short = 0 if fits else _retried(trace, result, settings, oom, limit)[2]
    return fits, reserved, short


def _retried(trace: DeviceTrace, result: Replay, settings: AllocatorSettings, oom: int,
             limit: int) -> tuple[bool, int, int]:
    """Replay to event ``oom`` with ``limit``, then its request: whether it fits, the bytes
    reserved before it, and how many more the device would need (after the allocator's
    release of its cache, as PyTorch retries)."""
    alloc = CachingAllocator(settings, limit)
    blocks: dict[int, Block] = {}
    size, stream = int(trace.size[oom]), int(trace.stream[oom])
    reserved = 0
    try:
        for b in sorted(result.initial, key=lambda b: b.addr):
            blocks[b.addr] = alloc.malloc(b.requested)
            if not b.counted:
                alloc.release_stats(blocks[b.addr])
        for action, addr, asked, on in zip(
                trace.action[:oom].tolist(), trace.addr[:oom].tolist(),
                trace.size[:oom].tolist(), trace.stream[:oom].tolist(), strict=True):
            if action == Action.ALLOC:
                blocks[addr] = alloc.malloc(asked, on)
            elif action == Action.FREE_REQUESTED and (block := blocks.get(addr)) is not None \
                    and block.allocated:
                alloc.release_stats(block)
            elif action == Action.FREE_COMPLETED and (block := blocks.pop(addr, None)):
                alloc.free(block)
        reserved = alloc.reserved
        alloc.malloc(size, stream)
    except OutOfMemory:
        rounded = alloc.round_size(size)
        need = alloc.grow_plan(rounded, stream, DEFAULT_POOL)[1] \
            if settings.expandable_segments else alloc.segment_size(rounded)
        return False, reserved, max(alloc.reserved + need - limit, 1)
    return True, reserved, 0
