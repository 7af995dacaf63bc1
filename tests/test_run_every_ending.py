"""Every way a script may end under ``memprof run`` leaves a whole report and python's exit
code: each terminating signal, an alarm left armed, a killed run's lock, exceptions that
break printing, closed streams, ``__del__`` at exit, an unwritable run folder."""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from conftest import Jobs
from test_run_cli import ROOT

# signals a handler can catch whose default action ends the process (signal(7))
TERMINATING = [getattr(signal, name) for name in (
    "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM", "SIGPROF",
    "SIGXCPU", "SIGPWR", "SIGSTKFLT") if hasattr(signal, name)]

LOOP = """\
import sys, time, torch
m = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
print("ready", flush=True)
for i in range(3000):
    m(torch.randn(4, 8)).sum().backward()
    opt.step(); opt.zero_grad()
    time.sleep(0.01)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _memprof(cwd: Path, script: str, *args: str, **popen: object) -> subprocess.Popen[str]:
    (cwd / "s.py").write_text(script)
    return subprocess.Popen([sys.executable, "-m", "memprof", "run", "-o", "out",
                             "--no-timeline", "--device", "cpu", *args, "s.py"], cwd=cwd,
                            env=_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **popen)


def _python(cwd: Path, script: str) -> int:
    """The exit status python gives ``script``, as a shell reports it."""
    (cwd / "p.py").write_text(script)
    code = subprocess.run([sys.executable, "p.py"], cwd=cwd, env=_env(), capture_output=True,
                          check=False).returncode
    return code if code >= 0 else 128 - code


def _report(cwd: Path) -> dict:
    return json.loads((cwd / "out" / "report.json").read_text())["run"]


def _ended(cwd: Path, script: str, **popen: object) -> tuple[int, str]:
    """``script`` under ``memprof run`` to its end: the exit code and stderr."""
    proc = _memprof(cwd, script, **popen)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


# --- the runs of every test but the first: started together on first use ------------------

jobs = Jobs()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Any]]]:
    yield from jobs.started(tmp_path_factory, "endings")


def test_every_terminating_signal_leaves_a_whole_report(tmp_path: Path):
    """Each catchable signal whose default ends the process, sent at a random moment of the
    script's run (seeded): the report is whole, the exit code 128 + the signal."""
    rng = random.Random(20261126)
    runs = {}
    for s in TERMINATING:
        where = tmp_path / signal.Signals(s).name
        where.mkdir()
        runs[s] = (where, _memprof(where, LOOP, start_new_session=True))
    for proc in (p for _, p in runs.values()):
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    for s, (_, proc) in sorted(runs.items(), key=lambda _: rng.random()):
        time.sleep(rng.uniform(0.05, 0.4))
        proc.send_signal(s)
    for s, (where, proc) in runs.items():
        name = signal.Signals(s).name
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 128 + s, (name, err[-2000:])
        run = _report(where)
        assert run["stopped_by"] == name and run["exit"]["code"] == 128 + s, name
        assert (where / "out" / "snapshot.pickle").stat().st_size > 0
        assert not (where / "out" / ".report.json.lock").exists(), name
        assert "memprof/" not in err.split("Memory at the peak")[0], (name, err)


ALARM = "import signal, time\nsignal.alarm(1)\ntime.sleep(30)\n"


@jobs
def alarm(where: Path) -> tuple[int, int, Path]:
    code, _ = _ended(where, ALARM)
    return code, _python(where, ALARM), where


def test_an_alarm_the_script_leaves_armed(runs: dict[str, Future[Any]]):
    code, python, where = runs["alarm"].result()
    assert code == 142 == python
    assert _report(where)["stopped_by"] == "SIGALRM"


@jobs
def lock(where: Path) -> tuple[int, str, Path, subprocess.CompletedProcess[str]]:
    (where / "out").mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    (where / "out" / ".report.json.lock").write_text(str(gone.pid))
    code, err = _ended(where, "pass\n")

    (where / "busy").mkdir()  # a live process's lock still refuses
    (where / "busy" / ".report.json.lock").write_text(str(os.getpid()))
    (where / "s.py").write_text("pass\n")
    busy = subprocess.run([sys.executable, "-m", "memprof", "run", "-o", "busy", "s.py"],
                          cwd=where, env=_env(), capture_output=True, text=True,
                          check=False)
    return code, err, where, busy


