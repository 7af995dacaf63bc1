"""Attribution by nn.Module and the ``buffers`` category, through ``memprof run``'s JSON.

``sample_scripts/named_blocks.py`` runs one forward pass through ``blocks.N.mlp.{fc,act,
proj}`` and keeps its graph: at the end (the peak) each ``fc`` holds its weight, its bias
and its output (saved by the GELU after it), each ``act`` its output (saved by ``proj``).
Expected bytes come from the shapes and the allocator's block rounding.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from test_run_cli import F32, SAMPLES, Result, block, flags, report, run_python
from torch import nn

from memprof.analysis.explain import explain
from memprof.collect.cpu.recorder import CpuRecorder
from memprof.report.json import report_dict
from memprof.trace import load_snapshot
from memprof.trace.events import as_snapshot_events
from tests.conftest import fixture

SIZES = {"width": 24, "hidden": 72, "blocks": 2, "seq": 12, "batch": 10}
SCRIPT = SAMPLES / "named_blocks.py"


def _run(where: Path, memprof_args: list[str], script_args: list[str]) -> tuple[Result, Path]:
    out = where / "out"
    return run_python(["-m", "memprof", "run", "-o", out, *memprof_args, SCRIPT, *flags(SIZES),
                       *script_args], where), out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Any]]]:
    """The CPU recorder and the virtual GPU on the same script, at once."""
    base = tmp_path_factory.mktemp("attribution")
    kinds = {"cpu": (["--device", "cpu"], ["--device", "cpu"]),
             "virtual": (["--virtual-gpu", "H100"], [])}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {}
        for name, (memprof_args, script_args) in kinds.items():
            (base / name).mkdir()
            futures[name] = pool.submit(_run, base / name, memprof_args, script_args)
        yield futures


def _device(runs: dict[str, Future[Any]], kind: str) -> dict[str, Any]:
    result, out = runs[kind].result()
    assert result.code == 0, result.stderr[-3000:]
    return report(out)["devices"][0]


def _modules(device: dict[str, Any]) -> dict[str, int]:
    return {m["module"]: m["bytes"] for m in device["top_modules"]}


@pytest.mark.parametrize("kind", ["cpu", "virtual"])
def test_module_bytes_at_the_peak_are_exact(runs: dict[str, Future[Any]], kind: str) -> None:
    width, hidden, batch = SIZES["width"], SIZES["hidden"], SIZES["batch"]
    activation = block(batch * hidden * F32)  # fc's output, and act's
    fc = block(hidden * width * F32) + block(hidden * F32) + activation
    proj = block(width * hidden * F32) + block(width * F32)  # its output died in the add
    device = _device(runs, kind)
    modules = _modules(device)
    for i in range(SIZES["blocks"]):
        assert modules[f"blocks.{i}.mlp.fc"] == fc
        assert modules[f"blocks.{i}.mlp.act"] == activation
        assert modules[f"blocks.{i}.mlp.proj"] == proj
        assert modules[f"blocks.{i}"] == block(batch * width * F32)  # the residual sum
    assert modules["Net"] == block(SIZES["seq"] ** 2 * F32)  # the root: its own buffer
    assert set(modules) == {"Net", *(f"blocks.{i}.mlp.{m}" for i in range(SIZES["blocks"])
                                     for m in ("fc", "act", "proj")),
                            *(f"blocks.{i}" for i in range(SIZES["blocks"]))}
    # each block's modules summed over the blocks, with their count; the root is no block
    n = SIZES["blocks"]
    summed = {m["module"]: (m["bytes"], m["instances"]) for m in device["repeated_modules"]}
    assert summed == {"blocks.*.mlp.fc": (n * fc, n), "blocks.*.mlp.act": (n * activation, n),
                      "blocks.*.mlp.proj": (n * proj, n),
                      "blocks.*": (n * block(batch * width * F32), n)}
    peak = device["peak"]["allocated_bytes"]
    first = device["top_modules"][0]
    assert first["module"] == "blocks.0.mlp.fc" and first["count"] == 3
    assert first["share"] == round(fc / peak, 6)


@pytest.mark.parametrize("kind", ["cpu", "virtual"])
def test_the_repeated_blocks_share_of_each_category(runs: dict[str, Future[Any]],
                                                    kind: str) -> None:
    # what checkpointing can shrink: what blocks.N made, not the root's buffer or the input
    device = _device(runs, kind)
    inside = device["categories_in_blocks"]
    width, hidden = SIZES["width"], SIZES["hidden"]
    weights = block(hidden * width * F32) + block(hidden * F32) + \
        block(width * hidden * F32) + block(width * F32)
    assert inside["parameters"] == SIZES["blocks"] * weights == device["categories"]["parameters"]
    assert inside["buffers"] == 0 < device["categories"]["buffers"]
    in_blocks = sum(b for m, b in _modules(device).items() if m.startswith("blocks."))
    assert sum(inside.values()) == in_blocks


def test_the_model_code_frame_is_the_forward_line(runs: dict[str, Future[Any]]) -> None:
    line = next(i for i, text in enumerate(SCRIPT.read_text().splitlines(), 1)
                if "return self.proj(self.act(self.fc(x)))" in text)
    act = next(m for m in _device(runs, "cpu")["top_modules"] if m["module"] == "blocks.1.mlp.act")
    assert re.fullmatch(rf".*named_blocks\.py:{line} forward", act["frame"])


@pytest.mark.parametrize("kind", ["cpu", "virtual"])
def test_a_registered_buffer_is_in_buffers(runs: dict[str, Future[Any]], kind: str) -> None:
    device = _device(runs, kind)
    assert device["categories"]["buffers"] == block(SIZES["seq"] ** 2 * F32)
    assert device["category_peaks"]["buffers"] == block(SIZES["seq"] ** 2 * F32)
    assert sum(device["categories"].values()) == device["peak"]["allocated_bytes"]


def test_workspaces_belong_to_no_module(runs: dict[str, Future[Any]]) -> None:
    device = _device(runs, "virtual")
    assert device["categories"]["workspace"] > 0
    assert _modules(device) == _modules(_device(runs, "cpu"))


def test_the_console_shows_buffers_and_the_module_table(runs: dict[str, Future[Any]]) -> None:
    result, _ = runs["cpu"].result()
    assert re.search(r"buffers \(module state\) +1\.00 KiB", result.stderr)
    assert "Top modules at the peak" in result.stderr
    # the blocks' modules summed, with their count, before single modules
    assert re.search(r"  blocks\.\*\.mlp\.fc x2  ", result.stderr)
    assert "blocks.0.mlp.fc" not in result.stderr


def test_snapshots_from_elsewhere_have_no_modules() -> None:
    path = fixture("MAGMA27")
    findings = explain(load_snapshot(path), str(path))
    for device in report_dict(findings)["devices"]:
        assert device["top_modules"] == []
        assert device["categories"]["buffers"] == 0


def test_backward_allocations_belong_to_the_module_whose_backward_made_them() -> None:
    n_in, n_out, batch = 3, 5, 2
    with CpuRecorder() as recorder:
        model = nn.Sequential(OrderedDict(fc=nn.Linear(n_in, n_out), act=nn.Tanh()))
        x = torch.randn(batch, n_in)
        model(x).sum().backward()
        after = torch.zeros(7)  # outside every module, after the backward
    snapshot = recorder.snapshot()
    events = as_snapshot_events(snapshot["device_traces"][0])
    labels = dict(snapshot["memprof"]["labels"])
    modules = dict(snapshot["memprof"]["modules"])
    gradients = sorted((events[i]["size"], modules.get(i)) for i, c in labels.items()
                       if c == "gradients")
    assert gradients == [(n_out * F32, "fc"), (n_out * n_in * F32, "fc")]
    backward = [i for i in modules if events[i]["frames"][0]["name"] == "_engine_run_backward"]
    assert {modules[i] for i in backward} == {"fc", "act"}  # tanh's backward: its grad input
    last = max(i for i, e in enumerate(events) if e["action"] == "alloc")
    assert events[last]["size"] == after.nbytes and last not in modules
    assert snapshot["memprof"]["model_files"] == []  # torch's own modules are not model code


def test_the_layers_of_a_sequential_are_not_summed_as_repeated_blocks() -> None:
    """DCGAN's ``main``: a conv, a norm and an activation are different modules; the blocks
    of a list with modules inside them are instances of one."""
    from memprof.analysis.modules import rank_repeated

    rows = [(f"main.{i}", 100 * (i + 1), None) for i in range(14)]
    rows += [(f"layers.{i}", 10, None) for i in range(3)]
    rows += [(f"layers.{i}.mlp", 20, None) for i in range(3)]
    summed = {m.module: (m.bytes, m.instances) for m in rank_repeated(rows, 10_000, 10)}
    assert summed == {"layers.*": (30, 3), "layers.*.mlp": (60, 3)}
