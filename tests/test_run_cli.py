"""`memprof run` as a user runs it: the real command line in a fresh process, on the samples.

The CPU runs start together on first use (a module fixture) so that they share the cores;
each test then reads its own run. Expected byte counts are computed here from the model
architectures, as the caching allocator would place them: each tensor in its own block
of a multiple of 512 bytes (at least 512).
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from conftest import Jobs

import memprof
from memprof import warm
from memprof.analysis.steps import MIN_STEPS

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_scripts"
PACKAGE = Path(memprof.__file__).resolve().parent
F32 = torch.float32.itemsize
TIMEOUT_S = 240  # per process: a hang fails the test instead of blocking the suite

# small sizes on purpose: per-tensor rounding to 512-byte blocks changes the totals
MLP = {"hidden": 40, "layers": 3, "batch": 12, "steps": 5}
LEAK = {"hidden": 72, "layers": 2, "batch": 24, "steps": 8}
SCRIPT_ARGS = ["a b", "--force", "-o", "x", "--", "-m"]  # memprof must not take these


@dataclass(frozen=True)
class Result:
    """How a process ended and what it printed."""

    code: int
    stdout: str
    stderr: str


def run_python(args: Sequence[str | Path], cwd: Path, env: dict[str, str] | None = None,
               ) -> Result:
    """Run ``python ARGS`` in ``cwd`` as a user would; kill its whole process group on timeout.

    One thread per process (OMP_NUM_THREADS=1): the runs share the cores. The checkout under
    test comes first on PYTHONPATH; allocator settings from the caller's environment are
    dropped, as they would change the predicted block sizes. ``-m MODULE`` starts warm
    (``memprof/warm.py``: torch imported once, as ``suggest --verify`` re-runs do).
    """
    full = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1"}
    full["PYTHONPATH"] = os.pathsep.join(
        p for p in ((env or {}).get("PYTHONPATH"), str(ROOT), os.environ.get("PYTHONPATH"))
        if p)
    full.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    try:
        done = warm.run([str(a) for a in args], cwd, full, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"python {' '.join(map(str, args))} still running after {TIMEOUT_S} s;"
                    f" stderr tail:\n{str(exc.stderr)[-3000:]}")
    return Result(done.returncode, done.stdout, done.stderr)


def memprof_run(cwd: Path, *args: str | Path) -> Result:
    """``memprof run ARGS`` (through ``python -m memprof``)."""
    return run_python(["-m", "memprof", "run", *args], cwd)


def memprof_here(cwd: Path, *args: str | Path) -> Result:
    """``python -m memprof ARGS`` in ``cwd`` as ``run_python`` runs it, by the entry point
    (``main``) in this process: the exit code, stdout and stderr, without starting an
    interpreter and torch. For ``check`` and ``suggest``, which run nothing of the user's
    in their own process: a test that reads what one says, and its exit code, needs no
    process of its own (``suggest --verify`` starts its re-runs as it would, with the same
    environment). All of ``main`` runs but the fork that puts a time limit on reading a
    snapshot, a process's own (``OWN_PROCESS``: pytest's would fork). From pytest's main
    thread only: it sets the process's folder and streams."""
    from click.testing import CliRunner

    import memprof.cli.app as cli

    words = [str(a) for a in args]
    assert words[0] in ("check", "suggest"), words
    assert threading.current_thread() is threading.main_thread()
    env = {"OMP_NUM_THREADS": "1", "PYTORCH_CUDA_ALLOC_CONF": None, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    saved = os.getcwd(), sys.argv, cli.OWN_PROCESS
    with CliRunner().isolation(env=env) as (out, err, _):
        os.chdir(cwd)
        sys.argv, cli.OWN_PROCESS = ["memprof", *words], {}
        try:
            cli.main()
            code = 0
        except SystemExit as exc:  # as python exits with it
            code = exc.code
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
        except Exception:  # as python prints an uncaught one
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.chdir(saved[0])
            sys.argv, cli.OWN_PROCESS = saved[1:]
    return Result(code or 0, out.getvalue().decode(), err.getvalue().decode())


def block(nbytes: int) -> int:
    """The CUDA caching allocator's block size for a request of ``nbytes``."""
    return max(512, -(-nbytes // 512) * 512)


def flags(values: dict[str, int]) -> list[str]:
    """``{"hidden": 40}`` as ``["--hidden=40"]``."""
    return [f"--{k.replace('_', '-')}={v}" for k, v in values.items()]


def load_sample(name: str) -> ModuleType:
    """Import ``sample_scripts/NAME.py`` without running its ``main``."""
    spec = importlib.util.spec_from_file_location(f"sample_{name}", SAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(folder: Path, name: str = "report.json") -> dict[str, Any]:
    """A report a run wrote."""
    return json.loads((folder / name).read_text())


SHOW = """\
import json, sys
print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0],
                  "file": __file__}))
"""

BOOM = """\
import torch


def inner(x):
    return x.sum() / undefined_name


def outer():
    return inner(torch.ones(3))


outer()
"""

# an operator's own error: under a dispatch mode its Python call stack is memprof's and torch's
BAD_MATMUL = """\
import torch


def inner(device):
    return torch.ones(2, device=device) @ torch.ones(3, device=device)


inner("DEVICE")
"""

# --- the runs: each job gets an empty folder and returns what its tests read -------------

JOBS = Jobs()
job = JOBS  # ``@job``: a run the ``runs`` fixture starts


def _sample(where: Path, script: str, *args: str, options: Sequence[str] = ()
            ) -> tuple[Result, Path]:
    """A sample under ``memprof run`` (with memprof's ``options``), both on the CPU whether
    or not there is a GPU."""
    out = where / "out"
    return memprof_run(where, "-o", out, "--device", "cpu", *options, SAMPLES / script, *args,
                       "--device", "cpu"), out


@job
def ddp(where: Path) -> tuple[Result, Path]:
    out = where / "out"
    # --standalone: a local rendezvous on a free port, so concurrent runs do not collide
    return run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "-m", "memprof", "run", "-o", out, "--device", "cpu",
                       SAMPLES / "ddp_gloo.py", "--device", "cpu"], where), out


@job
def mlp(where: Path) -> tuple[Result, Path]:
    return _sample(where, "mlp_adam.py", *flags(MLP))


@job
def mlp_light(where: Path) -> tuple[Result, Path]:
    return _sample(where, "mlp_adam.py", *flags(MLP), options=["--light"])


@job
def leak(where: Path) -> tuple[Result, Path]:
    return _sample(where, "leak.py", *flags(LEAK))


@job
def mlp_explained(where: Path) -> Result:
    """``memprof explain`` on the ``mlp`` run's snapshot."""
    out = JOBS.result("mlp")[1]
    return run_python(["-m", "memprof", "explain", "--json", "-o", "-",
                       out / "snapshot.pickle"], out)


@job
def leak_fixed(where: Path) -> tuple[Result, Path]:
    return _sample(where, "leak.py", *flags(LEAK), "--fixed")


@job
def transformer(where: Path) -> tuple[Result, Path]:
    return _sample(where, "transformer_lm.py", "--steps", "5")


@job
def cnn(where: Path) -> tuple[Result, Path]:
    return _sample(where, "cnn.py", "--steps", "5")


@job
def exits(where: Path) -> tuple[Result, Path]:
    (where / "exits.py").write_text("import sys\nimport torch\n\nx = torch.ones(8)\n"
                                    "print('before exit')\nsys.exit(3)\n")
    return memprof_run(where, "-o", where / "out", "exits.py"), where / "out"


@job
def interrupted(where: Path) -> tuple[Result, Path]:
    (where / "ctrl_c.py").write_text(
        "import os, signal, time\nimport torch\n\nx = torch.ones(8)\n"
        "os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C in the terminal sends\n"
        "time.sleep(30)\n")
    return memprof_run(where, "-o", where / "out", "ctrl_c.py"), where / "out"


@job
def raises(where: Path) -> tuple[Result, Path, Result]:
    (where / "boom.py").write_text(BOOM)
    return (memprof_run(where, "-o", where / "out", "boom.py"), where / "out",
            run_python(["boom.py"], where))


def _bad_matmul(where: Path, device: str) -> str:
    # not cpu.py and cuda.py: the script's folder comes first on sys.path, and a library
    # that tries `import cuda` would run it
    (where / f"on_{device}.py").write_text(BAD_MATMUL.replace("DEVICE", device))
    return f"on_{device}.py"


@job
def operator_cpu(where: Path) -> Result:
    return memprof_run(where, "--device", "cpu", "-o", where / "a", _bad_matmul(where, "cpu"))


@job
def operator_virtual(where: Path) -> Result:
    return memprof_run(where, "--virtual-gpu", "T4", "-o", where / "b",
                       _bad_matmul(where, "cpu"))


@job
def operator_cuda(where: Path) -> Result:
    return memprof_run(where, "--virtual-gpu", "T4", "-o", where / "c",
                       _bad_matmul(where, "cuda"))


@job
def operator_python(where: Path) -> Result:
    return run_python([_bad_matmul(where, "cpu")], where)


def _package(where: Path) -> tuple[Path, dict[str, str]]:
    """``pkgdemo.show`` in ``where/lib`` (on PYTHONPATH); the runs start in ``where/work``."""
    package = where / "lib" / "pkgdemo"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "show.py").write_text(SHOW)
    (where / "work").mkdir()
    return where / "work", {"PYTHONPATH": str(where / "lib")}


@job
def as_script(where: Path) -> tuple[Result, Result]:
    work, _ = _package(where)
    script = os.path.join("..", "lib", "pkgdemo", "show.py")  # relative, as typed
    return (memprof_run(work, "-o", where / "out", script, *SCRIPT_ARGS),
            run_python([script, *SCRIPT_ARGS], work))


@job
def as_module(where: Path) -> tuple[Result, Result]:
    work, env = _package(where)
    return (run_python(["-m", "memprof", "run", "-o", where / "out", "-m", "pkgdemo.show",
                        *SCRIPT_ARGS], work, env),
            run_python(["-m", "pkgdemo.show", *SCRIPT_ARGS], work, env))


@job
def as_command(where: Path) -> tuple[Result, Result, Path]:
    """``-c CODE``, as ``python -c`` runs it (no ``__file__``)."""
    code = SHOW.replace("__file__", 'globals().get("__file__")')
    return (memprof_run(where, "-o", where / "out", "--device", "cpu", "-c", code, *SCRIPT_ARGS),
            run_python(["-c", code, *SCRIPT_ARGS], where), where / "out")


@job
def missing(where: Path) -> tuple[Result, Path]:
    return memprof_run(where, "-o", where / "out", "no_such_script.py"), where


@job
def overwrite(where: Path) -> tuple[Result, Result, dict[str, str], Path]:
    out = where / "out"
    out.mkdir()
    (out / "report.json").write_text("an earlier run's report\n")
    (where / "hello.py").write_text("print('the script ran')\n")
    refused = memprof_run(where, "-o", out, "hello.py")
    before = {p.name: p.read_text() for p in out.iterdir()}
    return refused, memprof_run(where, "-o", out, "--force", "hello.py"), before, out


LIGHT_ELSEWHERE = [[], ["--device", "auto"], ["--device", "cpu", "--profile"],
                   ["--device", "cpu", "--virtual-gpu", "T4"]]


def _light_elsewhere(number: int) -> None:
    def refused(where: Path) -> tuple[Result, Path]:
        (where / "train.py").write_text("raise SystemExit('the script must not run')\n")
        return memprof_run(where, "--light", *LIGHT_ELSEWHERE[number], "-o", where / "out",
                           "train.py"), where

    refused.__name__ = f"light_elsewhere{number}"
    job(refused)


for _number in range(len(LIGHT_ELSEWHERE)):
    _light_elsewhere(_number)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Any]]]:
    """Every job above, started at once on a small pool (the longest first)."""
    yield from JOBS.started(tmp_path_factory, "runs")


