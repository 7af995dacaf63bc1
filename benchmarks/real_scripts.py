"""`memprof run --device cpu` over plain `python` on third-party training scripts, run as
their READMEs run them on a CPU: nanoGPT's train.py (the Shakespeare-character config at
the README's CPU size) and minGPT's projects/chargpt.

Whole commands (start-up, analysis and the run folder included) and each script's own
per-iteration times, as it prints them, for the exact recorder and for ``--light`` (the CPU
allocator's events and role hooks, no dispatch mode): the whole command carries memprof's
fixed cost, which a short run feels and a long one does not; an iteration's time is the
recording's cost alone. The floor of that cost is the script's iterations under a dispatch mode that
does nothing (``TorchDispatchMode``, as the CPU recorder is one): every operator's trip
through Python. The runs alternate, python, memprof, memprof --light, the bare mode, five
times.

The scripts are not part of memprof: fetch them (github:karpathy/nanoGPT,
github:karpathy/minGPT) and pass the checkouts. Their data is synthetic, made here in a
temporary folder (a script's memory and time do not depend on what the characters are).

Usage: python benchmarks/real_scripts.py --nanogpt PATH --mingpt PATH [--iters N ...]
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import statistics
import string
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from measure import Run, machine, run, write_table

REPEAT = 5  # this machine's run-to-run spread is about 10%: medians of five
# The script under a dispatch mode that only calls each operator (memprof's own base class,
# without Dynamo's wrapper, as the recorder runs): the floor of any such recorder's cost.
BARE_MODE = """import os, runpy, sys
from memprof.collect.cpu.storages import _PlainMode
class Bare(_PlainMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
with Bare():
    runpy.run_path(sys.argv[0], run_name="__main__")
"""
WARM_UP = 3  # iterations left out of the per-iteration median (allocator and cache warm-up)
_NANOGPT_ITER = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", re.M)
_MINGPT_ITER = re.compile(r"^iter_dt ([\d.]+)ms; iter (\d+):", re.M)


@dataclass(frozen=True)
class Workload:
    name: str
    argv: list[str]  # the script and its arguments
    cwd: Path
    env: dict[str, str]
    iteration_ms: Callable[[str], list[float]]  # the script's printed iteration times


def nanogpt_data(tmp: Path) -> Path:
    """A folder nanoGPT's ``--dataset=`` takes: random Shakespeare-character tokens."""
    data = tmp / "nanogpt-data"
    data.mkdir(exist_ok=True)
    tokens = np.random.default_rng(0).integers(0, 65, 1_000_000, dtype=np.uint16)
    tokens.tofile(data / "train.bin")
    tokens[:100_000].tofile(data / "val.bin")
    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65}))
    return data

def nanogpt_argv(out: Path) -> list[str]:
    """nanoGPT's Shakespeare-character training as its README runs it on a GPU (compiled,
    bf16 autocast), 40 iterations on synthetic tokens, each iteration's time printed."""
    return ["train.py", "config/train_shakespeare_char.py", f"--dataset={nanogpt_data(out)}",
            "--max_iters=40", "--eval_iters=5", "--log_interval=1",
            f"--out_dir={out / 'nanogpt-out'}"]


def nanogpt(checkout: Path, iters: int, tmp: Path) -> Workload:
    """nanoGPT's README CPU command, ``iters`` iterations, on a synthetic token file."""
    data = nanogpt_data(tmp)
    argv = [str(checkout / "train.py"), "config/train_shakespeare_char.py", "--device=cpu",
            "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
            "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
            f"--max_iters={iters}", "--lr_decay_iters=2000", "--dropout=0.0",
            f"--dataset={data}", f"--out_dir={tmp / 'nanogpt-out'}"]

    def iteration_ms(stdout: str) -> list[float]:
        return [float(ms) for it, ms in _NANOGPT_ITER.findall(stdout) if int(it) >= WARM_UP]

    return Workload(f"nanoGPT train.py, {iters} iterations", argv, checkout, {}, iteration_ms)


