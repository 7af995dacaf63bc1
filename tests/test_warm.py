"""A command started warm (``memprof/warm.py``) ends as the same command started fresh: the
same output, exit code, folder, arguments and environment, its threads and ``atexit``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memprof import warm

pytestmark = pytest.mark.skipif(not warm.available(), reason="warm starts are Linux only")

PROBE = '''\
import atexit, os, random, sys, threading, time
print("argv", sys.argv[1:])
print("cwd", os.getcwd() == sys.argv[1], sys.path[0] == os.getcwd())
print("env", os.environ.get("MEMPROF_PROBE"))
print("random", random.random(), file=sys.stderr)
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread ended"))).start()
if sys.argv[2] == "exit":
    sys.exit(7)
if sys.argv[2] == "raise":
    raise ValueError("from the probe")
if sys.argv[2] == "kill":
    os.kill(os.getpid(), 9)
'''


def _both(where: Path, *args: str) -> tuple[subprocess.CompletedProcess,
                                            subprocess.CompletedProcess]:
    """The command started fresh, and started warm (a variable read late set for it)."""
    env = {**os.environ, "PYTHONPATH": str(where), "MEMPROF_PROBE": "late"}
    argv = ["-m", "probe", str(where), *args]
    fresh = subprocess.run([sys.executable, *argv], cwd=where, env=env, capture_output=True,
                           text=True, stdin=subprocess.DEVNULL, timeout=60)
    return fresh, warm.run(argv, where, env, timeout=60)


SLEEPER = """\
import subprocess, sys, time
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of modules to run, the same for every test: one warm server serves them."""
    where = tmp_path_factory.mktemp("warm")
    (where / "probe.py").write_text(PROBE)
    (where / "sleeper.py").write_text(SLEEPER)
    return where


@pytest.mark.parametrize("ending", ["end", "exit", "raise", "kill"])
def test_a_warm_command_ends_as_a_fresh_one(probe: Path, ending: str):
    fresh, started = _both(probe, ending)
    assert started.returncode == fresh.returncode == {"end": 0, "exit": 7, "raise": 1,
                                                      "kill": -signal.SIGKILL}[ending]
    assert started.stdout == fresh.stdout
    assert f"argv ['{probe}', '{ending}']" in started.stdout
    assert "cwd True True" in started.stdout and "env late" in started.stdout
    assert ("atexit ran" in started.stdout) == (ending != "kill")
    assert ("thread ended" in started.stdout) == (ending != "kill")
    tail = [line for line in started.stderr.splitlines() if not line.startswith("random")]
    assert tail == [line for line in fresh.stderr.splitlines() if not line.startswith("random")]
    if ending == "raise":
        assert tail[-1] == "ValueError: from the probe"


def test_each_warm_command_draws_its_own_random_numbers(probe: Path):
    draws = {warm.run(["-m", "probe", str(probe), "end"], probe,
                      {**os.environ, "PYTHONPATH": str(probe)}).stderr for _ in range(3)}
    assert len(draws) == 3


def test_variables_read_at_import_get_a_server_of_their_own(probe: Path):
    base = {**os.environ, "PYTHONPATH": str(probe)}
    assert warm.server_for({**base, "MEMPROF_APPLY": "{}"}) is warm.server_for(base)
    assert warm.server_for({**base, "OMP_NUM_THREADS": "3"}) is not warm.server_for(base)
    with pytest.raises(ValueError, match="early environment"):
        warm.server_for(base).start(["-m", "probe"], probe, {**base, "OMP_NUM_THREADS": "3"},
                                    (0, 1, 2))


def test_a_command_past_its_time_is_killed_with_its_session(probe: Path):
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        warm.run(["-m", "sleeper"], probe, {**os.environ, "PYTHONPATH": str(probe)}, timeout=3)
    grandchild = int(str(raised.value.output).split()[0])
    for _ in range(100):  # the session's other process is killed too
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{grandchild}/stat") as f:
            if f.read().split(") ")[1].startswith("Z"):
                return
        time.sleep(0.05)
    pytest.fail("the command's own child outlived the timeout")


def test_without_a_server_a_command_starts_fresh(tmp_path: Path):
    """A ``memprof`` package that cannot be imported where the server would start (a
    shadowing folder): the server ends at once, and the command runs as ``python -m``."""
    (tmp_path / "memprof").mkdir()
    (tmp_path / "memprof" / "__init__.py").write_text("raise ImportError('not here')\n")
    (tmp_path / "hello.py").write_text("import sys; print('hello', sys.argv[1:])\n")
    done = warm.run(["-m", "hello", "a b"], tmp_path,
                    {**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=60)
    assert (done.returncode, done.stdout) == (0, "hello ['a b']\n")
