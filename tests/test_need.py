"""A run that ran out of memory: what it needs, from its re-run with the card's memory raised.

The same script runs out of memory on a virtual 2 GiB card and fits an H100 80GB of the
same compute capability: the need ``memprof run`` predicts for the small card is the big
card's peak, byte for byte, and ``suggest`` and ``explain`` take it from there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_run_cli import SAMPLES, Result, load_sample, memprof_run, report, run_python

from memprof.collect.virtual.cards import parse_spec
from memprof.errors import MemprofError

SMALL = parse_spec("2GiB")
# 3 x Linear(8192, 8192) with Adam: 0.75 GiB of weights, as much of gradients and twice of
# moments; the 2 GiB card runs out while Adam makes its moments
SCRIPT = [SAMPLES / "mlp_adam.py", "--hidden", "8192", "--layers", "3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result, Path]:
    where = tmp_path_factory.mktemp("need")
    small = memprof_run(where, "-o", where / "small", "--virtual-gpu", "2GiB", "--steps", "3",
                        "--no-timeline", *SCRIPT)
    big = memprof_run(where, "-o", where / "big", "--virtual-gpu", "H100", "--steps", "3",
                      "--no-timeline", "--no-need", *SCRIPT)
    assert big.code == 0, big.stderr[-2000:]
    return where / "small", small, where / "big"


def test_the_need_is_the_peak_on_a_card_large_enough(runs: tuple[Path, Result, Path]) -> None:
    small, result, big = runs
    assert result.code == 1 and "OutOfMemoryError" in result.stderr
    need = report(small)["run"]["need"]
    peak = report(big)["devices"][0]["peak"]
    assert (need["allocated_bytes"], need["reserved_bytes"]) == (
        peak["allocated_bytes"], peak["reserved_bytes"])
    assert need["total_bytes"] == peak["reserved_bytes"] + SMALL.context_bytes
    assert need["short_bytes"] == need["total_bytes"] - SMALL.total_bytes > 0
    assert need["rerun"] == {"status": "stopped", "optimizer_steps": 3, "stopped_by": "steps"}
    assert "Needs " in result.stderr and "short" in result.stderr
    assert (small / "need" / "report.json").is_file()


def test_suggest_advises_from_the_rerun_and_never_calls_it_within_budget(
        runs: tuple[Path, Result, Path]) -> None:
    small, _, _ = runs
    need = report(small)["run"]["need"]
    advised = run_python(["-m", "memprof", "suggest", small, "--budget", "2GiB", "--json"],
                         small.parent)
    assert advised.code == 0, advised.stderr[-2000:]
    data = json.loads(advised.stdout)
    assert data["source"]["path"] == str(small / "need" / "report.json")
    assert "Already within the budget" not in advised.stdout + advised.stderr
    assert data["source"]["out_of_memory"].startswith("The run ran out of memory")
    assert data["suggest"]["fits_now"] is False
    assert data["suggest"]["current"]["reserved_bytes"] >= need["reserved_bytes"] * 0.99


def test_explain_says_the_peak_is_a_lower_bound_and_what_the_run_needs(
        runs: tuple[Path, Result, Path]) -> None:
    small, _, _ = runs
    explained = run_python(["-m", "memprof", "explain", small / "snapshot.pickle",
                            "--device-memory", "100GB"], small.parent)
    assert explained.code == 0, explained.stderr[-2000:]
    text = " ".join(explained.stdout.split())
    assert "its peak is a lower bound" in text
    assert "Needs " in text and "short" in text


def test_an_out_of_memory_in_the_first_step_keeps_the_model_and_its_half_built_state(
        runs: tuple[Path, Result, Path]) -> None:
    """The run dies while Adam makes its moments: the model facts are there, and the
    moments made before the failure are optimizer state, not temporaries."""
    small, _, _ = runs
    data = report(small)
    model = load_sample("mlp_adam").build_model(8192, 3)
    assert data["run"]["model"]["parameters"] == sum(p.numel() for p in model.parameters())
    held = data["devices"][0]["oom"]["live"]["categories"]
    assert held["optimizer_state"] > 0 and held["temporaries"] == 0


def test_a_memory_fraction_is_the_limit_the_run_ran_out_under(tmp_path: Path) -> None:
    """oom.py caps the process at 5% of the card (set_per_process_memory_fraction): the
    failed request is a shortage under that cap, and the need is short of it, not of the
    card."""
    t4 = parse_spec("T4")
    result = memprof_run(tmp_path, "-o", "run", "--virtual-gpu", "T4", "--no-timeline",
                         SAMPLES / "oom.py")
    data = report(tmp_path / "run")
    allowed = int(0.05 * t4.total_bytes)  # as the caching allocator computes its cap
    oom = data["devices"][0]["oom"]
    assert (oom["limit_bytes"], oom["kind"]) == (allowed, "shortage"), result.stderr[-2000:]
    need = data["run"]["need"]
    assert need["allowed_bytes"] == allowed
    assert need["short_bytes"] == need["reserved_bytes"] - allowed > 0
    assert "where the run could reserve only" in " ".join(result.stderr.split())


@pytest.fixture(scope="module")
def on_a_gpu(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small card's run as a real GPU's report would have it: no virtual card, no need
    (a real GPU cannot re-run with more memory), its card and CUDA context as measured."""
    from memprof.report.provenance import sign

    where = tmp_path_factory.mktemp("predict")
    ran = memprof_run(where, "-o", where / "gpu", "--virtual-gpu", "2GiB", "--steps", "3",
                      "--no-timeline", "--no-need", *SCRIPT)
    assert ran.code == 1, ran.stderr[-2000:]
    path = where / "gpu" / "report.json"
    data = json.loads(path.read_text())
    run = data["run"]
    assert "need" not in run  # --no-need
    run.update(virtual_gpu=None, predicted=False, device="cuda (memprof test GPU)",
               cuda={"name": "memprof test GPU", "total_bytes": SMALL.total_bytes,
                     "context_bytes": CONTEXT})
    # what the card had free when the run ran out, beside what it reserved
    data["devices"][0]["oom"]["limit_bytes"] = SMALL.total_bytes - CONTEXT
    run["signature"] = sign(run)  # memprof run wrote it here, for this user
    path.write_text(json.dumps(data))
    return where / "gpu"