def mingpt(checkout: Path, iters: int, tmp: Path) -> Workload:
    """minGPT's chargpt (gpt-micro, batch 16, block 64), ``iters`` iterations: its
    iteration 0 also samples 500 characters and saves the model, as the project does."""
    work = tmp / "mingpt-work"
    work.mkdir(exist_ok=True)
    # Shakespeare's 65 characters, as the project's sampling prompt needs ("O God, O God!")
    letters = np.frombuffer((string.ascii_letters + " \n!$&',-.3:;?").encode(), dtype=np.uint8)
    text = letters[np.random.default_rng(0).integers(0, len(letters), 1_000_000)]
    (work / "input.txt").write_bytes(text.tobytes())
    argv = [str(checkout / "projects" / "chargpt" / "chargpt.py"),
            "--model.model_type=gpt-micro", "--trainer.batch_size=16", "--data.block_size=64",
            f"--trainer.max_iters={iters + 1}", "--trainer.num_workers=0"]  # out/ in cwd

    def iteration_ms(stdout: str) -> list[float]:  # printed every 10 iterations
        return [float(ms) for ms, it in _MINGPT_ITER.findall(stdout) if int(it) >= WARM_UP]

    return Workload(f"minGPT chargpt.py, {iters} iterations", argv, work,
                    {"PYTHONPATH": str(checkout)}, iteration_ms)


def measure(workload: Workload, tmp: Path) -> list[str]:
    """A table row: whole commands and iteration times, python against memprof (the exact
    recorder and ``--light``) and a bare dispatch mode."""
    memprof_cmd = [sys.executable, "-m", "memprof", "run", "--device", "cpu", "--force", "-o",
                   str(tmp / "run")]
    commands = {"python": [sys.executable, *workload.argv],
                "memprof": [*memprof_cmd, *workload.argv],
                "light": [*memprof_cmd, "--light", *workload.argv],
                "bare": [sys.executable, "-c", BARE_MODE, *workload.argv]}
    saved = dict(os.environ)
    os.environ.update(workload.env)
    try:
        run(commands["python"], workload.cwd)  # warm the file cache and the imports
        runs: dict[str, list[Run]] = {key: [] for key in commands}
        iterations: dict[str, list[float]] = {key: [] for key in commands}
        for _ in range(REPEAT):
            for key, cmd in commands.items():
                out = tmp / f"{key}.out"
                runs[key].append(run(cmd, workload.cwd, stdout=out))
                iterations[key] += workload.iteration_ms(out.read_text())
    finally:
        os.environ.clear()
        os.environ.update(saved)
    whole = {k: statistics.median(r.seconds for r in runs[k]) for k in runs}
    cpu = {k: statistics.median(r.cpu_seconds for r in runs[k]) for k in runs}
    it = {k: statistics.median(iterations[k]) for k in iterations}
    return [workload.name, f"{whole['python']:.2f}", f"{whole['memprof']:.2f}",
            f"{whole['memprof'] / whole['python']:.2f}", f"{cpu['memprof'] / cpu['python']:.2f}",
            f"{whole['light'] / whole['python']:.2f}", f"{whole['bare'] / whole['python']:.2f}",
            f"{it['python']:.1f}", f"{it['memprof']:.1f}", f"{it['memprof'] / it['python']:.2f}",
            f"{it['light'] / it['python']:.2f}", f"{it['bare'] / it['python']:.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout")
    parser.add_argument("--mingpt", type=Path, required=True, help="a minGPT checkout")
    parser.add_argument("--iters", type=int, nargs="+", default=[20, 100],
                        help="nanoGPT's iteration counts (default: 20 100)")
    parser.add_argument("--mingpt-iters", type=int, default=40)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # the same threads for both commands
    rows = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        workloads = [nanogpt(args.nanogpt.resolve(), n, tmp) for n in args.iters]
        workloads.append(mingpt(args.mingpt.resolve(), args.mingpt_iters, tmp))
        for workload in workloads:
            rows.append(measure(workload, tmp))
    write_table("real_scripts", ["script", "python s", "memprof s", "time ratio",
                                 "CPU time ratio", "time ratio, --light",
                                 "time ratio, a bare dispatch mode", "iteration ms (python)",
                                 "iteration ms (memprof)", "iteration ratio",
                                 "iteration ratio, --light",
                                 "iteration ratio, a bare dispatch mode"], rows,
                "Whole commands in fresh processes (OMP_NUM_THREADS=1), python, memprof,"
                f" memprof --light and a bare dispatch mode alternating, medians of {REPEAT}; CPU"
                " time is user + system. Iteration times"
                f" are the scripts' own, from iteration {WARM_UP} on, medians over the {REPEAT}"
                " runs: the recording's cost with no start-up or analysis in it; a bare"
                " dispatch mode's iterations are the exact recorder's floor. Synthetic"
                f" data; fetched checkouts, not part of memprof. Target: 1.3x. {machine()}.")


if __name__ == "__main__":
    main()

