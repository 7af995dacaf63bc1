"""How ``memprof run`` ends: signals, early stops, forks, chdir, excepthook, stale files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from conftest import Jobs

from tests.test_run_cli import Result, block, memprof_run, report

TRAIN = """\
import os, signal, sys, torch
m = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(50):
    m(torch.randn(4, 8)).sum().backward()
    opt.step(); opt.zero_grad()
    {at_step}
print("finished")
"""


def _train(tmp_path: Path, at_step: str, *args: str):
    (tmp_path / "t.py").write_text(TRAIN.format(at_step=at_step))
    result = memprof_run(tmp_path, "-o", "out", *args, "t.py")
    return result, tmp_path / "out"


# --- the runs: every test's, started together on first use, each in a folder of its own ---

jobs = Jobs()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Any]]]:
    yield from jobs.started(tmp_path_factory, "endings")


@jobs
def sigterm(where: Path) -> tuple[Result, Path]:
    return _train(where, "if i == 2: os.kill(os.getpid(), signal.SIGTERM)", "--device", "cpu")


def test_sigterm_writes_the_report_and_exits_143(runs: dict[str, Future[Any]]) -> None:
    result, out = runs["sigterm"].result()
    assert result.code == 143, result.stderr
    run = report(out)["run"]
    assert run["exit"] == {"status": "stopped", "code": 143, "error": None}
    assert run["stopped_by"] == "SIGTERM" and run["optimizer_steps"] == 3
    assert "finished" not in result.stdout
    assert ": stopped by SIGTERM, exit code 143" in result.stderr


@jobs
def steps(where: Path) -> tuple[Result, Path]:
    return _train(where, "", "--steps", "4", "--device", "cpu")


def test_steps_stop_cleanly(runs: dict[str, Future[Any]]) -> None:
    result, out = runs["steps"].result()
    assert result.code == 0, result.stderr
    said = result.stderr.index("memprof: stopped after 4 steps as asked")  # where it stopped:
    assert said < result.stderr.index(  # right after the script's output, before the report
        ": stopped after 4 optimizer steps (--steps), exit code 0")
    run = report(out)["run"]
    assert run["stopped_by"] == "steps" and run["optimizer_steps"] == 4


@jobs
def chdir(where: Path) -> tuple[Result, Path]:
    (where / "elsewhere").mkdir()
    return _train(where, "os.chdir(os.path.dirname(__file__) + '/elsewhere')")


def test_chdir_in_the_script_keeps_the_folder(runs: dict[str, Future[Any]]) -> None:
    result, out = runs["chdir"].result()
    assert result.code == 0, result.stderr
    assert report(out)["run"]["exit"]["status"] == "completed"
    assert not (out.parent / "elsewhere" / "out").exists()


@jobs
def forked(where: Path) -> tuple[Result, Path]:
    return _train(where, "if i == 1 and os.fork() == 0: sys.exit(7)")


def test_forked_child_writes_nothing(runs: dict[str, Future[Any]]) -> None:
    result, out = runs["forked"].result()
    assert result.code == 0, result.stderr
    assert result.stderr.count("Run folder:") == 1
    assert report(out)["run"]["exit"]["code"] == 0


WORKERS = """\
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.data import DataLoader, Dataset


class Modes(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):  # runs in a worker process
        return torch.tensor(int(_get_current_dispatch_mode() is not None))


for batch in DataLoader(Modes(), batch_size=2, num_workers=2):
    print("recording in a worker:", bool(batch.sum()))