def sample_report(runs: dict[str, Future[Any]], name: str) -> dict[str, Any]:
    """The report of a sample run that must have succeeded."""
    result, out = runs[name].result()
    assert result.code == 0, result.stderr[-3000:]
    data = report(out)
    assert data["run"]["exit"] == {"status": "completed", "code": 0, "error": None}
    assert data["run"]["predicted"] is True
    return data


# --- the samples: exact numbers ---------------------------------------------------------


def mlp_model_state() -> dict[str, int]:
    """The MLP sample's parameter, gradient and Adam state bytes, as CUDA blocks."""
    mlp_adam = load_sample("mlp_adam")
    model = mlp_adam.build_model(MLP["hidden"], MLP["layers"])
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params)
    model(torch.randn(2, mlp_adam.IN_FEATURES)).sum().backward()
    optimizer.step()  # creates Adam's state: exp_avg, exp_avg_sq and a step tensor each
    state = [t for s in optimizer.state.values() for t in s.values()]
    assert len(state) == 3 * len(params)
    param_bytes = sum(block(p.numel() * F32) for p in params)
    step_bytes = sum(block(t.nbytes) for s in optimizer.state.values() for t in [s["step"]])
    assert param_bytes != F32 * sum(p.numel() for p in params)  # the rounding matters here
    expected = {"parameters": param_bytes, "gradients": param_bytes,
                "optimizer_state": 2 * param_bytes + step_bytes}
    assert sum(block(t.nbytes) for t in state) == expected["optimizer_state"]
    return expected


