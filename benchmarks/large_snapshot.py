"""Build a large, realistic snapshot for the benchmarks: a real run's step, many times over.

The allocations and frees of a real fixture's trace (sizes, stacks, pairing) are
repeated until there are enough events, then laid out by memprof's allocator
simulator, so the result is a self-consistent PyTorch snapshot. Stacks are new lists
of shared frame dicts, as in real dumps. Once the allocator settles, every step is the same
as the one before, as in a training loop of fixed shapes; a ``varied`` snapshot scales each
step's sizes by a factor drawn for the step (a sequence length that changes from batch to
batch), so that no step repeats another.
"""

from __future__ import annotations

import pickle
import random
import sys
from pathlib import Path

from load_snapshot import Refuse

from memprof.analysis.layout import lay_out
from memprof.trace.events import Stack, TraceEvent, as_snapshot_events

ROOT = Path(__file__).resolve().parent.parent
SCALES = (0.5, 0.625, 0.75, 0.875, 1.0)  # of a varied snapshot's steps' sizes
FIXTURE = ROOT.parent / "shared" / "fixtures" / "snapshots" / \
    "MAGMA27+assignment2-systems+memory_snapshot.pickle"


def ensure(argv: list[str]) -> tuple[int, Path]:
    """The event count asked for on the command line (default 1,000,000) and its snapshot,
    built on first use under benchmarks/data/."""
    events = int(argv[1]) if len(argv) > 1 else 1_000_000
    return events, snapshot_of(events)


def snapshot_of(events: int, varied: bool = False) -> Path:
    """The snapshot of ``events`` events under benchmarks/data/, built on first use (10M
    events take about 4 minutes and 8.3 GiB to build)."""
    path = ROOT / "benchmarks" / "data" / f"large-{'varied-' if varied else ''}{events}.pickle"
    if not path.exists():
        build(path, events, varied=varied)
    return path


def build(path: Path, events: int = 1_000_000, source: Path = FIXTURE, varied: bool = False
          ) -> Path:
    """Write a snapshot of at least ``events`` trace events to ``path``."""
    draw = random.Random(20261127)
    raw = Refuse(source.open("rb")).load()
    step = [e for e in raw["device_traces"][0]
            if e["action"] in ("alloc", "free_requested", "free_completed")]
    program: list[TraceEvent] = []
    repeat, time_us = 0, 1_700_000_000_000_000
    stacks: dict[int, Stack] = {}  # the recorders' form of each distinct frame list, shared

    def stack_of(event: dict) -> Stack:
        frames = event.get("frames", [])
        if id(frames) not in stacks:
            stacks[id(frames)] = tuple((f["name"], f["filename"], f["line"]) for f in frames)
        return stacks[id(frames)]

    while len(program) < events:
        live: dict[int, dict] = {}
        scale = draw.choice(SCALES) if varied else 1.0
        for e in step:
            ident = (repeat, e["addr"])
            if e["action"] == "alloc":
                live[e["addr"]] = e
            elif e["addr"] not in live:
                continue  # freed before the recorded step began
            time_us += 3
            program.append((e["action"], ident, int(e["size"] * scale), 0, time_us,
                            stack_of(e)))
            if e["action"] == "free_completed":
                del live[e["addr"]]
        for addr, e in live.items():  # the step's survivors die before the next step
            for action in ("free_requested", "free_completed"):
                program.append((action, (repeat, addr), int(e["size"] * scale), 0, time_us,
                                ()))
        repeat += 1
    layout = lay_out(program, consume=True)
    snapshot = {"segments": layout.segments, "device_traces": [as_snapshot_events(layout.trace)],
                "allocator_settings": raw.get("allocator_settings"), "external_annotations": []}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        pickle.dump(snapshot, f, protocol=pickle.HIGHEST_PROTOCOL)
    return path


if __name__ == "__main__":
    print(ensure(sys.argv)[1])