CONTEXT = 300 << 20  # the CUDA context the real GPU's run measured


def test_suggest_predicts_what_a_real_gpus_run_needs(
        runs: tuple[Path, Result, Path], on_a_gpu: Path) -> None:
    _, _, big = runs
    lower = run_python(["-m", "memprof", "suggest", on_a_gpu, "--budget", "2GiB"],
                       on_a_gpu.parent)
    assert "--predict" in lower.stdout and "lower bound" in lower.stdout
    assert lower.code == 1  # what it needs is unknown: never "fits"
    advised = run_python(["-m", "memprof", "suggest", on_a_gpu, "--budget", "2GiB", "--predict",
                          "--json"], on_a_gpu.parent)
    assert advised.code == 0, advised.stderr[-2000:]
    assert "running it again on the virtual" in advised.stderr
    need = report(on_a_gpu)["run"]["need"]
    peak = report(big)["devices"][0]["peak"]  # the same capability: the same peak
    assert need["reserved_bytes"] == peak["reserved_bytes"]
    assert (need["card_bytes"], need["context_bytes"]) == (SMALL.total_bytes, CONTEXT)
    assert need["short_bytes"] == peak["reserved_bytes"] + CONTEXT - SMALL.total_bytes > 0
    data = json.loads(advised.stdout)
    assert data["source"]["path"] == str(on_a_gpu / "need" / "report.json")
    assert data["suggest"]["fits_now"] is False
    again = run_python(["-m", "memprof", "suggest", on_a_gpu, "--budget", "2GiB", "--predict"],
                       on_a_gpu.parent)
    assert "known already" in again.stderr and "running it again" not in again.stderr


def test_predict_is_for_a_run_that_ran_out_of_memory(runs: tuple[Path, Result, Path]) -> None:
    _, _, big = runs
    refused = run_python(["-m", "memprof", "suggest", big, "--budget", "80GB", "--predict"],
                         big.parent)
    assert refused.code == 2
    assert refused.stderr.strip().count("\n") == 0
    assert "--predict tells what a run that ran out of memory needs" in refused.stderr


def test_a_snapshot_that_ran_out_of_memory_is_a_lower_bound(tmp_path: Path) -> None:
    """A real GPU's out-of-memory snapshot: never "within the budget", and no command to
    re-run for --predict (one line, exit 2)."""
    snapshot = Path(__file__).parent / "fixtures" / "gpu" / "oom" / "oom-snapshot.pickle"
    advised = run_python(["-m", "memprof", "suggest", snapshot, "--budget", "100GB"], tmp_path)
    assert advised.code == 1, advised.stderr[-2000:]
    assert "lower bound" in advised.stdout and "Already within the budget" not in advised.stdout
    refused = run_python(["-m", "memprof", "suggest", snapshot, "--budget", "100GB",
                          "--predict"], tmp_path)
    assert refused.code == 2 and refused.stderr.strip().count("\n") == 0
    assert "a snapshot records no command to re-run" in refused.stderr


def test_a_run_given_a_size_is_re_run_on_that_size() -> None:
    """``--virtual-gpu 6GiB``: its report names "GPU with 6 GiB", which --predict and
    --verify re-run as the size it was."""
    from memprof.advise.predict import card_of
    from memprof.advise.rerun import _where
    from memprof.advise.source import Run

    facts = {"virtual_gpu": {"spec": "GPU with 6 GiB", "total_bytes": 6 << 30}}
    run = Run(Path("report.json"), {"run": facts}, {}, None, False)
    assert card_of(run).total_bytes == 6 << 30
    assert _where(run.path, facts) == ["--virtual-gpu", str(6 << 30)]
    with pytest.raises(MemprofError, match="not a card memprof knows"):
        _where(run.path, {"virtual_gpu": {"spec": "GPU with lots", "total_bytes": "x"}})


def test_predict_refuses_a_rank_of_a_world_in_one_line() -> None:
    from memprof.advise.predict import predict
    from memprof.advise.source import Run

    run = Run(Path("report.json"), {"run": {"world_size": 2, "rank": 1}}, {}, None, False)
    with pytest.raises(MemprofError, match="--predict re-runs one process; run the script"
                       " with memprof run --nproc-per-node N"):
        predict(run, None)  # type: ignore[arg-type]
