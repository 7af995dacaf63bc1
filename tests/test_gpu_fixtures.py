"""The runs this project recorded on a real GPU (``tests/fixtures/gpu``: an H200, torch
2.11.0+cu130, made by ``benchmarks/gpu_validation.py``): what memprof reads from each
snapshot equals what PyTorch's own counters said in the same run, the OOM it explains is
the one the card raised, and the virtual GPU predicts the card."""

from __future__ import annotations

import json
import pickle
import re
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import GPU_FIXTURES, ROOT
from test_run_cli import Result, block, load_sample, run_python

from memprof.analysis.explain import explain
from memprof.collect.hooks.labeller import HookLabeller
from memprof.collect.virtual.cards import parse_spec
from memprof.collect.virtual.recorder import format_size
from memprof.collect.virtual.workspaces import blas_workspace_sizes, unified_setting
from memprof.trace import load_snapshot

RUNS = sorted(p.name for p in GPU_FIXTURES.iterdir() if (p / "counters.json").is_file())
F32 = 4


def as_recorded(run: str) -> dict[str, str]:
    """The environment that makes this torch keep the cuBLASLt workspace as the card's
    torch did: 2.11 kept it apart, 2.12 and later share the cuBLAS one unless told not to."""
    recorded = json.loads((GPU_FIXTURES / run / "counters.json").read_text())["torch_version"]
    return {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": unified_setting(recorded)}


def counters(run: str) -> dict:
    """What PyTorch and NVML measured at the end of ``memprof run`` on the card."""
    return json.loads((GPU_FIXTURES / run / "counters.json").read_text())["memprof_run"]


def findings(path: Path):
    return explain(load_snapshot(path), str(path)).devices[0]


def test_every_sample_was_recorded():
    samples = {p.stem for p in (GPU_FIXTURES.parent.parent.parent / "sample_scripts").glob("*.py")}
    recorded = {run.removesuffix("_tiny").removesuffix("_real").removesuffix("_real_bf16")
                for run in RUNS}
    # the distributed ones need several processes; common.py is the samples' shared code
    assert samples - {"ddp_gloo", "ddp", "fsdp2", "common", "transformer_lm"} <= recorded
    assert {"transformer_tiny", "transformer_real", "transformer_real_bf16"} <= set(RUNS)


@pytest.mark.parametrize("run", RUNS)
def test_the_peaks_are_pytorchs_own_counters(run):
    d = findings(GPU_FIXTURES / run / "snapshot.pickle")
    assert d.peak_allocated_bytes == counters(run)["max_memory_allocated"]
    assert d.peak_reserved_bytes == counters(run)["max_memory_reserved"]


def test_adam_state_on_the_card_is_exactly_two_moments_per_parameter():
    mlp = load_sample("mlp_adam")
    weights = sum(block(p.numel() * F32) for p in mlp.build_model(256, 3).parameters())
    at_peak = findings(GPU_FIXTURES / "mlp_adam" / "snapshot.pickle").at_peak.categories
    assert at_peak["parameters"] == weights
    assert at_peak["gradients"] == weights
    assert at_peak["optimizer_state"] == 2 * weights


def _real_message() -> dict[str, str]:
    text = (GPU_FIXTURES / "oom" / "plain-python-output.txt").read_text()
    found = re.search(r"Tried to allocate (?P<request>[\d.]+ \w+)\. GPU 0 has a total capacity"
                      r" of (?P<total>[\d.]+ \w+) of which (?P<free>[\d.]+ \w+) is free\..*?"
                      r"(?P<allocated>[\d.]+ \w+) is allocated by PyTorch, and"
                      r" (?P<cached>[\d.]+ \w+) is reserved by PyTorch but unallocated", text)
    assert found is not None, text
    return found.groupdict()


def test_explain_names_the_request_and_what_held_the_card_at_the_oom():
    real = _real_message()
    d = findings(GPU_FIXTURES / "oom" / "oom-snapshot.pickle")
    oom, = d.ooms
    assert format_size(oom.device_alloc_bytes) == real["request"] == "1024.00 MiB"
    assert format_size(oom.allocated_bytes) == real["allocated"]
    assert format_size(oom.cached_free_bytes) == real["cached"]
    assert format_size(oom.device_free_bytes) == real["free"]
    assert format_size(parse_spec("H200").total_bytes) == real["total"]
    # more cached than asked for, none of it in one piece: fragmentation
    assert oom.kind == "fragmentation"
    assert oom.largest_free_block_bytes < oom.requested_bytes < oom.cached_free_bytes
    # the model's forward held most of it (its four hidden layers' activations)
    top = oom.live.sites[0]
    assert "oom.py:72" in top.label and top.bytes > oom.allocated_bytes / 2


def test_the_gpu_path_labels_a_trace_that_ran_out_of_memory():
    # the allocator's "oom" entry has no address; reading one lost a run's report on the card
    trace = pickle.loads((GPU_FIXTURES / "oom" / "oom-snapshot.pickle").read_bytes()
                         )["device_traces"][0]
    assert "addr" not in next(e for e in trace if e["action"] == "oom")
    cublas, lt = blas_workspace_sizes((9, 0), {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"})
    labels = HookLabeller().labels(trace, workspaces=(cublas, lt))["labels"]
    # one cuBLAS workspace per thread's handle (autograd's too), cuBLASLt's once
    assert sorted(trace[i]["size"] for i, c in labels if c == "workspace") == [lt, cublas, cublas]


def test_a_labelled_oom_is_not_called_inferred(tmp_path):
    explained = run_python(["-m", "memprof", "explain", GPU_FIXTURES / "oom" / "snapshot.pickle"],
                           tmp_path, {"COLUMNS": "200"})
    assert explained.code == 0, explained.stderr
    assert "What was allocated at the OOM, by" in explained.stdout
    assert "inferred" not in explained.stdout  # memprof's labels, recorded on the card


# --- the virtual GPU against the card ----------------------------------------------------

# the runs the virtual GPU predicts to the byte; cnn's cuDNN workspaces and the bf16
# run's flash-attention scratch are not modelled (benchmarks/results/gpu-validation.md)
EXACT = ["mlp_adam", "leak", "named_blocks", "transformer_tiny", "transformer_real"]


def _command(run: str) -> list[str]:
    command = json.loads((GPU_FIXTURES / run / "counters.json").read_text())["command"]
    return command[2:]  # after "memprof run": the script and its arguments


@pytest.fixture(scope="module")
def predicted(tmp_path_factory) -> dict[str, Future[tuple[Result, Path]]]:
    """``memprof run --virtual-gpu H200`` of each recorded command, two at a time, as the
    card's torch lays out cuBLASLt's workspace (``as_recorded``)."""
    def predict(run: str) -> tuple[Result, Path]:
        out = tmp_path_factory.mktemp(run) / "out"
        return run_python(["-m", "memprof", "run", "--virtual-gpu", "H200", "--no-timeline",
                           "-o", out, *_command(run)], ROOT, as_recorded(run)), out
    pool = ThreadPoolExecutor(2)
    yield {run: pool.submit(predict, run) for run in [*EXACT, "oom"]}
    pool.shutdown()


@pytest.mark.parametrize("run", EXACT)
def test_the_virtual_gpu_predicts_the_cards_peaks_to_the_byte(run, predicted):
    result, out = predicted[run].result()
    assert result.code == 0, result.stderr[-2000:]
    peak = json.loads((out / "report.json").read_text())["devices"][0]["peak"]
    assert peak["allocated_bytes"] == counters(run)["max_memory_allocated"]
    assert peak["reserved_bytes"] == counters(run)["max_memory_reserved"]


def test_the_virtual_gpu_runs_out_of_memory_as_the_card_did(predicted):
    result, _ = predicted["oom"].result()
    assert result.code == 1  # the script's own sys.exit, as on the card
    real = _real_message()
    virtual = re.search(r"out of memory at batch (\d+)", result.stderr)
    assert virtual is not None, result.stderr[-2000:]
    text = (GPU_FIXTURES / "oom" / "plain-python-output.txt").read_text()
    assert f"out of memory at batch {virtual.group(1)} " in text  # the same step failed
    message = re.search(r"Tried to allocate.*?unallocated", result.stderr).group(0)
    for key in ("request", "total", "allocated", "cached"):
        assert real[key] in message, key
    # the card's free memory also counts what the CUDA context loaded by then: the
    # H200's measured context (742 MiB) is the one after the samples' training steps
    free = float(re.search(r"of which ([\d.]+) GiB is free", message).group(1))
    assert abs(free - float(real["free"].split()[0])) <= 0.02
    assert re.search(r"this process has ([\d.]+ GiB) memory in use", message).group(1) == \
        re.search(r"this process has ([\d.]+ GiB) memory in use", text).group(1)


# what neither recorder saw in a role: blocks that live on (workspaces; the fixtures were
# labelled before the GPU labeller named the BLAS workspaces) or that the script freed
UNSEEN = ("temporaries", "workspace", "other")


@pytest.mark.parametrize("run", EXACT)
def test_the_cards_hook_labels_are_the_exact_recorders_roles(run, predicted):
    """The GPU path labels the card's trace from hooks alone; the virtual GPU's recorder
    sees every operator: at the same peak, byte for byte, each role holds the same."""
    result, out = predicted[run].result()
    assert result.code == 0, result.stderr[-2000:]
    exact = json.loads((out / "report.json").read_text())["devices"][0]["categories"]
    card = findings(GPU_FIXTURES / run / "snapshot.pickle").at_peak.categories
    for role in ("parameters", "buffers", "gradients", "optimizer_state", "activations"):
        assert card[role] == exact[role], role
    assert sum(card[c] for c in UNSEEN) == sum(exact[c] for c in UNSEEN)


def test_every_allocation_of_gpt2_small_on_the_card_is_predicted(predicted):
    """Not just the peak: the fp32 GPT-2-small run's every request, with its reductions'
    staging, memory-efficient attention's backward scratch and the embedding backward's
    segment buffers and CUB's temporary storage for its sort and scans (150,015 and 1,279
    bytes here)."""
    result, out = predicted["transformer_real"].result()
    assert result.code == 0, result.stderr[-2000:]

    def requests(path: Path) -> Counter:
        with path.open("rb") as f:
            trace = pickle.load(f)["device_traces"][0]
        return Counter(e["size"] for e in trace if e["action"] == "alloc")
    card = requests(GPU_FIXTURES / "transformer_real" / "snapshot.pickle")
    virtual = requests(out / "snapshot.pickle")
    assert virtual == card
