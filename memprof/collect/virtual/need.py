"""What a run that ran out of memory needed: the same script again, the card's memory raised.

The peak of a run that died of an out-of-memory error is a lower bound: the run never got
past it. On the virtual GPU the script can run again on the same card (its kernels,
workspaces and allocator settings) with memory enough for anything, through the point
where it failed and on, for the optimizer steps the user asked for (or the steps it had
made and two more). That run's peak reserved memory, plus the CUDA context, is what the
card would need.

The re-run is a fresh ``memprof run`` process (the script starts from a clean state, its
output is not shown twice) writing its own run folder, :data:`NEED_FOLDER` inside the
failed run's: ``memprof suggest`` advises from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memprof.collect.launch.script import Target
from memprof.collect.virtual.cards import Card, card_args

RAISED_BYTES = 1 << 44  # 16 TiB: more than any one process's training step asks for
STEPS_PAST = 2  # optimizer steps past those the failed run made: the steady state shows
MIN_SECONDS = 120.0  # the re-run's time, at least (a script without optimizer steps)
SLOWER = 10  # and at most this many times the failed run's
NEED_FOLDER = "need"  # the re-run's run folder, inside the failed run's


@dataclass(frozen=True, slots=True)
class Need:
    """The memory a run needs on ``card_bytes``, from its re-run with the memory raised."""

    card_bytes: int
    context_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    status: str  # how the re-run ended: completed, stopped, raised, ...
    optimizer_steps: int
    stopped_by: str | None
    # what the process could reserve where less than the card less its context (the cap
    # of set_per_process_memory_fraction, or memory other processes held); None: no less
    allowed_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        """Reserved memory at the peak and the CUDA context: what the card must hold."""
        return self.reserved_bytes + self.context_bytes

    @property
    def short_bytes(self) -> int:
        """What the card (or the process's cap) lacks."""
        short = self.total_bytes - self.card_bytes
        if self.allowed_bytes is not None:
            short = max(short, self.reserved_bytes - self.allowed_bytes)
        return max(0, short)

    def as_dict(self) -> dict[str, Any]:
        """``run.need`` in report.json."""
        return {"card_bytes": self.card_bytes, "context_bytes": self.context_bytes,
                "allocated_bytes": self.allocated_bytes, "reserved_bytes": self.reserved_bytes,
                "total_bytes": self.total_bytes, "short_bytes": self.short_bytes,
                "allowed_bytes": self.allowed_bytes,
                "rerun": {"status": self.status, "optimizer_steps": self.optimizer_steps,
                          "stopped_by": self.stopped_by}}


class NeedCheck:
    """What ``memprof run`` does after a virtual-GPU run: if it ran out of memory, tell
    what it needed (``predict_need``) for ``run.need`` in report.json."""

    def __init__(self, target: Target, card: Card, conf: str, steps: int | None,
                 folder: Path) -> None:
        self.target, self.card, self.conf, self.steps = target, card, conf, steps
        self.folder = folder / NEED_FOLDER

    def __call__(self, ran_out: bool, steps_made: int, seconds: float,
                 allowed: int | None) -> dict[str, Any] | None:
        """``allowed``: the cap the process ran under (a memory fraction), if any."""
        if not ran_out:
            return None
        print(f"memprof: the run ran out of memory, so its peak is a lower bound; running it"
              f" again on the virtual {self.card.name} with its memory raised to tell what it"
              " needs (--no-need skips this)", file=sys.stderr)
        need = predict_need(self.target, self.card, self.conf, steps_made, self.steps, seconds,
                            self.folder, allowed=allowed)
        return need.as_dict() if isinstance(need, Need) else {"unknown": need}


def rerun_command(target: Target, card: Card, conf: str, steps: int, seconds: float,
                  folder: Path) -> list[str]:
    """The ``memprof run`` that re-runs ``target`` on ``card`` with its memory raised."""
    return [sys.executable, "-m", "memprof", "run", *card_args(card),
            "--virtual-gpu-memory", str(RAISED_BYTES), "--alloc-conf", conf, "--no-need",
            "--no-timeline", "--steps", str(steps), "--seconds", f"{seconds:g}",
            "-o", str(folder), "--force", *target.option, target.name, *target.args]


def predict_need(target: Target, card: Card, conf: str, steps_made: int,
                 steps_asked: int | None, seconds_taken: float, folder: Path,
                 cwd: str | None = None, allowed: int | None = None) -> Need | str:
    """Re-run ``target`` on ``card`` with its memory raised, from ``cwd`` (default: here)
    into run folder ``folder``, and return what it needed (against ``allowed``, the cap the
    run had, if any), or why that could not be told (a one-line reason)."""
    steps = steps_asked or steps_made + STEPS_PAST + 1
    seconds = max(MIN_SECONDS, SLOWER * seconds_taken)
    command = rerun_command(target, card, conf, steps, seconds, folder)
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, errors="replace",
                              timeout=seconds + 120, check=False, cwd=cwd)
    except subprocess.TimeoutExpired:
        return f"the re-run with the memory raised did not end within {seconds + 120:g} s"
    try:
        report = json.loads((folder / "report.json").read_text())
    except (OSError, ValueError):
        last = done.stderr.strip().splitlines()[-1:] or ["no output"]
        return f"the re-run with the memory raised wrote no report ({last[0][:200]})"
    return need_of(report, card, allowed)


def need_of(report: dict[str, Any], card: Card, allowed: int | None = None) -> Need | str:
    """What the run that wrote ``report``, a re-run with the memory raised, needs on
    ``card``, or why that cannot be told."""
    run = report["run"]
    device = report["devices"][0] if report["devices"] else None
    if device is None:
        return "the re-run with the memory raised made no CUDA tensor"
    if device["oom"] is not None:
        return (f"the script ran out of memory even with {RAISED_BYTES >> 40} TiB: it needs"
                " more than any one GPU has")
    return Need(card.total_bytes, card.context_bytes, device["peak"]["allocated_bytes"],
                device["peak"]["reserved_bytes"], run["exit"]["status"],
                run["optimizer_steps"], run.get("stopped_by"),
                allowed if allowed is not None and allowed < card.usable_bytes else None)