def test_the_lock_of_a_killed_run_is_taken_over(runs: dict[str, Future[Any]]):
    code, err, where, busy = runs["lock"].result()
    assert code == 0, err
    assert _report(where)["exit"]["status"] == "completed"
    assert busy.returncode == 2 and "another memprof run is writing there" in busy.stderr


ENDINGS = {
    "str raises": ("class E(Exception):\n    def __str__(self): raise RuntimeError('no')\n"
                   "raise E()\n", 1),
    "excepthook raises": ("import sys\ndef hook(*a): raise RuntimeError('hook broke')\n"
                          "sys.excepthook = hook\nraise ValueError('x')\n", 1),
    "path cleared": ("import sys\nsys.path.clear()\n", 0),
    "stdout closed": ("import sys\nsys.stdout.close()\n", 0),
    "fd 2 closed": ("import os\nos.close(2)\n", 0),
    "stdout None": ("import sys\nsys.stdout = None\n", 0),
    # the report, written before python's exit runs the __del__, saw the script complete
    "__del__ exits": ("import os\nclass D:\n    def __del__(self): os._exit(3)\nd = D()\n", 3),
    "exit 256": ("import sys\nsys.exit(256)\n", 0),
}


def _odd_ending(case: str) -> None:
    def run(where: Path) -> tuple[int, int, str, Path]:
        script = ENDINGS[case][0]
        return (_python(where, script), *_ended(where, script), where)

    run.__name__ = f"ending {case}"
    jobs(run)


for _case in ENDINGS:
    _odd_ending(_case)


@pytest.mark.parametrize("case", list(ENDINGS))
def test_odd_endings_keep_pythons_code_and_the_report(runs: dict[str, Future[Any]], case: str):
    code = ENDINGS[case][1]
    python, memprof, err, where = runs[f"ending {case}"].result()
    assert python == code
    assert memprof == code, err
    assert _report(where)["exit"]["code"] == (0 if case == "__del__ exits" else code)
    assert "memprof/" not in err, err


@jobs
def broken_excepthook(where: Path) -> tuple[str, str]:
    script = ENDINGS["excepthook raises"][0]
    (where / "p.py").write_text(script)
    python = subprocess.run([sys.executable, "p.py"], cwd=where, capture_output=True,
                            text=True, check=False).stderr
    return python, _ended(where, script.replace("p.py", "s.py"))[1]


def test_python_and_memprof_print_a_broken_excepthook_alike(runs: dict[str, Future[Any]]):
    python, err = runs["broken_excepthook"].result()
    assert err.startswith(python.replace("p.py", "s.py")), err


def _small_files() -> None:  # a full disk, as the files see it
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))


@jobs
def unwritable(where: Path) -> tuple[int, str]:
    return _ended(where, LOOP.replace("range(3000)", "range(3)") + "sys.exit(3)\n",
                  preexec_fn=_small_files)


def test_a_run_folder_that_cannot_be_written_keeps_the_scripts_code(
        runs: dict[str, Future[Any]]):
    code, err = runs["unwritable"].result()
    assert code == 3, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("memprof: error:") and "File too large" in last, last
    assert "the run folder holds" in last


@jobs
def pool_workers(where: Path) -> tuple[int, str]:
    script = ("import multiprocessing as mp, time\n"
              "def work(x):\n    time.sleep(5)\n"
              "if __name__ == '__main__':\n"
              "    pool = mp.get_context('fork').Pool(2)\n"
              "    pool.map_async(work, range(2)); time.sleep(0.5)\n"
              "    pool.terminate(); pool.join()\n")
    return _ended(where, script)


def test_pool_workers_end_as_pythons_do(runs: dict[str, Future[Any]]):
    code, err = runs["pool_workers"].result()
    assert code == 0, err
    assert "Stop" not in err and "Traceback" not in err, err


@jobs
def thread_raises(where: Path) -> tuple[int, str]:
    script = ("import threading, torch\n"
              "def boom():\n    torch.ones(2)\n    raise ValueError('in a thread')\n"
              "t = threading.Thread(target=boom); t.start(); t.join()\n")
    return _ended(where, script)


def test_a_threads_traceback_has_no_memprof_frame(runs: dict[str, Future[Any]]):
    code, err = runs["thread_raises"].result()
    assert code == 0 and "ValueError: in a thread" in err, err
    assert "memprof/" not in err.split("memprof run s.py")[0], err
