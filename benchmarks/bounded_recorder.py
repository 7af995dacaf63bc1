"""Peak RSS and wall time of `memprof run --device cpu` over plain `python`, on an LBFGS
sequence model (hundreds of thousands of events per step: the ring buffer's case) and a
small GPT (many small ops: the per-operator overhead's case).

Usage: python benchmarks/bounded_recorder.py [--only lbfgs|gpt]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from measure import machine, run, write_table

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {  # --only picks one by a word of its name
    "LBFGS LSTMCell sequence": [ROOT / "benchmarks" / "workloads" / "lbfgs_sequence.py",
                                "--steps", "1", "--length", "50"],
    "small GPT (minGPT-like)": [ROOT / "sample_scripts" / "transformer_lm.py", "--device",
                                "cpu", "--layers", "4", "--d-model", "64", "--heads", "4",
                                "--seq", "64", "--batch", "4", "--steps", "30"],
}


BUFFERS = (1_000_000, 50_000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", metavar="WORD", help="Only the workload whose name has"
                        " WORD (lbfgs, gpt); its table goes to bounded_recorder-WORD.md.")
    only = parser.parse_args().only
    os.environ["OMP_NUM_THREADS"] = "1"  # the same threads for both commands
    rows = []
    for name, (script, *args) in WORKLOADS.items():
        if only and only.lower() not in name.lower():
            continue
        plain_cmd = [sys.executable, str(script), *args]
        run(plain_cmd)  # warm the file cache and torch's first import
        plain = run(plain_cmd, repeat=3)
        for entries in BUFFERS:
            with tempfile.TemporaryDirectory() as tmp:
                profiled = run([sys.executable, "-m", "memprof", "run", "--device", "cpu",
                                "--max-entries", str(entries), "--force", "-o",
                                str(Path(tmp) / "run"), str(script), *args], repeat=3)
            rows.append([name, f"{entries:,}", f"{plain.seconds:.2f}",
                         f"{profiled.seconds:.2f}", f"{profiled.seconds / plain.seconds:.2f}",
                         f"{plain.peak_rss_mib:.0f}", f"{profiled.peak_rss_mib:.0f}",
                         f"{profiled.peak_rss_mib / plain.peak_rss_mib:.2f}"])
    table = f"bounded_recorder-{only.lower()}" if only else "bounded_recorder"
    write_table(table, ["workload", "--max-entries", "python s", "memprof s", "time ratio",
                        "python MiB", "memprof MiB", "RSS ratio"],
                rows,
                "Whole commands in fresh processes (OMP_NUM_THREADS=1), start-up, analysis and"
                " the run folder included; medians of three (peak RSS: the largest), measured"
                " in one run; 1,000,000 is the default ring buffer. Targets:"
                f" RSS <= 1.2x, time <= 1.3x. {machine()}.")


if __name__ == "__main__":
    main()
