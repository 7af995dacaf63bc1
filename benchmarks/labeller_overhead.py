"""Cost of the CUDA path's hooks-only labeller, on the CPU: plain python vs the labeller
alone vs the CPU recorder (a dispatch mode), each running the transformer sample.

Usage: python benchmarks/labeller_overhead.py [SAMPLE ARGS...]
(default: the transformer sample at run_overhead.py's size, then tiny with many steps).
Only the recorders are timed: no analysis and no report, so the ratios are the
recording's own cost.
"""

from __future__ import annotations

import os
import runpy
import statistics
import sys
from pathlib import Path

from measure import machine, run, write_table
from run_overhead import DEFAULT_ARGS, SAMPLE

RECORDERS = ("hooks", "recorder")
ROUNDS = 5
OP_BOUND_ARGS = ["--device", "cpu", "--size", "tiny", "--steps", "300"]


def under(recorder: str, argv: list[str]) -> None:
    """Run the sample as ``__main__`` under ``recorder``, in this process."""
    from memprof.collect.cpu.recorder import CpuRecorder
    from memprof.collect.hooks.labeller import HookLabeller

    sys.argv = [str(SAMPLE), *argv]
    sys.path.insert(0, str(SAMPLE.parent))
    with HookLabeller() if recorder == "hooks" else CpuRecorder():
        runpy.run_path(str(SAMPLE), run_name="__main__")


def measure(args: list[str]) -> list[list[str]]:
    """Rows for one size of the sample: wall and CPU seconds of each command."""
    this = str(Path(__file__).resolve())
    commands = {"python sample": [sys.executable, str(SAMPLE), *args],
                "hooks-only labeller (the CUDA path's)": [sys.executable, this, "hooks", *args],
                "CPU recorder (dispatch mode + hooks)": [sys.executable, this, "recorder", *args]}
    run(commands["python sample"])  # warm the file cache and torch's first import
    # rounds interleave the commands, so that a busy spell on the machine hits them all
    runs = [[run(argv) for argv in commands.values()] for _ in range(ROUNDS)]
    wall = [statistics.median(r[i].seconds for r in runs) for i in range(len(commands))]
    cpu = [statistics.median(r[i].cpu_seconds for r in runs) for i in range(len(commands))]
    size = " ".join(args)
    return [[size, name, f"{w:.2f}", f"{w / wall[0]:.2f}", f"{c:.2f}", f"{c / cpu[0]:.2f}"]
            for name, w, c in zip(commands, wall, cpu, strict=True)]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in RECORDERS:
        under(sys.argv[1], sys.argv[2:])
        return
    os.environ["OMP_NUM_THREADS"] = "1"  # one core each: CPU time is the work done
    sizes = [sys.argv[1:]] if len(sys.argv) > 1 else [DEFAULT_ARGS, OP_BOUND_ARGS]
    rows = [row for args in sizes for row in measure(args)]
    write_table("labeller_overhead",
                ["sample args", "command", "seconds", "ratio", "CPU seconds", "CPU ratio"], rows,
                "Sample: transformer_lm.py, on the CPU, OMP_NUM_THREADS=1: at run_overhead's"
                " size (large tensors: compute dominates) and tiny with many steps (small"
                " operators: per-operator cost dominates, as on a GPU). Fresh processes, the"
                f" recorders only (no analysis, no report); medians of {ROUNDS} interleaved"
                " rounds, measured in one run. CPU seconds (user + system) are less sensitive"
                " to other load on the machine than wall seconds. Target for the CUDA path:"
                f" <= 1.05x. {machine()}.")


if __name__ == "__main__":
    main()
