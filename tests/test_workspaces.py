"""cuBLAS workspaces: the sizes and counts the ground-truth GPU snapshots really show."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import GPU_FIXTURES, ROOT, load_raw

from memprof.collect.virtual.cards import CARDS, parse_spec
from memprof.collect.virtual.workspaces import (
    CublasWorkspaces,
    blas_workspace_sizes,
    cublas_workspace_bytes,
    parse_workspace_config,
)

GROUNDTRUTH = Path(os.environ.get("MEMPROF_GROUNDTRUTH",
                                  ROOT.parent / "shared" / "fixtures" / "groundtruth"))


def groundtruth(prefix: str) -> list[Path]:
    folder = GROUNDTRUTH / "snapshots"
    found = sorted(folder.glob(prefix + "*")) if folder.is_dir() else []
    if not found:
        pytest.skip(f"ground-truth snapshots {prefix}* not found in {folder} "
                    "(set MEMPROF_GROUNDTRUTH)")
    return found


def _never_freed(trace: list[dict]) -> dict[int, tuple[int, dict]]:
    live: dict[int, tuple[int, dict]] = {}
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = (index, event)
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    return live


def _python_stack(event: dict) -> list[tuple[str, int, str]]:
    return [(f["filename"], f["line"], f["name"]) for f in event["frames"]
            if f["filename"].endswith(".py")]


def _python_names(event: dict) -> list[str]:
    return [name for _, _, name in _python_stack(event)]


def test_default_sizes_follow_the_capability():
    a100, h100 = parse_spec("A100"), parse_spec("H100")
    assert cublas_workspace_bytes(a100) == (4096 * 2 + 16 * 8) * 1024
    assert cublas_workspace_bytes(h100) == 4096 * 8 * 1024
    for card in CARDS:
        expected = h100 if card.capability[0] == 9 else a100
        assert cublas_workspace_bytes(card) == cublas_workspace_bytes(expected)


def test_the_environment_overrides_the_default():
    t4 = parse_spec("t4")
    assert cublas_workspace_bytes(t4, ":4096:8") == 32 << 20
    assert cublas_workspace_bytes(t4, ":16:8") == 128 << 10
    assert parse_workspace_config("4096") is None
    assert cublas_workspace_bytes(t4, "4096") == cublas_workspace_bytes(t4)  # PyTorch warns


def test_one_workspace_per_thread_and_stream():
    spaces = CublasWorkspaces(size=1000)
    assert spaces.allocations_for("aten.relu.default", "main") == []
    assert spaces.allocations_for("aten.mm.default", "main") == [1000]
    assert spaces.allocations_for("bmm", "main") == []
    assert spaces.allocations_for("addmm", "main", stream=7) == [1000]
    assert spaces.allocations_for("aten.mm.out", "autograd") == [1000]
    assert spaces.allocations_for("mm", "autograd") == []


def _linear_args(bias_shape: tuple[int, ...], rows: int = 8) -> tuple:
    meta = {"device": "meta"}
    return torch.empty(bias_shape, **meta), torch.empty(rows, 16, **meta), \
        torch.empty(16, 32, **meta)


def test_a_bias_vector_makes_addmm_take_a_cublaslt_workspace_too():
    spaces = CublasWorkspaces(size=1000, lt_size=100)
    assert spaces.allocations_for("mm", "main") == [1000]
    assert spaces.allocations_for("addmm", "main", 0, _linear_args((32, 8))) == []  # 2-D
    assert spaces.allocations_for("addmm", "main", 0, _linear_args((32,)), {"beta": 2}) == []
    assert spaces.allocations_for("addmm", "main", 0, _linear_args((32,), rows=1)) == []
    assert spaces.allocations_for("addmm", "main", 0, _linear_args((32,))) == [100]
    assert spaces.allocations_for("addmm", "main", 0, _linear_args((1, 32))) == []  # held
    # a thread whose first BLAS call is an Lt one takes both, cuBLAS's first
    assert spaces.allocations_for("_addmm_activation", "other") == [1000, 100]
    assert CublasWorkspaces(size=1000).allocations_for(
        "addmm", "main", 0, _linear_args((32,))) == [1000]  # unified: no Lt workspace


def test_the_lt_workspace_size_follows_pytorchs_environment():
    hopper, old = (9, 0), "2.11.0+cu130"  # the H200's torch: the Lt workspace apart

    def sizes(env: dict[str, str], capability=hopper, version=old) -> tuple[int, int]:
        return blas_workspace_sizes(capability, env, version)
    assert sizes({}) == (32 << 20, 1 << 20)
    assert sizes({}, (8, 0)) == (cublas_workspace_bytes(parse_spec("A100")), 1 << 20)
    assert sizes({"CUBLASLT_WORKSPACE_SIZE": "4096"})[1] == 4 << 20
    # capped at the cuBLAS workspace, as PyTorch caps it; a bad value keeps the default
    assert sizes({"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == (128 << 10, 128 << 10)
    assert sizes({"CUBLASLT_WORKSPACE_SIZE": "big"})[1] == 1 << 20
    for true in ("1", "true", "ON"):
        assert sizes({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": true})[1] == 0
    # from torch 2.12 an unset variable shares the cuBLAS workspace; false still does not
    for version in ("2.12.0", "2.13.0+cpu", "3.0.0"):
        assert sizes({}, version=version) == (32 << 20, 0)
        assert sizes({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}, version=version)[1] == 1 << 20


@pytest.mark.parametrize("run", ["mlp_adam", "cnn", "transformer_real"])
def test_an_h200_training_run_holds_cublas_and_lt_workspaces(run):
    """Recorded on an H200 (torch 2.11.0+cu130): the first Linear's addmm makes the
    forward thread's 32 MiB cuBLAS and 1 MiB Lt workspaces, one after the other; the
    backward's first matmul its own 32 MiB; none is ever freed."""
    torch_version = json.loads((GPU_FIXTURES / run / "counters.json").read_text())[
        "torch_version"]
    cublas, lt = blas_workspace_sizes(parse_spec("H200").capability, {}, torch_version)
    trace = load_raw(GPU_FIXTURES / run / "snapshot.pickle")["device_traces"][0]
    never_freed = _never_freed(trace)
    allocs = [e for e in trace if e["action"] == "alloc"]
    spaces = [n for n, e in enumerate(allocs) if e["size"] in (cublas, lt)
              and e["addr"] in never_freed]
    assert [allocs[n]["size"] for n in spaces] == [cublas, lt, cublas]
    assert spaces[1] == spaces[0] + 1
    assert _python_names(allocs[spaces[0]])[:2] == ["forward", "inner"]
    assert _python_names(allocs[spaces[2]]) == []  # autograd's device thread


