"""How a recorded run may end early: Ctrl-C, SIGTERM, ``--steps`` and ``--seconds``.

While the script runs, SIGINT raises KeyboardInterrupt in the script, as Python's own
handler does, except when it lands inside one of memprof's recorder callbacks: there
Python would print "Exception ignored" and the script would train on, so the signal is
delivered again a moment later, when the script's own code runs. SIGTERM stops the run
the same way and the process exits 143, as a Python killed by SIGTERM reports to shells.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import memprof

_MEMPROF = str(Path(memprof.__file__).resolve().parent) + os.sep
_RETRY_S = 0.02


class Stop(BaseException):
    """Ends the script early; ``reason`` goes to the report as ``run.stopped_by``."""

    def __init__(self, reason: str, exit_code: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_code = exit_code


def _in_memprof(frame: FrameType | None) -> bool:
    return frame is not None and frame.f_code.co_filename.startswith(_MEMPROF)


def _redeliver(signum: int) -> None:
    threading.Timer(_RETRY_S, os.kill, (os.getpid(), signum)).start()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if _in_memprof(frame):
        _redeliver(signum)
        return
    raise KeyboardInterrupt


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if _in_memprof(frame):
        _redeliver(signum)
        return
    raise Stop("SIGTERM", 128 + signal.SIGTERM)


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    if _in_memprof(frame):
        _redeliver(signum)
        return
    raise Stop("seconds", 0)


@contextmanager
def stops(steps: int | None = None, seconds: float | None = None) -> Iterator[None]:
    """Install memprof's handlers for the script's run; stop after ``steps`` optimizer steps
    or ``seconds`` of wall time by raising :class:`Stop` in the script."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    signal.signal(signal.SIGINT, _on_sigint)
    signal.signal(signal.SIGTERM, _on_sigterm)
    hook = _step_limit(steps) if steps is not None else None
    if seconds is not None:
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if seconds is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if hook is not None:
            hook.remove()
        for s, handler in saved.items():
            signal.signal(s, handler)


def _step_limit(steps: int) -> Any:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from memprof.collect.hooks.step_pace import END, StepPace

    done = 0
    pace = StepPace()  # as the report counts steps: one per iteration of several optimizers

    def count(optimizer: Any, args: Any, kwargs: Any) -> None:
        nonlocal done
        if pace.at(optimizer) == END:
            done += 1
            if done >= steps:  # (with several optimizers, --steps 1 ends at the first's step)
                raise Stop("steps", 0)

    return register_optimizer_step_post_hook(count)


@contextmanager
def finishing() -> Iterator[None]:
    """While memprof writes the report, a first Ctrl-C (or SIGTERM) only says so; a second
    one abandons the report with KeyboardInterrupt. Files are written atomically, so the
    folder holds only whole files either way."""
    asked = False

    def once(signum: int, frame: FrameType | None) -> None:
        nonlocal asked
        if asked:
            raise KeyboardInterrupt
        asked = True
        print("memprof: writing the report; press Ctrl-C again to abandon it",
              file=sys.stderr, flush=True)

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in saved:
        signal.signal(s, once)
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)

