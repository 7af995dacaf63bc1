"""``results/gpu-validation.md``: memprof against a real GPU.

Three tables: the virtual GPU's predictions against the card's own counters for every
run recorded in ``tests/fixtures/gpu`` (predicted here, now, with this checkout); what
``memprof run`` changes on the card (nothing, in memory) and what it costs in time
(``results/gpu-overhead.json``, measured on the card by ``gpu_validation.py device``);
and the CUDA context the card showed.

Usage: python benchmarks/gpu_validation.py table [OUTDIR]
(OUTDIR: a ``gpu_validation.py device`` folder whose timings replace the JSON's).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from measure import RESULTS, error, table_text, write_text

from memprof.collect.virtual.workspaces import unified_setting

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "gpu"
OVERHEAD = RESULTS / "gpu-overhead.json"
MIB = 1 << 20


def predict(run: str, counters: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """``memprof run --virtual-gpu`` of the command the card ran: the predicted peaks,
    with cuBLASLt's workspace kept as the card's torch kept it (apart up to 2.11)."""
    out = tmp / run
    env = {**os.environ,
           "TORCH_CUBLASLT_UNIFIED_WORKSPACE": unified_setting(counters["torch_version"])}
    subprocess.run([sys.executable, "-m", "memprof", "run", "--virtual-gpu",
                    counters["memprof_run"]["name"], "--no-timeline", "-o", str(out),
                    *counters["command"][2:]], cwd=ROOT, env=env, capture_output=True,
                   check=False)
    return json.loads((out / "report.json").read_text())["devices"][0]["peak"]


def prediction_rows() -> tuple[list[list[str]], list[float], list[float]]:
    """A row per recorded run, and the allocated and reserved errors (%)."""
    rows, allocated, reserved = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for folder in sorted(p for p in FIXTURES.iterdir() if (p / "counters.json").is_file()):
            counters = json.loads((folder / "counters.json").read_text())
            card = counters["memprof_run"]
            peak = predict(folder.name, counters, Path(tmp))
            a, r = peak["allocated_bytes"], peak["reserved_bytes"]
            allocated.append(100 * (a / card["max_memory_allocated"] - 1))
            reserved.append(100 * (r / card["max_memory_reserved"] - 1))
            rows.append([folder.name, " ".join(counters["command"][2:]).replace("|", "\\|"),
                         f"{card['max_memory_allocated']:,}", f"{a:,}",
                         error(a, card["max_memory_allocated"]),
                         f"{card['max_memory_reserved']:,}", f"{r:,}",
                         error(r, card["max_memory_reserved"]),
                         f"{card['context_bytes'] / MIB:.0f}"])
    return rows, allocated, reserved


def unchanged_rows() -> list[list[str]]:
    """Plain python's counters against memprof run's, for each run that has both."""
    rows = []
    for folder in sorted(FIXTURES.iterdir()):
        path = folder / "counters.json"
        counters = json.loads(path.read_text()) if path.is_file() else {}
        plain, mine = counters.get("plain_python"), counters.get("memprof_run")
        if plain and mine:
            rows.append([folder.name, *(f"{plain[k]:,} / {mine[k]:,}" for k in (
                "max_memory_allocated", "max_memory_reserved", "nvml_process_bytes"))])
    return rows


def add_session(outdir: Path, label: str) -> None:
    """Keep the timings of a ``gpu_validation.py device`` folder in ``gpu-overhead.json``
    under ``label`` (replacing a session of that label)."""
    results = json.loads((outdir / "results.json").read_text())
    keep = ("seconds", "script_seconds", "step_times", "compiled_graphs",
            "max_memory_allocated", "torch", "name")
    runs = {key.removeprefix("overhead_"): [
        {side: {"seconds": ran["seconds"], **{k: v for k, v in ran.get("probe", {}).items()
                                               if k in keep}}
         for side, ran in one_round.items() if "probe" in ran} for one_round in value]
        for key, value in results.items() if key.startswith("overhead_")}
    sessions = json.loads(OVERHEAD.read_text())["sessions"] if OVERHEAD.is_file() else []
    sessions = [s for s in sessions if s["label"] != label] + [{"label": label, "runs": runs}]
    OVERHEAD.write_text(json.dumps({"sessions": sessions}, indent=1) + "\n")


PARTS = ("history-all", "history-alloc", "hooks")


def _ratio(rounds: list[dict[str, Any]], value: Callable[[dict[str, Any]], float],
           side: str = "memprof") -> str:
    """``side`` (memprof run, or a part of it) over plain python: the median over rounds."""
    return f"{statistics.median(value(r[side]) / value(r['plain']) for r in rounds):.2f}x"


def _step(ran: dict[str, Any]) -> float:
    """The median optimizer step, after three of warm-up."""
    return statistics.median(ran["step_times"][3:])


def overhead_rows(data: dict[str, Any]) -> list[list[str]]:
    """Per session and workload: memprof over plain python (whole command, script, steady
    step) and each part of memprof's GPU path alone (steady step)."""
    rows = []
    for session in data["sessions"]:
        for label, rounds in session["runs"].items():
            first = rounds[0]
            parts = [_ratio([r for r in rounds if part in r], _step, part)
                     if any(part in r for r in rounds) else "" for part in PARTS]
            rows.append([session["label"], label, str(len(rounds)),
                         _ratio(rounds, lambda ran: ran["seconds"]),
                         _ratio(rounds, lambda ran: ran["script_seconds"]), _ratio(rounds, _step),
                         *parts,
                         f"{1000 * _step(first['plain']):.1f} /"
                         f" {1000 * _step(first['memprof']):.1f}",
                         f"{first['plain']['compiled_graphs']} /"
                         f" {first['memprof']['compiled_graphs']}",
                         "yes" if first["plain"]["max_memory_allocated"]
                         == first["memprof"]["max_memory_allocated"] else "no"])
    return rows