def mlp_saved_activations() -> int:
    """What autograd saves in the MLP sample's forward. The first Linear saves its input;
    each ReLU saves its output, which the next Linear saves too (one storage); mse_loss
    saves the prediction and the target. The weights Linear saves are parameters."""
    width, batch, layers = MLP["hidden"], MLP["batch"], MLP["layers"]
    mlp_adam = load_sample("mlp_adam")
    return (block(batch * mlp_adam.IN_FEATURES * F32) + layers * block(batch * width * F32)
            + 2 * block(batch * mlp_adam.OUT_FEATURES * F32))


@pytest.mark.parametrize("run", ["mlp", "mlp_light"])
def test_mlp_model_state_is_exact(runs: dict[str, Future[Any]], run: str) -> None:
    expected = mlp_model_state()
    device = sample_report(runs, run)["devices"][0]
    assert device["categories_inferred"] is False
    assert {k: device["categories"][k] for k in expected} == expected  # at the peak
    assert {k: device["category_peaks"][k] for k in expected} == expected


@pytest.mark.parametrize("run", ["mlp", "mlp_light"])
def test_mlp_activation_peak_is_what_autograd_saves(runs: dict[str, Future[Any]],
                                                    run: str) -> None:
    device = sample_report(runs, run)["devices"][0]
    assert device["category_peaks"]["activations"] == mlp_saved_activations()
    assert len(device["steps"]) == MLP["steps"]


