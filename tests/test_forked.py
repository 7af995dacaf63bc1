"""Work done by a forked copy of memprof: its result or its error comes back, an abandoned
one leaves no file behind, and the copy holds no pipe another process waits on."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from memprof import forked
from memprof.errors import MemprofError
from memprof.forked import Forked
from memprof.report.files import write_atomic


def test_the_call_runs_in_a_copy_and_its_value_comes_back() -> None:
    with Forked(lambda: (os.getpid(), list(range(5)))) as work:
        pid, value = work.result()
    assert pid != os.getpid() and value == [0, 1, 2, 3, 4]


def test_its_error_is_raised_here_with_its_type_and_exit_code(tmp_path: Path) -> None:
    def fails() -> None:
        raise MemprofError(f"{tmp_path}: cannot write (No space left on device)", exit_code=1)

    with Forked(fails) as work, pytest.raises(MemprofError, match="No space left") as caught:
        work.result()
    assert caught.value.exit_code == 1


def test_without_fork_the_call_is_made_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forked, "can_fork", lambda: False)
    with Forked(os.getpid) as work:
        assert work.result() == os.getpid()


def test_an_abandoned_write_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.pickle"

    def slow(tmp: Path) -> None:
        tmp.write_bytes(b"partial")
        time.sleep(30)

    with pytest.raises(KeyboardInterrupt), Forked(lambda: write_atomic(path, slow)):
        deadline = time.monotonic() + 10
        while not list(tmp_path.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.01)  # the copy has started writing
        raise KeyboardInterrupt  # a second Ctrl-C while the report is written
    assert list(tmp_path.iterdir()) == []


def test_the_copy_holds_no_pipe_of_this_process() -> None:
    # the timeline's child reads its job until every writing end of its stdin is closed
    read, end = os.pipe()
    with Forked(lambda: time.sleep(2)) as work:
        os.close(end)
        started = time.monotonic()
        assert os.read(read, 1) == b""  # at once: the copy closed its own writing end
        assert time.monotonic() - started < 1
        work.result()
    os.close(read)


def test_a_script_that_ignores_sigchld_still_gets_the_result() -> None:
    # SIG_IGN makes the kernel reap children at once: waitpid finds none
    saved = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        with Forked(lambda: "written") as work:
            assert work.result() == "written"
    finally:
        signal.signal(signal.SIGCHLD, saved)
