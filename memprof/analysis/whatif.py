"""Replay a trace under other allocator settings, or on a smaller device: the peak reserved
memory they would give, and whether it would run out of memory.

No recorded address is used: the simulator places every block itself. Blocks that
predate the window are allocated first, in address order, since their history under
other settings is unknown. Where the recording released cached memory
(``empty_cache()`` or an out-of-memory retry), the simulation releases too.
"""

from __future__ import annotations

from memprof.analysis.allocator import CachingAllocator
from memprof.analysis.blocks import Block, OutOfMemory
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
        if action == Action.ALLOC:
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
