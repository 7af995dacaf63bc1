"""`memprof explain --json` against a bare restricted load of the same snapshot, per size.

Usage: python benchmarks/explain_throughput.py [EVENTS ...]   (default: 1000000 10000000)

Each size is a training loop of fixed shapes (its steps repeat once the allocator settles);
the smallest also comes varied, each step's sizes scaled by a factor drawn for it, so that no
step repeats (``large_snapshot.py``): the replay then places every event.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from large_snapshot import snapshot_of
from measure import machine, run, summarise, write_table

HERE = Path(__file__).resolve().parent
PAIRS = 5  # a bare load, then explain, this many times: both see the machine's same moods


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [1_000_000, 10_000_000]
    rows = []
    for events, varied in [(e, False) for e in sizes] + [(min(sizes), True)]:
        snapshot = snapshot_of(events, varied)
        label = f"{events:,} events ({snapshot.stat().st_size / 2**20:,.0f} MiB)" \
            f"{', no step repeats' if varied else ''}"
        load_argv = [sys.executable, str(HERE / "load_snapshot.py"), str(snapshot)]
        loads, explains = [], []
        with tempfile.TemporaryDirectory() as tmp:
            run(load_argv)  # warm the page cache
            for _ in range(PAIRS):
                loads.append(run(load_argv))
                explains.append(run([sys.executable, "-m", "memprof", "explain", str(snapshot),
                                     "--json", "-o", str(Path(tmp) / "report.json"), "--force"]))
        load, explain = summarise(loads), summarise(explains)
        rows += [
            [label, "bare restricted load", f"{load.seconds:.2f}", f"{load.cpu_seconds:.2f}",
             f"{load.peak_rss_mib:,.0f}", "1.00", "1.00", "1.00"],
            [label, "memprof explain --json", f"{explain.seconds:.2f}",
             f"{explain.cpu_seconds:.2f}", f"{explain.peak_rss_mib:,.0f}",
             f"{explain.seconds / load.seconds:.2f}",
             f"{explain.cpu_seconds / load.cpu_seconds:.2f}",
             f"{explain.peak_rss_mib / load.peak_rss_mib:.2f}"],
        ]
    write_table("explain_throughput",
                ["snapshot", "run", "seconds", "CPU seconds", "peak RSS (MiB)", "time ratio",
                 "CPU time ratio", "RSS ratio"], rows,
                "Snapshots built by benchmarks/large_snapshot.py from a real fixture's step."
                f" Fresh processes, interpreter start-up included: {PAIRS} bare loads and"
                f" {PAIRS} explains alternated in one run, medians of each (peak RSS: the"
                " largest); CPU seconds (user + system) are less sensitive to other load on the"
                " machine. Targets: time ratio <= 1.2, RSS ratio <= 1.3."
                f" Machine: {machine()}.")


if __name__ == "__main__":
    main()
