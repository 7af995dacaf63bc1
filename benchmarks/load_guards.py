"""What loading untrusted files safely costs: memprof's guarded load against a bare one.

The guards: one pass counting the tuple opcodes (the bound on nesting that sizes the
unpickling thread's stack) and an address-space cap while unpickling. Measured on the
same 1M-event snapshot as explain_throughput.

Usage: python benchmarks/load_guards.py [EVENTS]
"""

from __future__ import annotations

import sys
from pathlib import Path

from large_snapshot import ensure
from measure import machine, run, write_table

HERE = Path(__file__).resolve().parent
GUARDED = "import sys; from memprof.trace.load import load_raw; load_raw(sys.argv[1])"
UNGUARDED = ("import gc, pickle, sys; gc.disable(); from memprof.trace.unpickle import"
             " _NoClassesUnpickler as U; U(open(sys.argv[1], 'rb')).load()")
COUNT = ("import sys; from memprof.trace.unpickle import nesting_bound;"
         " nesting_bound(open(sys.argv[1], 'rb'))")


def main() -> None:
    events, snapshot = ensure(sys.argv)
    size_mib = snapshot.stat().st_size / 2**20
    bare_cmd = [sys.executable, str(HERE / "load_snapshot.py"), str(snapshot)]
    run(bare_cmd)  # warm the page cache
    bare = run(bare_cmd, repeat=3)
    paused = run([sys.executable, "-c", UNGUARDED, str(snapshot)], repeat=3)
    guarded = run([sys.executable, "-c", GUARDED, str(snapshot)], repeat=3)
    count = run([sys.executable, "-c", COUNT, str(snapshot)], repeat=3)
    start = run([sys.executable, "-c", "import memprof.trace.load"], repeat=3)
    rows = [
        ["bare restricted load", f"{bare.seconds:.2f}", f"{bare.peak_rss_mib:.0f}", "1.00",
         "1.00"],
        *([name, f"{r.seconds:.2f}", f"{r.peak_rss_mib:.0f}", f"{r.seconds / bare.seconds:.2f}",
           f"{r.peak_rss_mib / bare.peak_rss_mib:.2f}"]
          for name, r in (("the same load, garbage collector paused (no guards)", paused),
                          ("memprof load_raw (gc paused, guarded)", guarded))),
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
                f" {guarded.peak_rss_mib / paused.peak_rss_mib:.2f}x RSS. Fresh processes, medians of three measured in one"
                f" run, interpreter start-up included. Machine: {machine()}.")


if __name__ == "__main__":
    main()
