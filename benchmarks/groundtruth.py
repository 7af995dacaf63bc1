"""The virtual GPU's predictions against real GPU runs whose code is public.

Usage:
    python benchmarks/groundtruth.py CHECKOUT... [--only TEXT] [--timeout SECONDS]
                                     [--memprof DIR] [--memory-limit GIB] [--python PATH]...
    python benchmarks/groundtruth.py --self-check

Each CHECKOUT is a folder named ``<owner>+<repo>@<commit>`` holding that repository at
that commit (the runs of ``../shared/fixtures/groundtruth/README.md``), made from the
bare repository the ``fetch`` tool brings, e.g.::

    git --git-dir=/work/.mirror/<owner>+<repo>/repo archive <commit> \
        | tar -x -C /work/checkouts/<owner>+<repo>@<commit>

For each ground-truth snapshot whose checkout is given, the repository's script runs
unmodified under ``memprof run --virtual-gpu CARD`` with the README's arguments, in a
scratch folder; the snapshot the script dumps is compared with the one the real GPU
recorded: peak allocated and peak reserved (as ``memprof explain`` computes them), the
peak the script printed against its log, the share of the GPU's allocations that the
prediction reproduces in order (the two sequences aligned by size), and, where they
differ, the sizes whose counts differ most (in bytes) and the allocations only one of
the two made (by the user's line).
Needs ``einops``, ``einx`` and ``jaxtyping`` (pure Python).

Backward's allocations depend on the torch release (its autograd formulas), so each run
goes to the first ``--python`` interpreter that has the torch its GPU run used (2.6 or
2.11) and a Python new enough for its script (Wedsonlin's needs 3.12); otherwise to the
first new enough. Each interpreter needs memprof's dependencies and the three packages
above, e.g. a venv with ``pip install torch==2.6.0 einops einx jaxtyping`` and
``pip install -e .`` (on a machine without a GPU, a CUDA build of torch works as well).

``--self-check`` compares every ground-truth snapshot with itself (all errors must be 0)
and with its neighbour of another size: a check of the comparison, without checkouts.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from measure import write_table

from memprof.analysis.explain import explain
from memprof.analysis.sites import short_path, site_of
from memprof.trace import load_snapshot
from memprof.trace.model import Action, Frames, Snapshot

ROOT = Path(__file__).resolve().parent.parent
GROUNDTRUTH = Path(os.environ.get("MEMPROF_GROUNDTRUTH",
                                  ROOT.parent / "shared" / "fixtures" / "groundtruth"))
MIB = 1 << 20
GIB = 1 << 30
TARGETS = {"allocated": (1.0, 3.0), "reserved": (3.0, 8.0)}  # median, worst, in percent

# None of the ground-truth GPUs was a Hopper: every snapshot holds 8,519,680-byte cuBLAS
# workspaces (32 MiB on capability 9.x). Their cards are not recorded; an A100 80GB has
# that workspace and room for every run (the largest reserves 72.8 GiB).
CARD = "A100 80GB"


@dataclass(frozen=True)
class Run:
    """One ground-truth snapshot and how its script was run."""

    fixture: str  # file name in GROUNDTRUTH/snapshots
    checkout: str  # "<owner>+<repo>@<commit>"
    script: str  # path in the checkout
    args: tuple[str, ...]
    pythonpath: tuple[str, ...]  # folders of the checkout the script imports from
    dump: str  # where the script writes its snapshot, relative to the scratch folder
    cwd: str = "."  # relative to the scratch folder
    log: str | None = None  # GROUNDTRUTH/logs file with the script's own output
    python: tuple[int, int] = (3, 10)  # the oldest Python that parses the script
    torch: str = "2.11"  # the torch (major.minor) the GPU run used

    @property
    def label(self) -> str:
        owner = self.checkout.split("+")[0]
        stem = Path(self.fixture).stem.split("+")[-1].split("@")[0]
        for noise in ("cs336_systems_results_memory_profiles_", "cs336_systems_profile_memory_",
                      "results_", "_memory_snapshot", "memory_snapshot_"):
            stem = stem.replace(noise, "")
        return f"{owner}: {stem}"


def _runs() -> list[Run]:
    runs = []
    niu = "NiuHuangxiaozi+assignment2-systems@9d868b9b14"
    for kind, mode in (("forward", "forward"), ("forward_and_backward", "train")):
        for ctx in ("100", "150", "200", "200_mixed_precision"):
            length, mixed = ctx.split("_")[0], ctx.endswith("precision")
            script = "profile_mixprecision_memory.py" if mixed else "profile_memory.py"
            runs.append(Run(
                fixture=("NiuHuangxiaozi+assignment2-systems+cs336_systems_profile_memory_"
                         f"{kind}_memory_snapshot_{ctx}.pickle"),
                checkout=niu, script=f"cs336_systems/profile_memory/{script}",
                args=("--mode", mode, "--context_length", length,
                      *(("--use_mixed_precision",) if mixed else ())),
                pythonpath=(".",), dump=f"{kind}_memory_snapshot_{ctx}.pickle", torch="2.6"))
    for name, commit in (("xl_ctx128_forward_bf16", "eac34c7240"),
                         ("xl_ctx128_forward_none", "eac34c7240"),
                         ("xl_ctx512_forward_bf16", "fa2c3e60b7"),
                         ("xl_ctx512_forward_none", "fa2c3e60b7"),
                         ("xl_ctx512_full_step_bf16", "fa2c3e60b7"),
                         ("xl_ctx512_full_step_none", "fa2c3e60b7")):
        _, ctx, *mode, precision = name.split("_")
        at = f"@{commit}" if commit == "eac34c7240" else ""
        runs.append(Run(
            fixture=("LINYUNLinYun+CS336-assignment2-systems+cs336_systems_results_memory_"
                     f"profiles_{name}{at}.pickle"),
            checkout=f"LINYUNLinYun+CS336-assignment2-systems@{commit}",
            script="cs336_systems/benchmark_nvtx.py",
            args=("--model-size", "xl", "--context-length", ctx.removeprefix("ctx"),
                  "--batch-size", "4", "--mode", "_".join(mode), "--warmup-steps", "5",
                  "--measurement-steps", "1", "--mixed-precision", precision,
                  "--profile-memory", "--memory-snapshot", f"{name}.pickle"),
            pythonpath=("cs336-basics",), dump=f"{name}.pickle",
            log=f"LINYUNLinYun+{name}@{commit}.log"))
    # bf16 autocast in these three, from the traces (README)
    autocast = {("512", "inference"), ("512", "training"), ("1024", "training")}
    for kind, pattern in (("inference", "forward-only"), ("training", "full-training-step")):
        for ctx in ("128", "256", "512", "1024"):
            runs.append(Run(
                fixture=f"Wedsonlin+assignment2-systems+results_medium_{ctx}_{kind}"
                        "_memory_snapshot.pickle",
                checkout="Wedsonlin+assignment2-systems@8630bcfe2d",
                script="cs336_systems/nsys_profile.py",
                args=("--vocab_size", "10000", "--context_length", ctx, "--d_model", "1024",
                      "--d_ff", "4096", "--num_layers", "24", "--num_heads", "16",
                      "--model_name", "medium", "--warmup-steps", "5", "--execution-steps",
                      "10", "--autocast", str((ctx, kind) in autocast).lower(),
                      "--memory-profile", "true", "--pattern", pattern),
                pythonpath=("cs336-basics",), cwd="scripts",
                dump=f"results/medium_{ctx}_{kind}_memory_snapshot.pickle",
                python=(3, 12)))  # f"...{model.config["context_length"]}..." (PEP 701)
    return runs


RUNS = _runs()


@dataclass
class Measured:
    """What one snapshot says: its peaks and the sizes of the allocations it knows."""

    allocated: int
    reserved: int
    sizes: Counter[int]  # requested sizes: allocations in the window and blocks from before it
    allocs: list[tuple[int, str]]  # the window's allocations in order: (size, Python site)


def measure(snapshot: Snapshot) -> Measured:
    """Peaks as ``memprof explain`` reports them on device 0, and the allocation sizes."""
    found = explain(snapshot, devices=[0]).devices[0]
    trace = snapshot.traces.get(0)
    sizes: Counter[int] = Counter()
    allocs: list[tuple[int, str]] = []
    allocated_in_window: set[int] = set()
    if trace is not None:
        for i in range(len(trace)):
            action, addr, size = int(trace.action[i]), int(trace.addr[i]), int(trace.size[i])
            if action == Action.ALLOC:
                allocated_in_window.add(addr)
                allocs.append((size, _site(trace.frames(i))))
                sizes[size] += 1
            elif action == Action.FREE_REQUESTED and addr not in allocated_in_window:
                allocated_in_window.add(addr)  # allocated before the window, freed in it
                sizes[size] += 1
    for segment in snapshot.segments_of(0):
        for block in segment.blocks:
            if block.allocated and block.address not in allocated_in_window:
                sizes[block.requested_size] += 1
    return Measured(found.peak_allocated_bytes, found.peak_reserved_bytes, sizes, allocs)


def _site(frames: Frames) -> str:
    """The user's line (library line numbers move between torch and einops versions)."""
    site = site_of(frames)
    if site.user is not None:
        return f"{short_path(site.user.filename)}:{site.user.line}"
    if site.call is not None:
        return f"{short_path(site.call.filename)}:{site.call.line}"
    return "(no stack)"


