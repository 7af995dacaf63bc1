"""An independent computation of peak block bytes from a raw snapshot, for checking memprof.

It shares no code with memprof: it tracks occupied address ranges per segment and
sizes each block by the rule behind ``torch.cuda.max_memory_allocated()`` (requests
rounded to 512 bytes; a large-pool block whose remainder would be 1 MiB or less is
not split and counts whole; with expandable segments, always split). A block allocated
before the trace begins ends where the next block begins: one alive at the first event,
or an allocation the trace places after it while it is still held.
"""

from __future__ import annotations

import bisect

MIB = 1 << 20


def _round(n: int) -> int:
    return max(512, (n + 511) // 512 * 512)


def peak_allocated(raw: dict, device: int) -> tuple[int, int]:
    """(peak allocated block bytes, final allocated block bytes) of ``device``."""
    segments = [s for s in raw["segments"] if s["device"] == device]
    traces = raw.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    settings = raw.get("allocator_settings") or {}
    expandable = bool(settings.get("expandable_segments"))

    # segments that existed at the first event: undo segment_alloc / segment_free backwards
    seg_size = {s["address"]: (s["total_size"], s["segment_type"] == "small") for s in segments}
    for e in reversed(trace):
        if e["action"] == "segment_alloc":
            seg_size.pop(e["addr"], None)
        elif e["action"] == "segment_free":
            seg_size[e["addr"]] = (e["size"], e["size"] <= 2 * MIB)
    final_blocks = {}
    for s in segments:
        addr = s["address"]
        for b in s["blocks"]:  # 2.0 blocks have no address: they tile the segment
            if b["state"] != "inactive":
                final_blocks[b.get("address", addr)] = b
            addr = b.get("address", addr) + b["size"]
    live = {a: (b["size"], b["state"] == "active_allocated") for a, b in final_blocks.items()}
    for e in reversed(trace):
        if e["action"] == "alloc":
            live.pop(e["addr"], None)
        elif e["action"] == "free_completed":
            # negative: size still to be worked out; not counted unless its free request
            # is in the window too (the allocated stat drops at the request)
            live[e["addr"]] = (-e["size"], False)
        elif e["action"] == "free_requested" and e["addr"] in live:
            live[e["addr"]] = (live[e["addr"]][0], True)

    starts = sorted(seg_size)

    def segment_of(addr: int) -> int | None:
        i = bisect.bisect_right(starts, addr) - 1
        return starts[i] if i >= 0 and addr < starts[i] + seg_size[starts[i]][0] else None

    occupied = sorted(live)

    def block_size(addr: int, requested: int) -> int:
        rounded = _round(requested)
        seg = segment_of(addr)
        if expandable or seg is None or seg_size[seg][1]:
            return rounded
        i = bisect.bisect_right(occupied, addr)
        nxt = occupied[i] if i < len(occupied) else seg + seg_size[seg][0]
        nxt = min(nxt, seg + seg_size[seg][0])
        return nxt - addr if nxt - (addr + rounded) <= MIB else rounded

    # allocations after a pre-window block, within its unsplit remainder, while it is held
    held_before = {a: -size for a, (size, _) in live.items() if size < 0}
    ends: dict[int, int] = {}
    for e in trace:
        if e["action"] == "free_completed":
            held_before.pop(e["addr"], None)
        elif e["action"] == "alloc":
            for a, requested in held_before.items():
                lo = a + _round(requested)
                if lo <= e["addr"] <= lo + MIB and e["addr"] < ends.get(a, 1 << 64):
                    ends[a] = e["addr"]
    for a in sorted(ends):
        bisect.insort(occupied, ends[a])  # a sentinel: where the block is known to end

    sizes = {}
    for addr, (size, _) in live.items():
        sizes[addr] = block_size(addr, -size) if size < 0 else size
    for a in ends:
        occupied.pop(bisect.bisect_left(occupied, ends[a]))
    current = sum(sizes[a] for a, (_, counted) in live.items() if counted)
    peak = current
    held = {a: sizes[a] for a, (_, counted) in live.items() if counted}
    for e in trace:
        action, addr = e["action"], e.get("addr")
        if action == "segment_alloc":
            seg_size[addr] = (e["size"], e["size"] <= 2 * MIB)
            bisect.insort(starts, addr)
        elif action == "segment_free":
            seg_size.pop(addr, None)
            starts.remove(addr)
        elif action == "alloc":
            size = block_size(addr, e["size"])
            bisect.insort(occupied, addr)
            sizes[addr] = size
            held[addr] = size
            current += size
            peak = max(peak, current)
        elif action == "free_requested" and addr in held:
            current -= held.pop(addr)
        elif action == "free_completed":
            held_size = held.pop(addr, None)
            if held_size is not None:  # a free whose request predates the window
                current -= held_size
            i = bisect.bisect_left(occupied, addr)
            if i < len(occupied) and occupied[i] == addr:
                occupied.pop(i)
    return peak, current
