"""memprof on a real GPU: fixtures, a real OOM, the virtual GPU's error, and overhead.

Usage, on a machine with a CUDA GPU (one command, device time is short):
    python benchmarks/gpu_validation.py device OUTDIR [--seconds S] [--nanogpt PATH]
It runs every sample script three ways, plain under ``gpu_probe.py`` (PyTorch's and
NVML's own counters), under ``memprof run`` on the GPU (the snapshot and report that
become ``tests/fixtures/gpu/``), and under ``memprof run`` on the virtual GPU with the
GPU hidden (``CUDA_VISIBLE_DEVICES=``: a CUDA build of torch on a machine without one, as
on most laptops), then forces an OOM three ways and times plain python against
``memprof run`` on the transformer sample, eager and under ``torch.compile``, and on
nanoGPT's ``train.py`` as its README runs it on a GPU (compiled, bf16) when given a
checkout (github:karpathy/nanoGPT; its data is synthetic). Everything
lands in OUTDIR (``results.json``, run folders, logs); phases that would pass the time
given are skipped and said so.

Then, here:
    python benchmarks/gpu_validation.py table OUTDIR
writes ``results/gpu-validation.md`` from what the card measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_scripts"
PROBE = Path(__file__).resolve().parent / "gpu_probe.py"

RUNS: dict[str, list[str]] = {
    "mlp_adam": ["mlp_adam.py"],
    "cnn": ["cnn.py"],
    "leak": ["leak.py"],
    "named_blocks": ["named_blocks.py"],
    "transformer_tiny": ["transformer_lm.py"],
    "transformer_real": ["transformer_lm.py", "--size", "real", "--steps", "3"],
    "transformer_real_bf16": ["transformer_lm.py", "--size", "real", "--steps", "3",
                              "--amp", "bf16"],
}
OOM = ["oom.py"]
TIMED = ["transformer_lm.py", "--size", "real", "--amp", "bf16", "--steps", "30"]
ROUNDS = 2


class Device:
    """The GPU machine's side: runs commands within a time budget, keeps every result."""

    def __init__(self, out: Path, seconds: float) -> None:
        self.out = out
        self.deadline = time.monotonic() + seconds
        self.results: dict[str, Any] = {"skipped": []}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def command(self, name: str, argv: list[str], env: dict[str, str] | None = None,
                limit: float = 240, cwd: Path = ROOT) -> dict[str, Any]:
        """Run ``argv``: its exit code, wall seconds, and output (in ``logs/NAME.txt``)."""
        logs = self.out / "logs"
        logs.mkdir(exist_ok=True)
        limit = min(limit, max(self.left(), 1))
        start = time.perf_counter()
        try:  # a missing program is an error like any other: the phases go on
            done = subprocess.run(argv, cwd=cwd, env={**os.environ, **(env or {}),
                                                      "COLUMNS": "120"},
                                  capture_output=True, text=True, timeout=limit)
            code, stdout, stderr = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as exc:
            code, stdout, stderr = "timeout", str(exc.stdout or ""), str(exc.stderr or "")
        except OSError as exc:
            code, stdout, stderr = "oserror", "", str(exc)
        seconds = time.perf_counter() - start
        (logs / f"{name}.txt").write_text(f"$ {' '.join(argv)}\nexit {code}, {seconds:.2f} s\n"
                                          f"--- stdout\n{stdout}\n--- stderr\n{stderr}")
        print(f"{name}: exit {code}, {seconds:.1f} s", flush=True)
        return {"code": code, "seconds": seconds}

    def probe(self, name: str, script: list[str], memprof: list[str] | None = None,
              cwd: Path = SAMPLES, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Run a sample under the probe (under ``memprof run`` when ``memprof`` is given)."""
        facts = self.out / "probes" / f"{name}.json"
        facts.parent.mkdir(exist_ok=True)
        runner = [sys.executable, "-m", "memprof", "run", *memprof] if memprof is not None \
            else [sys.executable]
        ran = self.command(name, [*runner, str(PROBE), str(facts), str(cwd / script[0]),
                                  *script[1:]], env, cwd=cwd)
        if facts.is_file():
            ran["probe"] = json.loads(facts.read_text())
        return ran

    def memprof(self, name: str, script: list[str], where: str, options: list[str] = (),
                env: dict[str, str] | None = None, cwd: Path | None = None
                ) -> dict[str, Any]:
        """``memprof run`` of a sample (or of a script in ``cwd``, run there) into
        ``OUTDIR/WHERE/NAME``: its report's facts."""
        folder = self.out / where / name
        ran = self.command(f"{where}-{name}", [sys.executable, "-m", "memprof", "run", "-f",
                                               "-o", str(folder), *options,
                                               str((cwd or SAMPLES) / script[0]), *script[1:]],
                           env, cwd=cwd or ROOT)
        report = folder / "report.json"
        if report.is_file():
            ran["report"] = json.loads(report.read_text())["run"]
        return ran

    def phase(self, name: str, needs: float) -> bool:
        if self.left() < needs:
            self.results["skipped"].append(name)
            print(f"skipped {name}: {self.left():.0f} s left", flush=True)
            return False
        return True

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1))