def test_light_run_says_so_and_prints_nothing_of_the_profiler(
        runs: dict[str, Future[Any]]) -> None:
    result, out = runs["mlp_light"].result()
    plain = runs["mlp"].result()[0]
    assert result.code == 0 and result.stdout == plain.stdout
    assert "cpu, light" in result.stderr
    for noise in ("USDT", "profiler_start", "collection.cpp", "reassociate"):
        assert noise not in result.stderr
    with open(out / "snapshot.pickle", "rb") as f:
        assert pickle.load(f)["memprof"]["recorder"] == "cpu-light"


def test_mlp_is_not_flagged_as_a_leak(runs: dict[str, Future[Any]]) -> None:
    device = sample_report(runs, "mlp")["devices"][0]
    assert len(device["steps"]) >= MIN_STEPS  # enough steps for a verdict
    assert device["leak"] is None and device["step_growth"]["verdict"] == "none"


def _leak_line() -> int:
    lines = (SAMPLES / "leak.py").read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if "model(held_out)" in line)


def test_leak_sample_is_flagged_at_its_line(runs: dict[str, Future[Any]]) -> None:
    device = sample_report(runs, "leak")["devices"][0]
    leak = device["leak"]
    assert leak is not None and device["step_growth"]["verdict"] == "leak"
    assert Path(leak["site"]["file"]).name == "leak.py"
    assert leak["site"]["line"] == _leak_line()
    # each step keeps one held-out forward's saved activations: the ReLU outputs and the
    # prediction (the held-out batch and its targets are the same tensors every step)
    batch, width = LEAK["batch"], LEAK["hidden"]
    per_step = (LEAK["layers"] * block(batch * width * F32)
                + block(batch * load_sample("leak").OUT_FEATURES * F32))
    assert leak["growth_per_step_bytes"] == per_step


