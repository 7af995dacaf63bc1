"""Peak RSS and wall time of `memprof run --device cpu` over plain `python`, on an LBFGS
sequence model (hundreds of thousands of events per step: the ring buffer's case) and a
small GPT (many small ops: the per-operator overhead's case).

Whole commands, and the script alone: its run with torch already imported, timed by a
runner in plain python and by memprof (report.json's duration_s), so that the recording's
cost per operator is told apart from memprof's fixed cost (start-up, analysis, the run
folder, the timeline's matplotlib).

Usage: python benchmarks/bounded_recorder.py [--only lbfgs|gpt]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
# The script's own time in plain python, torch imported first as memprof has (run as -c)
RUNNER = """import os, runpy, sys, time, torch
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
start = time.perf_counter()
runpy.run_path(script, run_name="__main__")
open(os.environ["SCRIPT_SECONDS"], "w").write(str(time.perf_counter() - start))
"""


def _script_seconds(argv: list[str], read: Path, repeat: int = 3) -> float:
    """The median of the seconds a command leaves in ``read`` (a file, or report.json)."""
    seconds = []
    for _ in range(repeat):
        run(argv)
        text = read.read_text()
        seconds.append(json.loads(text)["run"]["duration_s"] if read.suffix == ".json"
                       else float(text))
    return statistics.median(seconds)


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
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["SCRIPT_SECONDS"] = str(Path(tmp) / "seconds")
            plain_script = _script_seconds([sys.executable, "-c", RUNNER, str(script), *args],
                                           Path(tmp) / "seconds")
        for entries in BUFFERS:
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, "-m", "memprof", "run", "--device", "cpu",
                       "--max-entries", str(entries), "--force", "-o", str(Path(tmp) / "run"),
                       str(script), *args]
                profiled = run(cmd, repeat=3)
                script_s = _script_seconds(cmd, Path(tmp) / "run" / "report.json")
            rows.append([name, f"{entries:,}", f"{plain.seconds:.2f}",
                         f"{profiled.seconds:.2f}", f"{profiled.seconds / plain.seconds:.2f}",
                         f"{profiled.cpu_seconds / plain.cpu_seconds:.2f}",
                         f"{plain_script:.2f}", f"{script_s:.2f}",
                         f"{script_s / plain_script:.2f}",
                         f"{plain.peak_rss_mib:.0f}", f"{profiled.peak_rss_mib:.0f}",
                         f"{profiled.peak_rss_mib / plain.peak_rss_mib:.2f}"])
    table = f"bounded_recorder-{only.lower()}" if only else "bounded_recorder"
    write_table(table, ["workload", "--max-entries", "python s", "memprof s", "time ratio",
                        "CPU time ratio", "script s (python)", "script s (memprof)", "script ratio",
                        "python MiB", "memprof MiB", "RSS ratio"],
                rows,
                "Whole commands in fresh processes (OMP_NUM_THREADS=1), start-up, analysis and"
                " the run folder included; the script columns time the script alone (torch"
                " already imported), so their ratio is the recording's own cost. CPU time (user"
                " + system) is less sensitive to other load on the machine. Medians of"
                " three (peak RSS: the largest), measured in one run; 1,000,000 is the default"
                f" ring buffer. Targets: RSS <= 1.2x, time <= 1.3x. {machine()}.")


if __name__ == "__main__":
    main()