THIRD_PARTY = """
PyTorch's own counters (`max_memory_allocated`, `max_memory_reserved`) at the end of each
script under plain python on the card (`results/gpu-thirdparty.json`), against `memprof
run --virtual-gpu` of the same command here (`gpu_thirdparty.py`; checkouts given to
`gpu_validation.py table`). nanoGPT: `train.py config/train_shakespeare_char.py`, 10
iterations on synthetic tokens, bf16 autocast, dropout 0.2, as its README runs it on a
GPU but for the iteration count; minGPT: `chargpt.py` (gpt-micro), 20 iterations, fp32;
the CS336 runs: their scripts as `groundtruth.py` runs them, on this card's torch.
"""


def write(outdir: Path | None, label: str | None, nanogpt: Path | None = None,
          mingpt: Path | None = None, checkouts: dict[str, Path] | None = None) -> None:
    """Keep ``outdir``'s timings (as ``label``) and third-party counters, then predict and
    write the page (the third-party jobs these checkouts allow)."""
    import gpu_thirdparty

    if outdir is not None:
        add_session(outdir, label or outdir.name)
        gpu_thirdparty.keep(json.loads((outdir / "results.json").read_text()))
    third = table_text(["run", "card allocated", "predicted", "error", "card reserved",
                        "predicted", "error", "note"],
                       gpu_thirdparty.rows(nanogpt, mingpt, checkouts or {}), THIRD_PARTY)
    rows, allocated, reserved = prediction_rows()
    card = json.loads((FIXTURES / "mlp_adam" / "counters.json").read_text())
    software = (f"{card['memprof_run']['name']}, driver {card['memprof_run']['driver']},"
                f" torch {card['torch_version']}")
    import torch

    notes = f"""
Recorded on one {software} (`tests/fixtures/gpu`, each run's `counters.json` holds what
PyTorch and NVML said at the end of `memprof run`); predicted here with torch
{torch.__version__} on the CPU by `memprof run --virtual-gpu` with the card's name.
Median error: allocated {statistics.median(allocated):+.2f}%, reserved
{statistics.median(reserved):+.2f}% (targets: within 1% and 3%), with cuBLASLt's workspace
kept apart as torch 2.11 keeps it (`TORCH_CUBLASLT_UNIFIED_WORKSPACE=0`; 2.12 and later
share the cuBLAS one by default). `context MiB` is NVML's
memory for the process less `memory_reserved()`: the CUDA context, now the H200's entry in
the virtual GPU's card table. Not modelled: cuDNN's convolution workspaces (`cnn`'s
backward requests 0.7-1.3 MB blocks that open a 20 MiB segment). Attention's and the
embedding backward's scratch is modelled kernel by kernel from what the card requested
(`kernel_scratch_probe.py`, `tests/test_kernel_scratch.py`): cuDNN's attention, which
torch 2.11 picks first on this card, flash's split-KV accumulators, memory-efficient
attention's dQ tiles, CUB's temporary storage.
"""
    header = ["run", "command", "card allocated", "predicted", "error", "card reserved",
              "predicted", "error", "context MiB"]
    unchanged = table_text([
        "run", "max_memory_allocated (python / memprof run)", "max_memory_reserved",
        "NVML process bytes"], unchanged_rows(), """
The same command under plain python and under `memprof run` on the card: the GPU path
records PyTorch's allocator history and runs role hooks, no dispatch mode, and changes
no byte the script uses.
""")
    timing = table_text([
        "session", "workload", "rounds", "whole command", "script", "steady step",
        *(f"{part} alone" for part in PARTS), "step ms (python / memprof)", "compiled graphs",
        "same memory"],
        overhead_rows(json.loads(OVERHEAD.read_text())), """
Ratios of `memprof run` over plain python on the card, medians over rounds that alternate
them (`gpu_probe.py` runs the script and reads the optimizer steps' times and
torch.compile's graph count; one round is one run of each, so single-round ratios carry
the card's run-to-run noise, about 5%). `eager` and `compile` are `transformer_lm.py
--size real --amp bf16 --steps 30` (GPT-2 small), `nanogpt` is nanoGPT's train.py at its
README's GPU settings (compiled, bf16, 40 iterations); compiled runs come after one
untimed run fills Inductor's cache. The whole command includes memprof's analysis and
report. The `alone` columns run one part of the GPU path by itself (`gpu_probe.py`'s
`PROBE_HISTORY` and `PROBE_HOOKS`): PyTorch's allocator history with Python stacks at
allocations and frees (`all`) or at allocations only (`alloc`, what `memprof run`
records since), and memprof's role hooks. Each session names the memprof it measured.
""")
    write_text("gpu-validation", "\n".join([
        "## The virtual GPU against the card\n", table_text(header, rows, notes),
        "## Scripts nobody here wrote, on the card and on the virtual GPU\n", third,
        "## What memprof run changes on the card\n", unchanged,
        "## What memprof run costs on the card\n", timing]))
