"""What loading untrusted files safely costs: memprof's guarded load against a bare one.

The guards: one pass counting the tuple opcodes (the bound on nesting that sizes the
unpickling thread's stack) and an address-space cap while unpickling. Measured on the
same 1M-event snapshot as explain_throughput.

Usage: python benchmarks/load_guards.py [EVENTS]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from large_snapshot import ensure
from measure import Run, machine, run, write_table

HERE = Path(__file__).resolve().parent
REPEAT = 5
GUARDED = ("import gc, sys; gc.disable(); from memprof.trace.load import load_raw;"
           " load_raw(sys.argv[1])")
UNGUARDED = ("import gc, pickle, sys; gc.disable(); from memprof.trace.unpickle import"
             " _NoClassesUnpickler as U; U(open(sys.argv[1], 'rb')).load()")
COUNT = ("import sys; from memprof.trace.unpickle import nesting_bound;"
         " nesting_bound(open(sys.argv[1], 'rb'))")


def main() -> None:
    events, snapshot = ensure(sys.argv)
    size_mib = snapshot.stat().st_size / 2**20
    commands = {
        "bare": [sys.executable, str(HERE / "load_snapshot.py"), str(snapshot)],
        "paused": [sys.executable, "-c", UNGUARDED, str(snapshot)],
        "guarded": [sys.executable, "-c", GUARDED, str(snapshot)],
        "count": [sys.executable, "-c", COUNT, str(snapshot)],
        "start": [sys.executable, "-c", "import memprof.trace.load"],
    }
    run(commands["bare"])  # warm the page cache
    # interleaved, so that the noise of a shared machine falls on every command alike
    runs: dict[str, list[Run]] = {name: [] for name in commands}
    for _ in range(REPEAT):
        for name, argv in commands.items():
            runs[name].append(run(argv))
    bare, paused, guarded, count, start = (
        Run(statistics.median(r.seconds for r in rs), max(r.peak_rss_mib for r in rs))
        for rs in runs.values())
    rows = [
        ["bare restricted load", f"{bare.seconds:.2f}", f"{bare.peak_rss_mib:.0f}", "1.00",
         "1.00"],
        *([name, f"{r.seconds:.2f}", f"{r.peak_rss_mib:.0f}", f"{r.seconds / bare.seconds:.2f}",
           f"{r.peak_rss_mib / bare.peak_rss_mib:.2f}"]
          for name, r in (("the same load, garbage collector paused (no guards)", paused),
                          ("memprof load_raw (the same, guarded)", guarded))),
        ["  of which: counting the tuple opcodes (with start-up)", f"{count.seconds:.2f}",
         f"{count.peak_rss_mib:.0f}", "", ""],
        ["  of which: start-up, importing memprof.trace.load", f"{start.seconds:.2f}",
         f"{start.peak_rss_mib:.0f}", "", ""],
    ]
    write_table("load_guards", ["run", "seconds", "peak RSS (MiB)", "time ratio", "RSS ratio"],
                rows,
                f"Snapshot: {events:,} trace events ({size_mib:.0f} MiB pickle), built by"
                " benchmarks/large_snapshot.py. The guards cost the difference between the"
                f" second and third rows: {guarded.seconds / paused.seconds:.2f}x time,"
                f" {guarded.peak_rss_mib / paused.peak_rss_mib:.2f}x RSS. Fresh processes,"
                " medians of five, interleaved, measured in one run, interpreter start-up included."
                f" Machine: {machine()}.")


if __name__ == "__main__":
    main()
