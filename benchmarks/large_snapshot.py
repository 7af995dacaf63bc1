"""Build a large, realistic snapshot for the benchmarks: a real run's step, many times over.

The allocation program (sizes, stacks, and which block each free releases) of a real
fixture's trace is replayed through memprof's allocator simulator several times, so
the result is a self-consistent PyTorch snapshot with as many events as asked for.
Stacks are new lists of shared frame dicts, as in real dumps.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from memprof.analysis.allocator import CachingAllocator

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT.parent / "shared" / "fixtures" / "snapshots" / \
    "MAGMA27+assignment2-systems+memory_snapshot.pickle"


class _Refuse(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"{module}.{name}")


def build(path: Path, events: int = 1_000_000, source: Path = FIXTURE) -> Path:
    """Write a snapshot of at least ``events`` trace events to ``path``."""
    raw = _Refuse(source.open("rb")).load()
    program = []  # ("alloc", size, frames, key) / ("free", key)
    open_keys: dict[int, int] = {}
    for i, e in enumerate(raw["device_traces"][0]):
        if e["action"] == "alloc":
            open_keys[e["addr"]] = i
            program.append(("alloc", e["size"], e.get("frames") or [], i))
        elif e["action"] == "free_requested" and e["addr"] in open_keys:
            program.append(("free", open_keys.pop(e["addr"]), e.get("frames") or []))
    alloc = CachingAllocator()
    trace: list[dict] = []
    time_us = 1_700_000_000_000_000
    while len(trace) < events:
        live = {}
        for step in program:
            time_us += 3
            if step[0] == "alloc":
                _, size, frames, key = step
                before = set(alloc.segments)
                block = alloc.malloc(size)
                for addr in set(alloc.segments) - before:
                    trace.append(_event("segment_alloc", addr, alloc.segments[addr].total,
                                        time_us, []))
                trace.append(_event("alloc", block.addr, size, time_us, frames))
                live[key] = block
            else:
                _, key, frames = step
                block = live.pop(key)
                trace.append(_event("free_requested", block.addr, block.requested, time_us,
                                    frames))
                trace.append(_event("free_completed", block.addr, block.requested, time_us,
                                    frames))
                alloc.free(block)
        for block in live.values():  # the step's survivors die before the next step
            trace.append(_event("free_requested", block.addr, block.requested, time_us, []))
            trace.append(_event("free_completed", block.addr, block.requested, time_us, []))
            alloc.free(block)
    segments = [{
        "device": 0, "address": s.addr, "total_size": s.total, "allocated_size": 0,
        "active_size": 0, "requested_size": 0, "stream": 0,
        "segment_type": "small" if s.small else "large", "segment_pool_id": (0, 0),
        "is_expandable": False, "frames": [],
        "blocks": [{"address": s.addr, "size": s.total, "requested_size": 0,
                    "state": "inactive", "frames": []}],
    } for s in alloc.segments.values()]
    snapshot = {"segments": segments, "device_traces": [trace],
                "allocator_settings": raw.get("allocator_settings"), "external_annotations": []}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        pickle.dump(snapshot, f, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def _event(action: str, addr: int, size: int, time_us: int, frames: list) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us,
            "frames": list(frames)}


if __name__ == "__main__":
    out = build(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks" / "data" /
                "large.pickle")
    print(out)
