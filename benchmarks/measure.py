"""Timing and peak memory of a command run in a fresh process (shared by the benchmarks)."""

from __future__ import annotations

import os
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


def run(argv: list[str], cwd: Path | None = None) -> Run:
    """Run ``argv`` in a child, after a warm-up for the file cache; wall time and peak RSS."""
    code = (
        "import resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode\n"
        "dt = time.perf_counter() - t\n"
        "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
        "print(rc, dt, rss)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *argv], cwd=cwd, check=True,
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "120"})
    rc, seconds, rss = out.stdout.split()
    if rc != "0":
        raise RuntimeError(f"{argv} exited with {rc}")
    return Run(float(seconds), float(rss))


def write_table(name: str, header: list[str], rows: list[list[str]], notes: str) -> Path:
    """Print a markdown table and write it to ``results/<name>.md``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines) + "\n\n" + notes.strip() + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(f"# {name}\n\n{text}")
    return path


def machine() -> str:
    return f"{os.cpu_count()} cores, Python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d')}"
