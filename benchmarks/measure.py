"""Timing and peak memory of a command run in a fresh process (shared by the benchmarks)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Run:
    seconds: float
    peak_rss_mib: float
    cpu_seconds: float = 0.0  # user + system time of the command: less sensitive to load


def run(argv: list[str], cwd: Path | None = None, repeat: int = 1,
        stdout: Path | None = None, codes: tuple[int, ...] = (0,)) -> Run:
    """Run ``argv`` in a fresh child ``repeat`` times: the median wall time, the peak RSS.
    The command's standard output is dropped, or written to ``stdout`` (the last run's);
    an exit code not in ``codes`` is an error.

    This machine's timings vary by tens of percent from run to run; medians of three
    make a ratio worth quoting.
    """
    return summarise([_run_once(argv, cwd, stdout, codes) for _ in range(repeat)])


def summarise(runs: list[Run]) -> Run:
    """The median wall and CPU seconds of ``runs``, and their largest peak RSS."""
    return Run(statistics.median(r.seconds for r in runs), max(r.peak_rss_mib for r in runs),
               statistics.median(r.cpu_seconds for r in runs))


def _run_once(argv: list[str], cwd: Path | None, stdout: Path | None,
              codes: tuple[int, ...] = (0,)) -> Run:
    code = (
        "import resource, subprocess, sys, time\n"
        "out = open(sys.argv[1], 'w') if sys.argv[1] else subprocess.DEVNULL\n"
        "t = time.perf_counter()\n"
        "rc = subprocess.run(sys.argv[2:], stdout=out).returncode\n"
        "dt = time.perf_counter() - t\n"
        "usage = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "print(rc, dt, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(stdout or ""), *argv], cwd=cwd,
                         check=True, capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "120"})
    rc, seconds, rss, cpu = out.stdout.split()
    if int(rc) not in codes:
        raise RuntimeError(f"{argv} exited with {rc}")
    return Run(float(seconds), float(rss), float(cpu))


def table_text(header: list[str], rows: list[list[str]], notes: str) -> str:
    """A markdown table and the notes under it."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n\n" + notes.strip() + "\n"


def write_table(name: str, header: list[str], rows: list[list[str]], notes: str) -> Path:
    """Print a markdown table and write it to ``results/<name>.md``."""
    return write_text(name, table_text(header, rows, notes))


def write_text(name: str, text: str) -> Path:
    """Print ``text`` and write it to ``results/<name>.md`` under a title."""
    print(text)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(f"# {name}\n\n{text}")
    return path


def machine() -> str:
    return f"{os.cpu_count()} cores, Python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d')}"


def error(predicted: int, real: int) -> str:
    """The relative error of ``predicted`` against ``real``, as a signed percentage."""
    return f"{100 * (predicted / real - 1):+.2f}%"