@dataclass
class Comparison:
    """A prediction against the recording."""

    allocated_error: float  # percent, signed: predicted above recorded is positive
    reserved_error: float
    differing: list[tuple[int, int, int]] = field(default_factory=list)  # size, recorded, predicted
    # allocations of one trace that the other has not, once the two are aligned:
    # (site, size, count), most bytes first
    recorded_only: list[tuple[str, int, int]] = field(default_factory=list)
    predicted_only: list[tuple[str, int, int]] = field(default_factory=list)
    matched: float = 100.0  # percent of the GPU's allocations the aligned prediction has


def compare(predicted: Measured, recorded: Measured, top: int = 4) -> Comparison:
    """Peak errors, the sizes whose counts differ most in bytes, the allocations only one has."""
    differing = [(size, recorded.sizes[size], predicted.sizes[size])
                 for size in set(predicted.sizes) | set(recorded.sizes)
                 if predicted.sizes[size] != recorded.sizes[size]]
    differing.sort(key=lambda d: (-abs(d[2] - d[1]) * d[0], d[0]))
    recorded_only, predicted_only, same = unmatched(recorded.allocs, predicted.allocs)
    matched = 100.0 * same / len(recorded.allocs) if recorded.allocs else 100.0
    return Comparison(_error(predicted.allocated, recorded.allocated),
                      _error(predicted.reserved, recorded.reserved), differing[:top],
                      recorded_only[:top], predicted_only[:top], matched)