def test_fixed_leak_sample_is_not_flagged(runs: dict[str, Future[Any]]) -> None:
    device = sample_report(runs, "leak_fixed")["devices"][0]
    assert len(device["steps"]) == LEAK["steps"]
    assert device["leak"] is None and device["step_growth"]["verdict"] == "none"


@pytest.mark.parametrize("name", ["transformer", "cnn"])
def test_other_samples_are_not_flagged(runs: dict[str, Future[Any]], name: str) -> None:
    device = sample_report(runs, name)["devices"][0]
    assert len(device["steps"]) == 5
    assert device["leak"] is None and device["step_growth"]["verdict"] == "none"
    peaks = device["category_peaks"]
    assert min(peaks[k] for k in ("parameters", "gradients", "optimizer_state",
                                  "activations")) > 0


def test_snapshot_opens_in_explain_and_without_classes(runs: dict[str, Future[Any]]) -> None:
    _, out = runs["mlp"].result()
    data = report(out)
    explained = runs["mlp_explained"].result()
    assert explained.code == 0, explained.stderr
    device = json.loads(explained.stdout)["devices"][0]
    for key in ("peak", "categories", "category_peaks", "leak", "step_growth"):
        assert device[key] == data["devices"][0][key]

    class NoClasses(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            raise pickle.UnpicklingError(f"class reference {module}.{name}")

    snapshot = NoClasses(io.BytesIO((out / "snapshot.pickle").read_bytes())).load()
    assert len(snapshot["device_traces"]) == 1
    assert len(snapshot["memprof"]["steps"]) == MLP["steps"]


# --- distributed ------------------------------------------------------------------------


def test_torchrun_gives_one_report_per_rank(runs: dict[str, Future[Any]]) -> None:
    result, out = runs["ddp"].result()
    assert result.code == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}/2: mean final loss" in result.stdout
        data = report(out / f"rank-{rank}")
        assert (data["run"]["rank"], data["run"]["world_size"]) == (rank, 2)
        assert data["run"]["exit"]["status"] == "completed"
        assert (out / f"rank-{rank}" / "snapshot.pickle").is_file()
    assert not (out / "report.json").exists()


# --- how the script ends ----------------------------------------------------------------


def test_sys_exit_code_is_passed_on_and_the_report_written(
        runs: dict[str, Future[Any]]) -> None:
    result, out = runs["exits"].result()
    assert result.code == 3
    assert result.stdout == "before exit\n"
    assert report(out)["run"]["exit"] == {"status": "exited", "code": 3, "error": None}


def test_ctrl_c_gives_130_and_the_report_is_written(runs: dict[str, Future[Any]]) -> None:
    result, out = runs["interrupted"].result()
    assert result.code == 130
    assert "KeyboardInterrupt" in result.stderr
    assert report(out)["run"]["exit"]["status"] == "interrupted"
    assert report(out)["run"]["exit"]["code"] == 130


def _frames(traceback_text: str, cwd: Path) -> list[tuple[Path, str, str]]:
    """(resolved file, line, function) of each frame of a printed traceback."""
    found = re.findall(r'^  File "([^"]+)", line (\d+), in (\S+)$', traceback_text, re.M)
    return [((cwd / f).resolve(), line, fn) for f, line, fn in found]


