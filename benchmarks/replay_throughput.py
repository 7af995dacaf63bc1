"""Allocator replay speed on the 1M-event snapshot, against the time to load its pickle.

Three runs of each, in one process, the median reported: this machine's timings vary by
tens of percent from run to run. The load is the bare restricted unpickle (as
benchmarks/load_snapshot.py does); the replay runs as `memprof explain` runs it, with
the cyclic garbage collector paused.

Usage: python benchmarks/replay_throughput.py [EVENTS]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from large_snapshot import ensure
from load_snapshot import Refuse
from measure import machine, write_table

from memprof.analysis.replay import Replay, replay
from memprof.trace.load import gc_paused, load_raw
from memprof.trace.model import Snapshot
from memprof.trace.normalize import normalize


def _median_seconds(work: Callable[[], object], runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        work()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _bare_load(path: Path) -> object:
    with path.open("rb") as f:
        return Refuse(f).load()


def _replay_paused(trace: Snapshot) -> Replay:
    with gc_paused():
        return replay(trace.traces[0], trace.segments_of(0), trace.settings)


def main() -> None:
    _, snapshot = ensure(sys.argv)
    load_s = _median_seconds(lambda: _bare_load(snapshot))
    trace = normalize(load_raw(snapshot))
    device = trace.traces[0]
    replay_s = _median_seconds(lambda: _replay_paused(trace))
    c = _replay_paused(trace).check
    rows = [
        ["restricted load of the pickle", f"{load_s:.2f}", f"{len(device) / load_s:,.0f}",
         "1.00"],
        ["replay (check mode)", f"{replay_s:.2f}", f"{len(device) / replay_s:,.0f}",
         f"{replay_s / load_s:.2f}"],
    ]
    write_table("replay_throughput", ["step", "seconds", "events/s", "ratio to load"], rows,
                f"{len(device):,} events; decisions reproduced {c.decisions_matched:,}/"
                f"{c.decisions_total:,}, addresses {c.addresses_matched:,}/{c.addresses_total:,}."
                " Medians of three, measured in one run, in one process. Target: ratio <= 1.0."
                f" Machine: {machine()}.")


if __name__ == "__main__":
    main()
