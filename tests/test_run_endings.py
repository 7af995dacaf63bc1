"""How ``memprof run`` ends: signals, early stops, forks, chdir, excepthook, stale files."""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_run_cli import block, memprof_run, report

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


def test_sigterm_writes_the_report_and_exits_143(tmp_path: Path) -> None:
    result, out = _train(tmp_path, "if i == 2: os.kill(os.getpid(), signal.SIGTERM)",
                         "--device", "cpu")
    assert result.code == 143, result.stderr
    run = report(out)["run"]
    assert run["exit"] == {"status": "stopped", "code": 143, "error": None}
    assert run["stopped_by"] == "SIGTERM" and run["optimizer_steps"] == 3
    assert "finished" not in result.stdout
    assert ": stopped by SIGTERM, exit code 143" in result.stderr


def test_steps_stop_cleanly(tmp_path: Path) -> None:
    result, out = _train(tmp_path, "", "--steps", "4", "--device", "cpu")
    assert result.code == 0, result.stderr
    said = result.stderr.index("memprof: stopped after 4 steps as asked")  # where it stopped:
    assert said < result.stderr.index(  # right after the script's output, before the report
        ": stopped after 4 optimizer steps (--steps), exit code 0")
    run = report(out)["run"]
    assert run["stopped_by"] == "steps" and run["optimizer_steps"] == 4


def test_chdir_in_the_script_keeps_the_folder(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    result, out = _train(tmp_path, "os.chdir(os.path.dirname(__file__) + '/elsewhere')")
    assert result.code == 0, result.stderr
    assert report(out)["run"]["exit"]["status"] == "completed"
    assert not (tmp_path / "elsewhere" / "out").exists()


def test_forked_child_writes_nothing(tmp_path: Path) -> None:
    result, out = _train(tmp_path, "if i == 1 and os.fork() == 0: sys.exit(7)")
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


def test_dataloader_workers_do_not_record(tmp_path: Path) -> None:
    # a forked worker inherits the recorder's dispatch mode: it must drop it (a worker loop
    # ran 6x slower under it), and the parent's report is whole
    (tmp_path / "w.py").write_text(WORKERS)
    result = memprof_run(tmp_path, "-o", "out", "--device", "cpu", "w.py")
    assert result.code == 0, result.stderr
    assert result.stdout.splitlines() == ["recording in a worker: False"] * 2
    assert report(tmp_path / "out")["run"]["exit"]["status"] == "completed"


COMPILED = """\
import torch
model = torch.compile(torch.nn.Linear(64, 64))
model(torch.randn(32, 64)).sum().backward()
print(type(model).__name__)
"""


def test_compile_runs_eagerly_and_says_so(tmp_path: Path) -> None:
    # Dynamo falls back to eager under a dispatch mode without a word: the report must say
    (tmp_path / "c.py").write_text(COMPILED)
    result = memprof_run(tmp_path, "-o", "out", "--device", "cpu", "c.py")
    assert result.code == 0, result.stderr
    assert result.stdout.strip() == "Linear"
    assert result.stderr.count("torch.compile ran the model eagerly") == 1
    data = report(tmp_path / "out")
    assert data["devices"][0]["category_peaks"]["parameters"] == block(64 * 64 * 4) + block(64 * 4)


def test_script_excepthook_is_used(tmp_path: Path) -> None:
    hook = ("sys.excepthook = lambda t, e, tb: print('HOOK', t.__name__, file=sys.stderr)\n"
            "    if i == 1: raise ValueError('x')")
    result, out = _train(tmp_path, hook)
    assert result.code == 1
    assert "HOOK ValueError" in result.stderr and "Traceback" not in result.stderr
    assert report(out)["run"]["exit"]["error"] == "ValueError: x"


def test_force_removes_stale_outputs(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "profile.json").write_text("stale")
    result, out = _train(tmp_path, "", "--force")
    assert result.code == 0, result.stderr
    assert not (out / "profile.json").exists() and (out / "report.json").exists()


def test_no_timeline_skips_it_and_a_stale_one_goes(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "timeline.png").write_text("stale")
    result, out = _train(tmp_path, "", "--force", "--no-timeline", "--device", "cpu")
    assert result.code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "snapshot.pickle"]
    assert "Run folder:" in result.stderr and "(report.json, snapshot.pickle)" in result.stderr


def test_manual_sgd_says_why_there_are_no_steps(tmp_path: Path) -> None:
    (tmp_path / "sgd.py").write_text(
        "import torch\nm = torch.nn.Linear(8, 8).cuda()\nfor i in range(3):\n"
        "    m(torch.randn(4, 8, device='cuda')).sum().backward()\n    with torch.no_grad():\n"
        "        for p in m.parameters():\n            p -= 0.1 * p.grad; p.grad = None\n")
    result = memprof_run(tmp_path, "-o", "sgd", "sgd.py")
    assert result.code == 0, result.stderr
    assert "No step section: no optimizer.step() was recorded" in result.stderr
    assert "the leak verdict are unavailable" in result.stderr
    data = report(tmp_path / "sgd")
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


def test_ctrl_c_after_the_script_still_writes_the_report(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text(AFTER_THE_SCRIPT.format(times=1))
    result = memprof_run(tmp_path, "--device", "cpu", "-o", "out", "t.py")
    assert result.code == 0, result.stderr
    assert "writing the report; press Ctrl-C again to abandon it" in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "report.json", "snapshot.pickle", "timeline.png"]
    assert report(tmp_path / "out")["run"]["exit"]["status"] == "completed"


def test_a_second_ctrl_c_abandons_the_report_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text(AFTER_THE_SCRIPT.format(times=2))
    result = memprof_run(tmp_path, "--device", "cpu", "-o", "out", "t.py")
    assert result.code == 130, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "memprof: error: interrupted while writing the report")
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]


def test_profile_is_a_chrome_trace_of_steps_two_and_three(tmp_path: Path) -> None:
    result, out = _train(tmp_path, "", "--device", "cpu", "--profile")
    assert result.code == 0, result.stderr
    events = json.loads((out / "profile.json").read_text())["traceEvents"]
    steps = [e for e in events if e.get("name") == "Optimizer.step#SGD.step"]
    assert len(steps) == 2
    assert "(profile.json, report.json, snapshot.pickle, timeline.png)" in result.stderr
