"""A time limit on the work a file anyone can write may cost: the work goes on in a forked
child, and this process ends it when it outlasts what any real file of its size needs.

Each pass of memprof over a snapshot is near-linear, but a pickle can make the unpickler's
own C code loop far beyond the file's size: a dict key that is a tuple of a memo-shared
tuple of a memo-shared tuple ..., 60 levels in 431 bytes, is hashed in 2^60 steps, and no
Python code (a signal handler, another thread) runs until the hashing ends. Only another
process can stop it. So the command runs in a child; this process waits, exits with the
child's exit code, and after the limit kills it and says so in one line (exit 2).

    supervise(time_limit(size), f"{path}: reading it takes ...")   # returns in the child
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from types import FrameType

from memprof.forked import can_fork

BASE_SECONDS = 60  # the interpreter, imports, a small file on a loaded machine: many times over
SECONDS_PER_MIB = 1.0  # a real snapshot takes about 0.035 s per MiB to explain on 2 cores
LIMIT_VARIABLE = "MEMPROF_TIME_LIMIT"


def time_limit(size: int) -> float:
    """Seconds the work on ``size`` bytes of snapshots may take: ``$MEMPROF_TIME_LIMIT``, or
    about 30 times what a real snapshot of that size needs."""
    text = os.environ.get(LIMIT_VARIABLE, "")
    try:
        given = float(text)
    except ValueError:
        given = 0.0
    if 0 < given < 1e9:
        return given
    return BASE_SECONDS + SECONDS_PER_MIB * size / 2**20


def supervise(seconds: float, message: str) -> None:
    """Return in a forked child that goes on with the work; in this process, wait for it and
    exit with its code, or after ``seconds`` kill it and exit 2 with ``message``. Where
    there is no fork, return at once (no limit)."""
    if not can_fork():
        return
    for stream in (sys.stdout, sys.stderr):  # or both processes would write what is buffered
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    try:
        pid = os.fork()
    except OSError:
        return
    if pid == 0:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the child: its code is ours

    def forward(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    signal.signal(signal.SIGTERM, forward)
    status = _wait(pid, time.monotonic() + seconds)
    if status is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print(f"memprof: error: {message} (more than {seconds:g} s; {LIMIT_VARIABLE}=SECONDS"
              " allows more)", file=sys.stderr)
        os._exit(2)
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)  # killed by a signal: as a shell reports it


def _wait(pid: int, deadline: float) -> int | None:
    """The child's wait status, or None at ``deadline``."""
    watch = _pidfd(pid)
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if watch is None:
                time.sleep(min(left, 0.02))
            else:
                with contextlib.suppress(InterruptedError):
                    select.select([watch], [], [], left)
    finally:
        if watch is not None:
            os.close(watch)


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` ends (Linux 5.3+), or None."""
    try:
        return os.pidfd_open(pid)  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return None
