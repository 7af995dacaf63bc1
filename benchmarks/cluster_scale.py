"""Llama-shaped FSDP2 runs on a virtual cluster: wall time, memory, and each rank's model
state against the sharding arithmetic.

Usage: python benchmarks/cluster_scale.py
Runs `workloads/llama_fsdp.py` (Llama 3's 8B and 70B shapes, FSDP2 per decoder block, bf16
compute, fp32 AdamW, sequences of 4,096 tokens, 2 steps) under `memprof run
--nproc-per-node`: 8B on 8 virtual A100 40GB with and without activation checkpointing
(every rank run), and 70B on 64 virtual H100s with checkpointing, as asked without
`--ranks`: memprof runs a world this large's representatives (ranks 0, 1, 32, 62 and 63).
Targets for the 70B case: under 2 minutes and 4 GB of memory.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from measure import machine, run, write_table

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "workloads"))
import llama_fsdp  # noqa: E402  (the workload, for its parameter count)

GIB = 1 << 30
CASES = [  # name, preset, card, ranks per node, --ranks (None: memprof's default), checkpointing
    ("8B, 8 x A100 40GB", "8b", "A100 40GB", 8, None, False),
    ("8B, 8 x A100 40GB, checkpointing", "8b", "A100 40GB", 8, None, True),
    ("70B, 64 x H100 80GB, checkpointing", "70b", "H100", 64, None, True),
]


def parameters(preset: str) -> int:
    """The model's parameter count, built on the meta device."""
    with torch.device("meta"):
        model = llama_fsdp.Llama(**llama_fsdp.PRESETS[preset], seq=16, checkpointed=False)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    rows = []
    for name, preset, card, world, chosen, checkpointed in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run"
            argv = [sys.executable, "-m", "memprof", "run", "--nproc-per-node", str(world),
                    "--virtual-gpu", card, "--no-timeline", "-o", str(out)]
            argv += ["--ranks", chosen] if chosen else []
            argv += [str(ROOT / "workloads" / "llama_fsdp.py"), "--preset", preset,
                     "--steps", "2"] + (["--checkpoint"] if checkpointed else [])
            measured = run(argv, codes=(0, 1))  # 1: a rank ran out of memory
            summary = json.loads((out / "cluster.json").read_text())
            worst = summary["worst_rank"]
            state = json.loads((out / f"rank-{worst}" / "report.json").read_text())
        p = parameters(preset)
        held = state["devices"][0]["categories_requested"]
        processes = len(summary["ranks_run"]) + 1  # and the launcher
        rows.append([name, str(len(summary["ranks_run"])), f"{measured.seconds:.0f}",
                     f"{measured.peak_rss_mib:.0f} x {processes}",
                     summary["answer"].split(": CUDA out of memory")[0],
                     f"{held['parameters'] / GIB:.3f} / {4 * p / world / GIB:.3f}",
                     f"{held['optimizer_state'] / GIB:.3f} / {8 * p / world / GIB:.3f}"])
    write_table("cluster_scale",
                ["run", "ranks run", "seconds", "peak RSS MiB x processes", "answer",
                 "parameters GiB (at the peak / 4P/W)",
                 "optimizer state GiB (at the peak / 8P/W)"], rows,
                "Whole `memprof run --nproc-per-node` command, one run each: the launcher and"
                " a process per rank run, at once (as many as memory holds); peak RSS is the"
                " largest process's. At the"
                " peak: the worst rank's tensors' own bytes (report.json's"
                " categories_requested; blocks round up), the first step's forward where the"
                " run ran out of memory there, before any optimizer state. P: the model's"
                " parameters, W: the world size; fp32 shards and AdamW moments (each dim 0"
                " divides by W here, so no padding), and AdamW's step counters (4 bytes a"
                f" parameter tensor). {machine()}.")


if __name__ == "__main__":
    main()