def _error(predicted: int, recorded: int) -> float:
    return 100.0 * (predicted - recorded) / recorded if recorded else 0.0


def unmatched(recorded: list[tuple[int, str]], predicted: list[tuple[int, str]]
              ) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]], int]:
    """Align two allocation sequences by size: what each has that the other has not, and
    how many allocations they share.

    Sites do not take part: the GPU records no stack for autograd's thread, and Python
    versions differ in the line they give a multi-line statement.
    """
    matcher = difflib.SequenceMatcher(None, [size for size, _ in recorded],
                                      [size for size, _ in predicted], autojunk=False)
    only: tuple[Counter, Counter] = (Counter(), Counter())
    same = 0
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            same += i2 - i1
        else:
            only[0].update(recorded[i1:i2])
            only[1].update(predicted[j1:j2])
    recorded_only, predicted_only = (
        sorted(((site, size, n) for (size, site), n in c.items()),
               key=lambda x: (-x[1] * x[2], x[0], x[1])) for c in only)
    return recorded_only, predicted_only, same


def _differing_text(comparison: Comparison) -> str:
    if not comparison.differing:
        return "none"
    return "; ".join(f"{size / MIB:.2f} MiB x{recorded}->{predicted}"
                     for size, recorded, predicted in comparison.differing)