def third_party(run: Device, nanogpt: Path | None, mingpt: Path | None,
                groundtruth: dict[str, Path]) -> None:
    """Training scripts nobody here wrote, on the card (``gpu_thirdparty.py``): PyTorch's
    counters under plain python and, for the third-party ones, ``memprof run``'s GPU
    snapshot."""
    from gpu_thirdparty import jobs

    found = run.results.setdefault("third_party", {})
    for job in jobs(nanogpt, mingpt, groundtruth, run.out):
        if run.phase(f"third-party {job.name}", 60):
            slug = job.name.replace(" ", "-").replace(":", "")
            found[job.name] = {"plain": run.probe(f"plain-{slug}", job.argv, cwd=job.cwd,
                                                  env=job.env)}
            if job.recorded:
                found[job.name]["gpu"] = run.memprof(slug, job.argv, "third-party",
                                                     env=job.env, cwd=job.cwd)
            run.save()


PHASES = ("fixtures", "oom", "overhead", "third-party", "virtual", "tests")
WORKLOADS = ("eager", "compile", "nanogpt")
# memprof's GPU path a part at a time (gpu_probe.py): what each costs
PARTS = {"history-all": {"PROBE_HISTORY": "all"}, "history-alloc": {"PROBE_HISTORY": "alloc"},
         "hooks": {"PROBE_HOOKS": "1"}}


def device(out: Path, seconds: float, nanogpt: Path | None, phases: tuple[str, ...] = PHASES,
           runs: tuple[str, ...] = tuple(RUNS), parts: bool = False,
           workloads: tuple[str, ...] = WORKLOADS, mingpt: Path | None = None,
           groundtruth: dict[str, Path] | None = None) -> None:
    """Everything the card can tell, most important first: the ``phases`` asked for, the
    fixture and virtual phases over ``runs``, the overhead phase over ``workloads``; with
    ``parts``, those also run under each part of memprof's GPU path alone."""
    run = Device(out, seconds)
    run.command("nvidia-smi", ["nvidia-smi"])
    hidden = {"CUDA_VISIBLE_DEVICES": ""}
    for name in runs if "fixtures" in phases else ():
        if not run.phase(name, 30):
            continue
        run.results[name] = {"plain": run.probe(f"plain-{name}", RUNS[name]),
                             "gpu": run.memprof(name, RUNS[name], "gpu")}
        total = run.results[name]["plain"].get("probe", {}).get("total_memory")
        run.results["total_memory"] = run.results.get("total_memory") or total
        run.save()
    spec = [f"--virtual-gpu={run.results.get('total_memory') or 'H200'}"]
    if "oom" in phases and run.phase("oom", 60):
        run.results["oom"] = {
            "plain": run.command("plain-oom", [sys.executable, str(SAMPLES / OOM[0])]),
            "gpu": run.memprof("oom", OOM, "gpu"),
            "virtual": run.memprof("oom", OOM, "virtual", spec, hidden)}
        run.save()
    if "overhead" in phases:
        overhead(run, nanogpt, parts, workloads)
    if "third-party" in phases:
        third_party(run, nanogpt, mingpt, groundtruth)
    for name in runs if "virtual" in phases else ():
        if run.phase(f"virtual-{name}", 30):
            run.results.setdefault(name, {})["virtual"] = run.memprof(
                name, RUNS[name], "virtual", spec, hidden)
            run.save()
    if "tests" in phases and run.phase("gpu-tests", 60):
        run.results["gpu_tests"] = run.command("gpu-tests", [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "tests/test_run_cli.py", "-k", "oom_sample"])
    run.save()


