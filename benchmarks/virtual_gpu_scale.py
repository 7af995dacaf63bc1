"""A 3B-parameter model under `memprof run --virtual-gpu`: wall time and peak RSS.

Usage: python benchmarks/virtual_gpu_scale.py
The transformer sample at 3.26B parameters (26 layers, d_model 3072, seq 1024, batch 1,
bf16 autocast, AdamW, 2 steps) on a virtual H100: its CUDA tensors hold no storage, so
the run needs neither a GPU nor the 61 GiB it predicts. Targets: < 60 s, < 1 GiB RSS.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from measure import machine, run, write_table

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_scripts" / "transformer_lm.py"
CONFIG = ["--layers", "26", "--d-model", "3072", "--heads", "24", "--seq", "1024",
          "--batch", "1", "--vocab", "50257", "--steps", "2", "--amp", "bf16"]
GIB = 1 << 30


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        measured = run([sys.executable, "-m", "memprof", "run", "--virtual-gpu", "H100",
                        "--force", "-o", str(out), str(SAMPLE), *CONFIG], repeat=3)
        report = json.loads((out / "report.json").read_text())
    peak = report["devices"][0]["peak"]
    rows = [["3.26B-parameter decoder LM, virtual H100 80GB", f"{measured.seconds:.1f}",
             f"{measured.peak_rss_mib:.0f}", f"{peak['allocated_bytes'] / GIB:.2f}",
             f"{peak['reserved_bytes'] / GIB:.2f}"]]
    write_table("virtual_gpu_scale",
                ["run", "seconds", "peak RSS MiB", "predicted peak allocated GiB",
                 "predicted peak reserved GiB"], rows,
                f"Command: memprof run --virtual-gpu H100 sample_scripts/transformer_lm.py"
                f" {' '.join(CONFIG)}. Whole command in a fresh process (start-up, recording,"
                " analysis, run folder); median time and highest RSS of three runs."
                f" Targets: < 60 s, < 1024 MiB. {machine()}.")


if __name__ == "__main__":
    main()
