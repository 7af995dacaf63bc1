"""How a recorded run may end early: Ctrl-C, a terminating signal, ``--steps`` and
``--seconds``.

While the script runs, SIGINT raises KeyboardInterrupt in the script, as Python's own
handler does, except when it lands inside one of memprof's recorder callbacks: there
Python would print "Exception ignored" and the script would train on, so the signal is
delivered again a moment later, when the script's own code runs. Every other signal whose
default is to end the process (SIGTERM, a closed terminal's SIGHUP, SIGQUIT, SIGUSR1, an
alarm the script left armed, ...) stops the run the same way, with a report, and the
process exits 128 + the signal's number, as a Python killed by it reports to shells. A
signal the launching shell ignores (``nohup``) stays ignored, and one the script handles
itself is the script's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import memprof

_MEMPROF = str(Path(memprof.__file__).resolve().parent) + os.sep
_RETRY_S = 0.02


class Stop(BaseException):
    """Ends the script early; ``reason`` goes to the report as ``run.stopped_by``. ``last``:
    the reason and exit code of the one raised, for a followed child's report
    (``_ChildStop``; not the exception, whose traceback holds the script's frames)."""

    last: tuple[str, int] | None = None

    def __init__(self, reason: str, exit_code: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_code = exit_code
        Stop.last = (reason, exit_code)


class _ChildStop(Stop, SystemExit):
    """A followed child's ``Stop``: in a process the script started (``mp.spawn``'s),
    multiprocessing ends the child with a ``SystemExit``'s code, as ``sys.exit`` would, where
    it reports any other exception as a failure."""

    def __init__(self, reason: str, exit_code: int) -> None:
        super().__init__(reason, exit_code)
        self.code = exit_code


def _stop(reason: str, exit_code: int) -> Stop:
    """The ``Stop`` to raise in this process's script."""
    return (_ChildStop if _CHILD[0] == "running" else Stop)(reason, exit_code)


_WAITING: set[CodeType] = set()  # memprof's functions that wait: a signal may end them


def waiting(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as waiting on another process (a rank's exchange through the store):
    the launcher's SIGTERM or a Ctrl-C ends the script inside it, as inside the script."""
    _WAITING.add(fn.__code__)
    return fn


def _in_memprof(frame: FrameType | None) -> bool:
    return frame is not None and frame.f_code.co_filename.startswith(_MEMPROF) \
        and frame.f_code not in _WAITING


def _redeliver(signum: int) -> None:
    threading.Timer(_RETRY_S, os.kill, (os.getpid(), signum)).start()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if _in_memprof(frame):
        _redeliver(signum)
        return
    raise KeyboardInterrupt


# signals whose default action ends the process, that a handler can catch
TERMINATING = tuple(getattr(signal, name) for name in (
    "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM", "SIGPROF",
    "SIGXCPU", "SIGPWR", "SIGSTKFLT") if hasattr(signal, name))


def _on_terminating(signum: int, frame: FrameType | None) -> None:
    if _in_memprof(frame):
        _redeliver(signum)
        return
    raise _stop(signal.Signals(signum).name, 128 + signum)


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    if _in_memprof(frame):
        _redeliver(signum)
        return
    raise _stop("seconds", 0)


_CHILD = ["starting"]  # a followed child's script: "starting", "running", "ended"


def _on_terminating_child(signum: int, frame: FrameType | None) -> None:
    if _CHILD[0] == "starting":  # as Python's default: the process ends
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    elif _CHILD[0] == "running":
        if _in_memprof(frame):
            _redeliver(signum)
            return
        raise SystemExit(128 + signum)  # multiprocessing's child prints no traceback for it


_HANDLERS = (_on_sigint, _on_terminating, _on_alarm, _on_terminating_child)
# the handlers' frames: Python's own default handler is C and shows in no traceback
HANDLER_CODES = frozenset(f.__code__ for f in _HANDLERS)


def _defaults_in_child() -> None:
    """A process the script forks (a multiprocessing worker) ends as Python's would: a
    SIGTERM from ``Pool.terminate()`` kills it, Ctrl-C raises KeyboardInterrupt."""
    for s in (signal.SIGINT, *TERMINATING):
        if signal.getsignal(s) in _HANDLERS:
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT
                          else signal.SIG_DFL)


os.register_at_fork(after_in_child=_defaults_in_child)


def child_signals() -> None:
    """In a child process memprof follows, before its script: a terminating signal
    (``Pool.terminate()``, ``mp.spawn`` stopping the other ranks) ends the process as
    Python's default does until ``child_script`` runs, exits the script there as
    ``sys.exit(128 + signal)`` does (multiprocessing's child prints nothing for it), and is
    ignored after it, while the report is written. ``stops`` leaves them be."""
    for s in _default(TERMINATING):
        signal.signal(s, _on_terminating_child)


@contextmanager
def child_script() -> Iterator[None]:
    """A followed child's script runs (``child_signals``)."""
    _CHILD[0] = "running"
    try:
        yield
    finally:
        _CHILD[0] = "ended"


@contextmanager
def stops(steps: int | None = None, seconds: float | None = None) -> Iterator[None]:
    """Install memprof's handlers for the script's run; stop after ``steps`` optimizer steps
    or ``seconds`` of wall time by raising :class:`Stop` in the script."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, *_default(TERMINATING))}
    for s in saved:
        signal.signal(s, _on_sigint if s == signal.SIGINT else _on_terminating)
    hook = _step_limit(steps) if steps is not None else None
    if seconds is not None:
        saved.setdefault(signal.SIGALRM, signal.getsignal(signal.SIGALRM))
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


def _default(signals: tuple[int, ...]) -> list[int]:
    """Those of ``signals`` left at their default action (not ignored, not handled)."""
    return [s for s in signals if signal.getsignal(s) == signal.SIG_DFL]


def _step_limit(steps: int) -> Any:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from memprof.collect.hooks.step_pace import END, MOVE, StepPace

    done = 0
    pace = StepPace()  # as the report counts steps: one per iteration of several optimizers

    def count(optimizer: Any, args: Any, kwargs: Any) -> None:
        nonlocal done
        mark = pace.at(optimizer)
        done += mark == END
        # in the first iteration, a step ends for good once every optimizer has stepped
        # (a GAN's generator steps after its discriminator): --steps 1 ends after both
        if done >= steps and mark in (END, MOVE) and (
                pace.first_cycle is None or pace.first_cycle >= _live_optimizers()):
            raise _stop("steps", 0)

    return register_optimizer_step_post_hook(count)


def _live_optimizers() -> int:
    """The optimizers the script has made and still holds."""
    import gc

    from torch.optim import Optimizer

    return sum(isinstance(o, Optimizer) for o in gc.get_objects())


@contextmanager
def finishing() -> Iterator[None]:
    """While memprof writes the report, a first Ctrl-C (or a terminating signal) only says
    so; a second one abandons the report with KeyboardInterrupt. Files are written
    atomically, so the folder holds only whole files either way."""
    asked = False

    def once(signum: int, frame: FrameType | None) -> None:
        nonlocal asked
        if asked:
            raise KeyboardInterrupt
        asked = True
        with contextlib.suppress(OSError, ValueError):  # a closed terminal (SIGHUP)
            print("memprof: writing the report; press Ctrl-C again to abandon it",
                  file=sys.stderr, flush=True)

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, *_default(TERMINATING))}
    for s in saved:
        signal.signal(s, once)
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)

