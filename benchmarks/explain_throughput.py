"""`memprof explain --json` against a bare restricted load of the same 1M-event snapshot.

Usage: python benchmarks/explain_throughput.py [EVENTS]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from large_snapshot import ensure
from measure import machine, run, write_table

HERE = Path(__file__).resolve().parent


def main() -> None:
    events, snapshot = ensure(sys.argv)
    size_mib = snapshot.stat().st_size / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        run([sys.executable, str(HERE / "load_snapshot.py"), str(snapshot)])  # warm the cache
        load = run([sys.executable, str(HERE / "load_snapshot.py"), str(snapshot)], repeat=3)
        explain = run([sys.executable, "-m", "memprof", "explain", str(snapshot), "--json",
                       "-o", str(Path(tmp) / "report.json"), "--force"], repeat=3)
    rows = [
        ["bare restricted load", f"{load.seconds:.2f}", f"{load.peak_rss_mib:.0f}", "1.00",
         "1.00"],
        ["memprof explain --json", f"{explain.seconds:.2f}", f"{explain.peak_rss_mib:.0f}",
         f"{explain.seconds / load.seconds:.2f}",
         f"{explain.peak_rss_mib / load.peak_rss_mib:.2f}"],
    ]
    write_table("explain_throughput",
                ["run", "seconds", "peak RSS (MiB)", "time ratio", "RSS ratio"], rows,
                f"Snapshot: {events:,} trace events ({size_mib:.0f} MiB pickle), built by"
                " benchmarks/large_snapshot.py from a real fixture's step. Both are fresh"
                " processes, medians of three measured in one run, interpreter start-up included."
                f" Targets: time ratio <= 2.0, RSS ratio <= 1.5. Machine: {machine()}.")


if __name__ == "__main__":
    main()
