"""Inferred categories (for foreign snapshots) against the exact labels of a recorded run."""

from __future__ import annotations

import importlib.util

import pytest

from memprof.analysis.categories import Phase, infer_category
from memprof.analysis.explain import explain
from memprof.collect.cpu.recorder import CpuRecorder
from memprof.collect.recording import predict_cuda_layout
from memprof.trace.model import AllocatorSettings, Frame
from memprof.trace.normalize import normalize
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def recorded_transformer() -> dict:
    path = ROOT / "sample_scripts" / "transformer_lm.py"
    spec = importlib.util.spec_from_file_location("transformer_lm_sample", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with CpuRecorder() as recorder:
        module.main(["--device", "cpu", "--steps", "3"])
    snapshot, _ = predict_cuda_layout(recorder.snapshot(), AllocatorSettings())
    return snapshot


def test_inference_matches_exact_labels_on_model_state(recorded_transformer):
    exact = explain(normalize(recorded_transformer)).devices[0]
    anonymous = {k: v for k, v in recorded_transformer.items() if k != "memprof"}
    inferred = explain(normalize(anonymous)).devices[0]
    assert not exact.categories_inferred and inferred.categories_inferred
    assert inferred.peak_allocated_bytes == exact.peak_allocated_bytes
    for key in ("parameters", "gradients", "optimizer_state"):
        assert inferred.at_peak.categories[key] == exact.at_peak.categories[key] > 0
    # what autograd saved vs. what the forward only used: judged from lifetimes alone
    saved, inferred_saved = exact.at_peak.categories["activations"], \
        inferred.at_peak.categories["activations"]
    assert abs(inferred_saved - saved) <= 0.05 * saved


def test_a_foreign_snapshots_collective_buffers_are_inferred_from_their_innermost_frame(
        ) -> None:
    fsdp = Frame("/x/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 351,
                 "foreach_all_gather")
    user = Frame("/u/train.py", 9, "main")
    cpp = Frame("??", 0, "c10::cuda::CUDACachingAllocator::malloc")
    gathered = (cpp, fsdp, user)
    assert infer_category(gathered, Phase.FORWARD, Phase.FORWARD) == "communication"
    # a reduce-scatter output kept past backward is the sharded gradient
    assert infer_category(gathered, Phase.BACKWARD, None) == "gradients"
    forward = (cpp, Frame("/u/model.py", 3, "forward"),
               Frame("/x/torch/nn/parallel/distributed.py", 1, "forward"), user)
    assert infer_category(forward, Phase.FORWARD, Phase.FORWARD) == "temporaries"