# -- running a script under the virtual GPU --------------------------------------------


@dataclass
class Outcome:
    """One run: the comparison, or why there is none."""

    run: Run
    comparison: Comparison | None = None
    predicted: Measured | None = None
    recorded: Measured | None = None
    printed: str = ""  # the peak the script printed, and its log's where there is one
    problem: str = ""
    seconds: float = 0.0
    torch: str = ""  # the torch that ran the prediction


@dataclass(frozen=True)
class Interpreter:
    """A Python that can run the scripts: its version and its torch's (major.minor)."""

    path: str
    python: tuple[int, int]
    torch: str


def probe(path: str) -> Interpreter:
    """The versions of the interpreter at ``path``; exits if it cannot import torch."""
    code = "import sys, torch; print(*sys.version_info[:2], torch.__version__)"
    done = subprocess.run([path, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"groundtruth: {path} cannot run torch: {_reason(done.stderr)}")
    major, minor, version = done.stdout.split()
    return Interpreter(path, (int(major), int(minor)),
                       ".".join(version.split("+")[0].split(".")[:2]))


def choose(run: Run, interpreters: list[Interpreter]) -> Interpreter | None:
    """The first interpreter new enough for ``run``'s script, one with the torch the GPU
    run used when there is one."""
    usable = [i for i in interpreters if i.python >= run.python]
    same = [i for i in usable if i.torch == run.torch]
    return (same or usable or [None])[0]


_PRINTED = re.compile(r"Peak (?:allocated memory|memory allocated): ([0-9.]+) (GiB|MB)")


def run_one(run: Run, checkout: Path, timeout: float, interpreter: Interpreter | None,
            memprof: Path = ROOT, memory_limit: int = 6 * GIB) -> Outcome:
    """Run ``run``'s script under the virtual GPU in a scratch folder and compare its dump.

    ``memprof`` is the source tree whose ``memprof run`` runs it; the run may map at most
    ``memory_limit`` bytes (a virtual GPU holds no device memory on the host: a run that
    needs more is reported instead of exhausting the machine).
    """
    outcome = Outcome(run, recorded=measure(load_snapshot(GROUNDTRUTH / "snapshots" / run.fixture)))
    if interpreter is None:
        outcome.problem = (f"not run: the script needs Python {'.'.join(map(str, run.python))}"
                           " (give one with --python)")
        return outcome
    outcome.torch = interpreter.torch
    with tempfile.TemporaryDirectory(prefix="groundtruth-") as scratch:
        cwd = Path(scratch) / run.cwd
        cwd.mkdir(parents=True, exist_ok=True)
        (Path(scratch) / run.dump).parent.mkdir(parents=True, exist_ok=True)
        paths = [str(memprof), *(str(checkout / p) for p in run.pythonpath)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        argv = [interpreter.path, "-m", "memprof", "run", "--virtual-gpu", CARD,
                "-o", str(Path(scratch) / "memprof"), "--force",
                str(checkout / run.script), *run.args]
        start = time.perf_counter()
        try:
            done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=timeout, preexec_fn=lambda: resource.setrlimit(
                                      resource.RLIMIT_AS, (memory_limit, memory_limit)))
        except subprocess.TimeoutExpired:
            outcome.problem = f"timed out after {timeout:.0f} s"
            return outcome
        outcome.seconds = time.perf_counter() - start
        dump = Path(scratch) / run.dump
        if done.returncode != 0 or not dump.is_file():
            outcome.problem = f"exit {done.returncode}, no dump: {_reason(done.stderr)[:200]}"
            return outcome
        outcome.predicted = measure(load_snapshot(dump))
    outcome.comparison = compare(outcome.predicted, outcome.recorded)
    outcome.printed = _printed(done.stdout, run.log)
    return outcome


_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b")


def _reason(stderr: str) -> str:
    """The exception a failed run ended with, else its last line."""
    lines = stderr.strip().splitlines() or ["no output"]
    return next((line for line in reversed(lines) if _EXCEPTION.match(line)), lines[-1])


def _printed(stdout: str, log: str | None) -> str:
    said = _PRINTED.search(stdout)
    if said is None:
        return ""
    text = f"{said.group(1)} {said.group(2)}"
    logged = _PRINTED.search((GROUNDTRUTH / "logs" / log).read_text()) if log else None
    return f"{text} (log {logged.group(1)} {logged.group(2)})" if logged else text


def find_checkouts(paths: list[str]) -> dict[str, Path]:
    """Checkouts by ``<owner>+<repo>@<commit>``, from folder names (commit prefixes match)."""
    found = {}
    for text in paths:
        path = Path(text).resolve()
        if not path.is_dir() or "@" not in path.name:
            sys.exit(f"groundtruth: {text} is not a folder named <owner>+<repo>@<commit>")
        name, commit = path.name.split("@", 1)
        for run in RUNS:
            want_name, want_commit = run.checkout.split("@")
            if name == want_name and (want_commit.startswith(commit[:10])
                                      or commit.startswith(want_commit)):
                found[run.checkout] = path
    return found


# -- the tables -------------------------------------------------------------------------


def summary(outcomes: list[Outcome]) -> str:
    """Median and worst absolute errors against the targets."""
    compared = [o.comparison for o in outcomes if o.comparison is not None]
    if not compared:
        return "No run was compared."
    lines = []
    for what, (median_target, worst_target) in TARGETS.items():
        errors = [abs(getattr(c, f"{what}_error")) for c in compared]
        median, worst = statistics.median(errors), max(errors)
        verdict = "met" if median <= median_target and worst <= worst_target else "NOT met"
        lines.append(f"peak {what}: median error {median:.2f}%, worst {worst:.2f}% over "
                     f"{len(errors)} runs (target {median_target:g}% / {worst_target:g}%: "
                     f"{verdict})")
    return "\n".join(lines)


def rows(outcomes: list[Outcome]) -> list[list[str]]:
    table = []
    for o in outcomes:
        recorded = o.recorded
        assert recorded is not None
        if o.comparison is None or o.predicted is None:
            table.append([o.run.label, o.run.torch, "-", f"{recorded.allocated / MIB:,.1f}",
                          "-", "-", f"{recorded.reserved / MIB:,.0f}", "-", "-", "-", "",
                          o.problem.replace("|", "/")])
            continue
        c, p = o.comparison, o.predicted
        table.append([o.run.label, o.run.torch, o.torch, f"{recorded.allocated / MIB:,.1f}",
                      f"{p.allocated / MIB:,.1f}", f"{c.allocated_error:+.2f}%",
                      f"{recorded.reserved / MIB:,.0f}", f"{p.reserved / MIB:,.0f}",
                      f"{c.reserved_error:+.2f}%", f"{c.matched:.1f}%", o.printed,
                      _differing_text(c)])
    return table


HEADER = ["run", "torch (GPU)", "torch (predicted)", "alloc MiB (GPU)", "alloc MiB (predicted)",
          "error", "reserved MiB (GPU)", "reserved MiB (predicted)", "error",
          "GPU allocations matched", "script printed",
          "sizes whose counts differ"
          " (recorded -> predicted)"]


def details(outcomes: list[Outcome]) -> str:
    """Per run, the allocations only the GPU made and only the prediction made."""
    lines = []
    for o in outcomes:
        c = o.comparison
        if c is None or not (c.recorded_only or c.predicted_only):
            continue
        lines.append(f"- {o.run.label}: only on the GPU: {_sites_text(c.recorded_only)};"
                     f" only predicted: {_sites_text(c.predicted_only)}")
    return ("Allocations one trace has and the other has not, once the two sequences are"
            " aligned (site, size x count, most bytes first):\n\n" + "\n".join(lines)
            ) if lines else ""


def _sites_text(found: list[tuple[str, int, int]]) -> str:
    return ", ".join(f"{site} {size / MIB:.2f} MiB x{n}" for site, size, n in found) or "none"


def self_check() -> int:
    """Compare every fixture with itself and with a neighbour; 1 if the comparison is wrong."""
    measured = {r.fixture: measure(load_snapshot(GROUNDTRUTH / "snapshots" / r.fixture))
                for r in RUNS}
    wrong = 0
    for run, neighbour in zip(RUNS, RUNS[1:] + RUNS[:1], strict=True):
        same = compare(measured[run.fixture], measured[run.fixture])
        other = compare(measured[neighbour.fixture], measured[run.fixture])
        exact = not (same.allocated_error or same.reserved_error or same.differing
                     or same.recorded_only or same.predicted_only) and same.matched == 100.0
        told_apart = bool(other.differing and other.allocated_error)
        wrong += (not exact) + (not told_apart)
        print(f"{run.label}: itself {'identical' if exact else 'WRONG: differs'}; as predicted"
              f" by {neighbour.label}: allocated {other.allocated_error:+.2f}%, reserved"
              f" {other.reserved_error:+.2f}%, {_differing_text(other)}")
    print(f"{len(RUNS)} snapshots: {'comparison checked' if not wrong else f'{wrong} WRONG'}")
    return 1 if wrong else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkouts", nargs="*", help="<owner>+<repo>@<commit> folders")
    parser.add_argument("--only", help="only runs whose snapshot name contains this")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--memprof", type=Path, default=ROOT,
                        help="the memprof source tree to run (default: this one)")
    parser.add_argument("--memory-limit", type=float, default=6.0, metavar="GIB",
                        help="address space a run may map (default 6 GiB)")
    parser.add_argument("--python", action="append", metavar="PATH",
                        help="an interpreter to run the scripts with (repeatable; each run takes"
                             " the first new enough for its script, with the torch its GPU run"
                             " used where one has it; default: this one)")
    parser.add_argument("--self-check", action="store_true")
    args = parser.parse_args()
    if not (GROUNDTRUTH / "snapshots").is_dir():
        sys.exit(f"groundtruth: no snapshots in {GROUNDTRUTH} (set MEMPROF_GROUNDTRUTH)")
    if args.self_check:
        return self_check()
    checkouts = find_checkouts(args.checkouts)
    chosen = [r for r in RUNS if r.checkout in checkouts and (not args.only
                                                              or args.only in r.fixture)]
    if not chosen:
        sys.exit("groundtruth: no run matches these checkouts; name them "
                 + ", ".join(sorted({r.checkout for r in RUNS})))
    interpreters = [probe(path) for path in args.python or [sys.executable]]
    outcomes = []
    for run in chosen:
        outcome = run_one(run, checkouts[run.checkout], args.timeout,
                          choose(run, interpreters), args.memprof.resolve(),
                          int(args.memory_limit * GIB))
        print(f"{run.label}: {outcome.problem or f'{outcome.seconds:.0f} s'}", file=sys.stderr)
        outcomes.append(outcome)
    missing = sorted({r.checkout for r in RUNS} - set(checkouts))
    notes = "\n\n".join(part for part in (
        f"Each script run unmodified under `memprof run --virtual-gpu '{CARD}'` (the"
        " ground-truth cards are not recorded; none was a Hopper), with the torch release"
        " the GPU run used where one was given (`--python`): autograd's graph, and so the"
        " allocations of backward, change between releases. Peaks as `memprof"
        " explain` computes them on the dumped and the recorded snapshot (the recorded"
        " window only). Targets: allocated 1% median / 3% worst, reserved 3% / 8%.",
        summary(outcomes), details(outcomes),
        f"No checkout given for: {', '.join(missing)}." if missing else "") if part)
    write_table("groundtruth", HEADER, rows(outcomes), notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