@pytest.mark.parametrize("kind, holders", [("forward_memory", 1), ("forward_and_backward", 2)])
def test_whole_process_runs_hold_one_workspace_per_thread(kind, holders):
    """NiuHuangxiaozi's recordings start at zero: every workspace allocation is in the trace."""
    size = cublas_workspace_bytes(parse_spec("A100"))  # the GPU was not a Hopper: see below
    niu = "NiuHuangxiaozi+assignment2-systems+cs336_systems_profile_memory_"
    for path in groundtruth(niu + kind):
        trace = load_raw(path)["device_traces"][0]
        allocs = [(i, e) for i, e in enumerate(trace) if e["action"] == "alloc"]
        spaces = [(i, e) for i, e in allocs if e["size"] == size]
        assert len(spaces) == holders, path.name
        assert not [e for _, e in allocs if e["size"] == cublas_workspace_bytes(parse_spec("H100"))]
        never_freed = _never_freed(trace)
        assert all(e["addr"] in never_freed for _, e in spaces)
        # the forward's: in the first matmul of the script (an einsum), after its output
        # (and, under autocast, its operands' bf16 copies): the same stack throughout
        first = next(n for n, (_, e) in enumerate(allocs) if "einsum" in _python_names(e))
        position = [i for i, _ in allocs].index(spaces[0][0])
        assert position > first
        stack = _python_stack(allocs[first][1])
        assert all(_python_stack(e) == stack for _, e in allocs[first:position + 1])
        if holders == 2:  # the backward's: autograd's device thread, no Python frames
            assert _python_names(spaces[1][1]) == []


@pytest.mark.parametrize("prefix", ["LINYUNLinYun", "Wedsonlin"])
def test_windowed_runs_hold_the_workspaces_from_before_the_window(prefix):
    """Recorded after warm-up: the workspaces are blocks in the final segments, not in the trace."""
    size = cublas_workspace_bytes(parse_spec("A100"))
    for path in groundtruth(prefix):
        raw = load_raw(path)
        allocated_in_window = {e["addr"] for e in raw["device_traces"][0] if e["action"] == "alloc"}
        held = [b for s in raw["segments"] for b in s["blocks"]
                if b["state"] == "active_allocated" and b["address"] not in allocated_in_window
                and b["size"] == size]
        assert len(held) == (2 if "training" in path.name or "full_step" in path.name else 1), \
            path.name


@pytest.mark.parametrize("ctx, staging", [("100", None), ("150", 6 << 20), ("200", 8 << 20)])
def test_global_reductions_stage_through_the_allocator(ctx, staging):
    """RMSNorm weight gradients: output (512 floats), staging buffer, semaphores, both freed."""
    path, = groundtruth("NiuHuangxiaozi+assignment2-systems+cs336_systems_profile_memory_"
                        f"forward_and_backward_memory_snapshot_{ctx}.pickle")
    trace = load_raw(path)["device_traces"][0]
    allocs = [i for i, e in enumerate(trace) if e["action"] == "alloc"]
    found = [i for i in allocs if trace[i]["size"] in (6 << 20, 8 << 20)]
    if staging is None:
        assert found == []
        return
    assert len(found) == 9 * 3  # 2 norms x 4 layers + the final norm, 3 steps
    for i in found:
        assert trace[i]["size"] == staging
        assert [trace[i + k]["action"] for k in (-1, 1)] == ["alloc", "alloc"]
        assert (trace[i - 1]["size"], trace[i + 1]["size"]) == (512 * 4, 16)
        frees = {(e["addr"], e["action"]) for e in trace[i + 2:i + 6]}
        assert (trace[i]["addr"], "free_requested") in frees
        assert (trace[i + 1]["addr"], "free_requested") in frees
