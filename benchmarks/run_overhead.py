"""Wall time of `memprof run` over plain `python` on the transformer sample, in one run.

Usage: python benchmarks/run_overhead.py [SAMPLE ARGS...]
(default: the transformer sample at a size where training, not start-up, dominates)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from measure import machine, run, write_table

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_scripts" / "transformer_lm.py"
DEFAULT_ARGS = ["--device", "cpu", "--layers", "4", "--d-model", "256", "--seq", "256",
                "--batch", "8", "--steps", "10"]


def main() -> None:
    args = sys.argv[1:] or DEFAULT_ARGS
    plain_cmd = [sys.executable, str(SAMPLE), *args]
    run(plain_cmd)  # warm the file cache and torch's first import
    plain = run(plain_cmd, repeat=3)
    with tempfile.TemporaryDirectory() as tmp:
        profiled = run([sys.executable, "-m", "memprof", "run", "--device", "cpu", "--force", "-o",
                        str(Path(tmp) / "run"), str(SAMPLE), *args], repeat=3)
    rows = [
        ["python sample", f"{plain.seconds:.2f}", "1.00"],
        ["memprof run sample (CPU recorder)", f"{profiled.seconds:.2f}",
         f"{profiled.seconds / plain.seconds:.2f}"],
    ]
    write_table("run_overhead", ["command", "seconds", "ratio"], rows,
                f"Sample: transformer_lm.py {' '.join(args)}. Whole commands in fresh processes,"
                " start-up, analysis and writing the run folder included; medians of three,"
                " measured in one run."
                f" Target: CPU recorder <= 1.3x (CUDA path <= 1.05x, needs a GPU). {machine()}.")


if __name__ == "__main__":
    main()