def test_an_exception_exits_1_with_the_users_traceback(runs: dict[str, Future[Any]]) -> None:
    result, out, plain = runs["raises"].result()
    assert (result.code, plain.code) == (1, 1)
    assert result.stdout == ""
    start = result.stderr.index("Traceback (most recent call last):\n")
    last = plain.stderr.strip().splitlines()[-1]
    assert last == "NameError: name 'undefined_name' is not defined"
    printed = result.stderr[start:result.stderr.index(last, start) + len(last)]
    frames = _frames(printed, out.parent)
    assert frames, printed
    assert frames[0][0] == out.parent / "boom.py"  # the user's code on top, not memprof's
    assert not any(f.is_relative_to(PACKAGE) or f.name == "runpy.py" for f, _, _ in frames)
    assert frames == _frames(plain.stderr, out.parent)  # the frames Python itself shows
    assert report(out)["run"]["exit"] == {"status": "raised", "code": 1, "error": last}


def test_an_operators_error_shows_the_frames_python_shows(runs: dict[str, Future[Any]]
                                                         ) -> None:
    # the CPU recorder's and the virtual GPU's dispatch modes sit between the script's line
    # and the operator; a plain run shows neither them nor torch's Python under them
    results = {run: runs[f"operator_{run}"].result()
               for run in ("python", "cpu", "virtual", "cuda")}
    where = Path(results["cpu"].stderr.split('File "')[1].split('"')[0]).parent
    expected = _frames(results["python"].stderr, where)
    assert [(f.name, fn) for f, _, fn in expected] == [("on_cpu.py", "<module>"),
                                                       ("on_cpu.py", "inner")]
    last = results["python"].stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: inconsistent tensor size")
    for run in ("cpu", "virtual", "cuda"):
        result = results[run]
        assert result.code == 1, result.stderr
        printed = result.stderr[result.stderr.index("Traceback"):]
        frames = _frames(printed[:printed.index("RuntimeError: ")], where)
        assert [(f.name, line, fn) for f, line, fn in frames] == [
            (f"on_{'cuda' if run == 'cuda' else 'cpu'}.py", line, fn)
            for _, line, fn in expected]
        assert "RuntimeError: inconsistent tensor size" in printed


def test_a_missing_script_is_one_line_and_exit_2(runs: dict[str, Future[Any]]) -> None:
    result, where = runs["missing"].result()
    assert result.code == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert "no_such_script.py" in result.stderr
    assert list(where.iterdir()) == []  # no run folder, no reports/


def test_an_existing_report_is_kept_without_force(runs: dict[str, Future[Any]]) -> None:
    refused, forced, before, out = runs["overwrite"].result()
    assert refused.code == 2
    assert refused.stdout == ""  # the script did not run
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "--force" in refused.stderr
    assert before == {"report.json": "an earlier run's report\n"}  # nothing else written
    assert forced.code == 0, forced.stderr
    assert forced.stdout == "the script ran\n"
    assert report(out)["run"]["exit"]["status"] == "completed"


# --- running as Python would ------------------------------------------------------------


@pytest.mark.parametrize("name", ["as_script", "as_module", "as_command"])
def test_argv_main_and_path_are_what_python_sets(runs: dict[str, Future[Any]],
                                                  name: str) -> None:
    result, plain = runs[name].result()[:2]
    assert (result.code, plain.code) == (0, 0), result.stderr
    seen, expected = json.loads(result.stdout), json.loads(plain.stdout)
    assert expected["argv"][1:] == SCRIPT_ARGS
    assert expected["name"] == "__main__"
    for key in ("argv", "name", "path0"):
        assert seen[key] == expected[key]
    # the script's output is untouched: memprof's own messages go to stderr
    assert result.stdout == json.dumps(seen) + "\n"
    assert "Run folder:" in result.stderr


def test_a_command_runs_as_python_c_runs_it(runs: dict[str, Future[Any]]) -> None:
    result, plain, out = runs["as_command"].result()
    assert json.loads(result.stdout)["file"] is json.loads(plain.stdout)["file"] is None
    command = report(out)["run"]["command"]
    assert command[:3] == ["memprof", "run", "-c"] and command[4:] == SCRIPT_ARGS