"""


@jobs
def workers(where: Path) -> tuple[Result, Path]:
    (where / "w.py").write_text(WORKERS)
    return memprof_run(where, "-o", "out", "--device", "cpu", "w.py"), where / "out"


def test_dataloader_workers_do_not_record(runs: dict[str, Future[Any]]) -> None:
    # a forked worker inherits the recorder's dispatch mode: it must drop it (a worker loop
    # ran 6x slower under it), and the parent's report is whole
    result, out = runs["workers"].result()
    assert result.code == 0, result.stderr
    assert result.stdout.splitlines() == ["recording in a worker: False"] * 2
    assert report(out)["run"]["exit"]["status"] == "completed"


COMPILED = """\
import torch
model = torch.compile(torch.nn.Linear(64, 64))
model(torch.randn(32, 64)).sum().backward()
print(type(model).__name__)
"""


@jobs
def compiled(where: Path) -> tuple[Result, Path]:
    (where / "c.py").write_text(COMPILED)
    return memprof_run(where, "-o", "out", "--device", "cpu", "c.py"), where / "out"


def test_compile_runs_eagerly_and_says_so(runs: dict[str, Future[Any]]) -> None:
    # Dynamo falls back to eager under a dispatch mode without a word: the report must say
    result, out = runs["compiled"].result()
    assert result.code == 0, result.stderr
    assert result.stdout.strip() == "Linear"
    assert result.stderr.count("torch.compile ran Linear eagerly") == 1  # named, once
    data = report(out)
    assert data["devices"][0]["category_peaks"]["parameters"] == block(64 * 64 * 4) + block(64 * 4)


@jobs
def excepthook(where: Path) -> tuple[Result, Path]:
    hook = ("sys.excepthook = lambda t, e, tb: print('HOOK', t.__name__, file=sys.stderr)\n"
            "    if i == 1: raise ValueError('x')")
    return _train(where, hook)


def test_script_excepthook_is_used(runs: dict[str, Future[Any]]) -> None:
    result, out = runs["excepthook"].result()
    assert result.code == 1
    assert "HOOK ValueError" in result.stderr and "Traceback" not in result.stderr
    assert report(out)["run"]["exit"]["error"] == "ValueError: x"


def test_an_error_raised_while_handling_another_names_the_first() -> None:
    """A library's teardown failing after the script's real error (Lightning's DDP teardown
    after its assertion): the report names the first error too, as Python's traceback does,
    but not one the script replaced on purpose (``raise ... from None``)."""
    from memprof.collect.launch.script import _described

    def failing(suppress: bool) -> BaseException:
        try:
            try:
                raise AssertionError("not a DDP model")
            except AssertionError:
                if suppress:
                    raise AttributeError("no static_graph") from None
                raise AttributeError("no static_graph")  # noqa: B904
        except AttributeError as exc:
            return exc
        raise RuntimeError("unreachable")

    assert _described(failing(False)) == ("AttributeError: no static_graph (raised while"
                                          " handling AssertionError: not a DDP model)")
    assert _described(failing(True)) == "AttributeError: no static_graph"


@jobs
def force(where: Path) -> tuple[Result, Path]:
    (where / "out").mkdir()
    (where / "out" / "profile.json").write_text("stale")
    return _train(where, "", "--force")


def test_force_removes_stale_outputs(runs: dict[str, Future[Any]]) -> None:
    result, out = runs["force"].result()
    assert result.code == 0, result.stderr
    assert not (out / "profile.json").exists() and (out / "report.json").exists()


@jobs
def no_timeline(where: Path) -> tuple[Result, Path]:
    (where / "out").mkdir()
    (where / "out" / "timeline.png").write_text("stale")
    return _train(where, "", "--force", "--no-timeline", "--device", "cpu")


def test_no_timeline_skips_it_and_a_stale_one_goes(runs: dict[str, Future[Any]]) -> None:
    result, out = runs["no_timeline"].result()
    assert result.code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "report.json",
                                                      "snapshot.pickle"]
    assert "Run folder:" in result.stderr and \
        "(report.html, report.json, snapshot.pickle)" in result.stderr


@jobs
def manual_sgd(where: Path) -> tuple[Result, Path]:
    (where / "sgd.py").write_text(
        "import torch\nm = torch.nn.Linear(8, 8).cuda()\nfor i in range(3):\n"
        "    m(torch.randn(4, 8, device='cuda')).sum().backward()\n    with torch.no_grad():\n"
        "        for p in m.parameters():\n            p -= 0.1 * p.grad; p.grad = None\n")
    return memprof_run(where, "-o", "sgd", "sgd.py"), where


def test_manual_sgd_says_why_there_are_no_steps(runs: dict[str, Future[Any]]) -> None:
    result, where = runs["manual_sgd"].result()
    assert result.code == 0, result.stderr
    assert "No step section: no optimizer.step() was recorded" in result.stderr
    assert "the leak verdict are unavailable" in result.stderr
    data = report(where / "sgd")
    run, device = data["run"], data["devices"][0]
    assert run["optimizer_steps"] == 0 and "optimizer.step()" in run["no_steps_reason"]
    assert device["steps"] == [] and device["leak"] is None
    assert device["step_growth"]["verdict"] == "no_steps"


# A thread sends the signals as soon as the script has ended (memprof restores sys.argv):
# they land in memprof's own work after the script, where a Ctrl-C once lost the report.
AFTER_THE_SCRIPT = """\
import os, signal, sys, threading, time, torch
x = torch.ones(1024)


def interrupt(script=sys.argv[0]):
    while sys.argv[0] == script:
        time.sleep(0.001)
    for _ in range({times}):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)


threading.Thread(target=interrupt, daemon=True).start()
"""


def _interrupted(where: Path, times: int) -> tuple[Result, Path]:
    (where / "t.py").write_text(AFTER_THE_SCRIPT.format(times=times))
    return memprof_run(where, "--device", "cpu", "-o", "out", "t.py"), where


@jobs
def ctrl_c_once(where: Path) -> tuple[Result, Path]:
    return _interrupted(where, 1)


@jobs
def ctrl_c_twice(where: Path) -> tuple[Result, Path]:
    return _interrupted(where, 2)


def test_ctrl_c_after_the_script_still_writes_the_report(runs: dict[str, Future[Any]]) -> None:
    result, where = runs["ctrl_c_once"].result()
    assert result.code == 0, result.stderr
    assert "writing the report; press Ctrl-C again to abandon it" in result.stderr
    assert sorted(p.name for p in (where / "out").iterdir()) == [
        "report.html", "report.json", "snapshot.pickle", "timeline.png"]
    assert report(where / "out")["run"]["exit"]["status"] == "completed"


def test_a_second_ctrl_c_abandons_the_report_in_one_line(runs: dict[str, Future[Any]]) -> None:
    result, where = runs["ctrl_c_twice"].result()
    assert result.code == 130, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "memprof: error: interrupted while writing the report")
    assert not [p for p in (where / "out").iterdir() if p.name.startswith(".")]


@jobs
def profile(where: Path) -> tuple[Result, Path]:
    return _train(where, "", "--device", "cpu", "--profile")


def test_profile_is_a_chrome_trace_of_steps_two_and_three(runs: dict[str, Future[Any]]) -> None:
    result, out = runs["profile"].result()
    assert result.code == 0, result.stderr
    events = json.loads((out / "profile.json").read_text())["traceEvents"]
    steps = [e for e in events if e.get("name") == "Optimizer.step#SGD.step"]
    assert len(steps) == 2
    assert "(profile.json, report.html, report.json, snapshot.pickle, timeline.png)" \
        in result.stderr
