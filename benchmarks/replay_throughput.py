"""Allocator replay speed on the 1M-event snapshot, against the time to load its pickle.

Usage: python benchmarks/replay_throughput.py [EVENTS]
"""

from __future__ import annotations

import sys
import time

from large_snapshot import ensure
from measure import machine, write_table

from memprof.analysis.replay import replay
from memprof.trace.load import load_raw
from memprof.trace.normalize import normalize


def main() -> None:
    _, snapshot = ensure(sys.argv)
    load_raw(snapshot)  # warm the file cache
    t = time.perf_counter()
    raw = load_raw(snapshot)
    load_s = time.perf_counter() - t
    trace = normalize(raw)
    del raw
    device = trace.traces[0]
    t = time.perf_counter()
    result = replay(device, trace.segments_of(0), trace.settings)
    replay_s = time.perf_counter() - t
    c = result.check
    rows = [
        ["restricted load of the pickle", f"{load_s:.2f}", f"{len(device) / load_s:,.0f}",
         "1.00"],
        ["replay (check mode)", f"{replay_s:.2f}", f"{len(device) / replay_s:,.0f}",
         f"{replay_s / load_s:.2f}"],
    ]
    write_table("replay_throughput", ["step", "seconds", "events/s", "ratio to load"], rows,
                f"{len(device):,} events; decisions reproduced {c.decisions_matched:,}/"
                f"{c.decisions_total:,}, addresses {c.addresses_matched:,}/{c.addresses_total:,}."
                " Measured in one run, in one process. Target: ratio <= 1.0."
                f" Machine: {machine()}.")


if __name__ == "__main__":
    main()
