"""Run a call in a forked copy of memprof while memprof goes on: its result comes back pickled.

A script that has ended leaves a core idle, and memprof's work after it has pieces that
need only what is in memory already: labelling the trace while it is laid out, writing
the snapshot while it is analysed. The copy shares memprof's memory (copy on write), so
memprof can drop what only the copy needs. The copy ignores Ctrl-C: memprof decides
(``finishing``), and when it abandons the work a SIGTERM ends the copy (``write_atomic``
removes its temporary file on the way out).

Where ``fork`` is unavailable or fails, or CUDA is initialised (a forked CUDA context is
unusable; the GPU path works as before), the call is made at once, here.

    with Forked(lambda: write_snapshot(snapshot, path)) as writing:
        del snapshot           # this process's copy can go
        analyse()
        writing.result()       # the call's value, or its exception raised here
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import warnings
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Generic, TypeVar

from memprof.errors import MemprofError

T = TypeVar("T")


class Forked(Generic[T]):
    """``call`` made in a forked child; ``result`` waits for it. A context manager that
    abandons the call (SIGTERM) when its block raises."""

    def __init__(self, call: Callable[[], T]) -> None:
        self._pid: int | None = None
        self._pipe = -1  # the child's pickled outcome arrives here
        self._outcome: tuple[bool, object] | None = None  # (raised, value) of a call made here
        if not can_fork():
            self._outcome = _outcome(call)
            return
        read, end = os.pipe()
        try:
            with warnings.catch_warnings():  # Python 3.12+ warns of fork with threads running
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError:  # no memory for the page tables, a process limit: call it here
            os.close(read)
            os.close(end)
            self._outcome = _outcome(call)
            return
        if pid == 0:
            _child(call, end)
        os.close(end)
        self._pid, self._pipe = pid, read

    def result(self) -> T:
        """Wait for the call to end: its value, or its exception raised here."""
        if self._pid is not None:
            chunks = []
            while chunk := os.read(self._pipe, 1 << 16):
                chunks.append(chunk)
            status = _wait(self._pid)
            os.close(self._pipe)
            self._pid = None
            if status != 0 or not chunks:
                raise MemprofError(f"memprof's worker process ended with status {status}"
                                   " before its work was done; run again for a full report")
            self._outcome = pickle.loads(b"".join(chunks))  # from memprof's own child
        raised, value = self._outcome  # type: ignore[misc]
        if raised:
            raise value  # type: ignore[misc]
        return value  # type: ignore[return-value]

    def __enter__(self) -> Forked[T]:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        pid, self._pid = self._pid, None
        if pid is None:
            return
        os.close(self._pipe)
        if exc is not None:  # abandoned: the child ends now
            os.kill(pid, signal.SIGTERM)
        _wait(pid)


def _wait(pid: int) -> int:
    """The child's exit status; 0 if the script's own handling of SIGCHLD reaped it (its
    outcome, sent first, tells how it went)."""
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return 0


def can_fork() -> bool:
    """Whether a forked copy of memprof works here: not on macOS, not once CUDA is up."""
    if not hasattr(os, "fork") or sys.platform == "darwin":  # macOS: fork with threads hangs
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


def _outcome(call: Callable[[], T]) -> tuple[bool, object]:
    try:
        return False, call()
    except Exception as exc:  # raised by ``result``, as the child's are
        return True, exc


def _child(call: Callable[[], object], end: int) -> None:
    """The forked child: make the call, send its outcome, and exit at once (none of
    memprof's or the script's exit handlers run twice)."""
    code = 1
    try:
        # only the pipe to memprof stays open: a pipe's reader sees its end when every
        # copy of the writing end is closed (the timeline's child waits for its job so)
        os.closerange(3, end)
        os.closerange(end + 1, os.sysconf("SC_OPEN_MAX"))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _abandon)
        raised, value = _outcome(call)
        try:
            data = pickle.dumps((raised, value))
        except Exception as exc:  # a value that does not pickle (memprof's bug): one line
            data = pickle.dumps((True, MemprofError(f"memprof's worker process could not send"
                                                    f" its result ({exc})")))
        with os.fdopen(end, "wb") as pipe:
            pipe.write(data)
        code = 0
    finally:
        os._exit(code)


def _abandon(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(1)