def test_script_file_is_what_python_sets(runs: dict[str, Future[Any]]) -> None:
    result, plain = runs["as_script"].result()
    assert json.loads(result.stdout)["file"] == json.loads(plain.stdout)["file"]


# --- CUDA -------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the OOM sample only runs out of memory on one")
def test_oom_sample_reports_the_failed_request(tmp_path: Path) -> None:
    oom = load_sample("oom")
    hidden, out = 2048, tmp_path / "out"
    result = memprof_run(tmp_path, "-o", out, SAMPLES / "oom.py", "--hidden", str(hidden))
    assert result.code == 1, result.stderr[-3000:]
    failed = re.search(r"out of memory at batch (\d+)", result.stderr)
    assert failed is not None, result.stderr[-3000:]
    batch = int(failed.group(1))
    data = report(out)
    assert data["run"]["exit"]["status"] == "exited"
    assert data["run"]["predicted"] is False
    found = data["devices"][0]["oom"]
    assert found is not None
    model = oom.build_model(hidden, 4)
    candidates = {block(batch * n * F32) for n in (oom.IN_FEATURES, hidden, oom.OUT_FEATURES)}
    candidates |= {block(p.numel() * F32) for p in model.parameters()}
    assert found["requested_bytes"] in candidates
    assert (out / "oom-snapshot.pickle").is_file()


@pytest.mark.parametrize("options", LIGHT_ELSEWHERE)
def test_light_is_refused_off_the_cpu_path(runs: dict[str, Future[Any]],
                                           options: list[str]) -> None:
    result, where = runs[f"light_elsewhere{LIGHT_ELSEWHERE.index(options)}"].result()
    assert result.code == 2 and result.stdout == ""
    assert result.stderr.startswith("memprof: error: --light") and "--device cpu" in result.stderr
    assert result.stderr.count("\n") == 1 and not (where / "out").exists()


@pytest.mark.parametrize("command, switches", [
    ([], ["--version"]),
    (["run"], ["--force", "--profile", "--light"]),
    (["explain"], ["--json", "--plot", "--force"]),
    (["check"], ["--allow-different", "--update-baseline"]),
    (["suggest"], ["--verify", "--json"]),
])
def test_help_shows_switches_without_a_value(command: list[str], switches: list[str]) -> None:
    from typer.testing import CliRunner

    from memprof.cli.app import app

    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    rows = {line.split()[1]: line for line in result.output.splitlines()
            if line.startswith("│ ") and len(line.split()) > 2}
    for switch in switches:
        assert switch in rows, result.output
        assert "<bool>" not in rows[switch]  # as if it took one: `--force <bool>`


# --- report.html ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["transformer", "leak"])
def test_the_page_holds_the_reports_figures(runs: dict[str, Future[Any]], name: str) -> None:
    from tests.test_html_report import assert_page_matches, page_data

    result, out = runs[name].result()
    assert result.code == 0, result.stderr[-3000:]
    page = page_data(out / "report.html")
    assert_page_matches(page, report(out))
    assert page["devices"][0]["capacity_bytes"] is None  # --device cpu: no card
    steps = page["devices"][0]["text"]["steps"]
    assert steps.startswith("PROBABLE LEAK") == (name == "leak"), steps


def test_each_rank_has_a_page_and_explain_shows_the_ranks(runs: dict[str, Future[Any]],
                                                          tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from memprof.cli.app import app
    from tests.test_html_report import page_data

    result, out = runs["ddp"].result()
    assert result.code == 0, result.stderr[-3000:]
    for rank in (0, 1):
        page = page_data(out / f"rank-{rank}" / "report.html")
        assert page["run"]["rank"] == rank and len(page["devices"]) == 1
    shown = CliRunner().invoke(app, ["explain", str(out), "--html", str(tmp_path / "p.html")])
    assert shown.exit_code == 0, shown.output
    page = page_data(tmp_path / "p.html")
    assert [d["report"]["rank"] for d in page["devices"]] == [0, 1]
    assert page["imbalance"]["ranks"] == [0, 1]