def overhead(run: Device, nanogpt: Path | None, parts: bool, workloads: tuple[str, ...]
             ) -> None:
    """Plain python against memprof run (and its parts) on the timed workloads, alternating."""
    timed = [("eager", TIMED, SAMPLES, False), ("compile", [*TIMED, "--compile"], SAMPLES, True)]
    if nanogpt is not None:
        from real_scripts import nanogpt_argv

        timed.append(("nanogpt", nanogpt_argv(run.out), nanogpt, True))
    for label, script, cwd, compiled in timed:
        if label not in workloads:
            continue
        if not run.phase(f"overhead-{label}", 100):
            continue
        if compiled:  # the first compile fills Inductor's cache: every timed run then finds it
            run.probe(f"warm-{label}", script, cwd=cwd)
        rounds = run.results[f"overhead_{label}"] = []
        for i in range(ROUNDS if run.left() > 200 else 1):
            one = {"plain": run.probe(f"time-{label}-plain-{i}", script, cwd=cwd),
                   "memprof": run.probe(f"time-{label}-memprof-{i}", script,
                                        ["-f", "-o", f"/tmp/memprof-time-{label}-{i}"], cwd)}
            for part, env in PARTS.items() if parts else ():
                one[part] = run.probe(f"time-{label}-{part}-{i}", script, cwd=cwd, env=env)
            rounds.append(one)
            run.save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("device", "table"))
    parser.add_argument("outdir", nargs="?", type=Path,
                        help="device: where results go; table: a device folder to read")
    parser.add_argument("--seconds", type=float, default=420, help="device: time budget")
    parser.add_argument("--nanogpt", type=Path,
                        help="a nanoGPT checkout to time and record (table: to predict)")
    parser.add_argument("--mingpt", type=Path,
                        help="a minGPT checkout to record (table: to predict)")
    parser.add_argument("--groundtruth", nargs="*", default=[], metavar="CHECKOUT",
                        help="ground-truth checkouts whose runs to record again (table: to"
                             " predict)")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"device: which of {', '.join(PHASES)} to run")
    parser.add_argument("--runs", default=",".join(RUNS),
                        help="device: the sample runs of the fixtures and virtual phases")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="device: the timed workloads of the overhead phase")
    parser.add_argument("--label", help="table: what the OUTDIR's timings measured")
    parser.add_argument("--parts", action="store_true",
                        help="device: time each part of memprof's GPU path alone too")
    args = parser.parse_args()
    from groundtruth import find_checkouts

    if args.mode == "device":
        if args.outdir is None:
            parser.error("device needs OUTDIR")
        device(args.outdir, args.seconds, args.nanogpt.resolve() if args.nanogpt else None,
               tuple(args.phases.split(",")), tuple(args.runs.split(",")), args.parts,
               tuple(args.workloads.split(",")),
               args.mingpt.resolve() if args.mingpt else None,
               find_checkouts(args.groundtruth))
    else:
        from gpu_table import write

        write(args.outdir, args.label, args.nanogpt.resolve() if args.nanogpt else None,
              args.mingpt.resolve() if args.mingpt else None,
              find_checkouts(args.groundtruth))


if __name__ == "__main__":
    main()
