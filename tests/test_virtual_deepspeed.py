"""DeepSpeed on the virtual cluster, through its own engine: a config's fused AdamW runs,
the model's parameters are counted once (not with the optimizer's fp32 partitions), and
``suggest --verify`` sets smaller reduce buckets in the config the engine reads.

Runs DeepSpeed where it is installed (CI installs it: ``.ci/run``). The expected bytes come
from the model's size P, the world size W and the allocator's 512-byte blocks: ZeRO-2 in
bf16 holds the bf16 weights (2P) and this rank's fp32 partition (4P/W) as parameters, and
AdamW's two fp32 moments of the partition (8P/W).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from test_run_cli import Result, block, report, run_python
from torch import nn

from memprof.collect.hooks.model_facts import model_facts

D, LAYERS, WORLD, BUCKET = 512, 4, 2, 1_000_000
P = LAYERS * (D * D + D)

ZERO_2 = f"""\
import torch
import deepspeed

model = torch.nn.Sequential(*[torch.nn.Linear({D}, {D}) for _ in range({LAYERS})])
config = {{"train_micro_batch_size_per_gpu": 4, "bf16": {{"enabled": True}},
          "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-4}}}},
          "zero_optimization": {{"stage": 2, "reduce_bucket_size": 4_000_000}}}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                       config=config)
for _ in range(2):
    loss = engine(torch.ones(4, {D}, device="cuda", dtype=torch.bfloat16)).float().sum()
    engine.backward(loss)
    engine.step()
"""


@pytest.fixture(scope="module")
def zero_2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
    """The script over 2 ranks, with ``suggest --verify``'s smaller buckets applied."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (.ci/run installs it)")
    where = tmp_path_factory.mktemp("zero_2")
    (where / "zero.py").write_text(ZERO_2)
    env = {"MEMPROF_APPLY": json.dumps({"zero_buckets": BUCKET})}
    result = run_python(["-m", "memprof", "run", "--virtual-gpu", "A100", "--nproc-per-node",
                         str(WORLD), "--no-timeline", "-o", where / "out", "zero.py"], where, env)
    return result, where / "out"


def test_zero_2_with_the_config_s_fused_adamw_holds_its_partitions(
        zero_2: tuple[Result, Path]) -> None:
    result, out = zero_2
    assert result.code == 0, result.stderr  # FusedAdam's CUDA kernels were not compiled
    for rank in range(WORLD):
        data = report(out / f"rank-{rank}")
        categories = data["devices"][0]["categories"]
        assert categories["parameters"] == block(2 * P) + block(4 * P // WORLD)
        assert categories["optimizer_state"] == 2 * block(4 * P // WORLD)
        model = data["run"]["model"]
        # the model's parameters, once: not again as the optimizer's fp32 partition
        assert (model["parameters"], model["dtypes"]) == (P, {"bfloat16": P})
        assert model["optimizers"][0]["class"] == "FusedAdam"


def test_verify_s_smaller_buckets_are_the_engine_s(zero_2: tuple[Result, Path]) -> None:
    _, out = zero_2
    data = report(out / "rank-0")
    assert data["run"]["model"]["parallelism"]["deepspeed"]["reduce_bucket_size"] == BUCKET
    with (out / "rank-0" / "snapshot.pickle").open("rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    buckets = {e["size"] for e in trace if e["action"] == "alloc" and any(
        frame["name"] == "setup_buckets" for frame in e["frames"])}
    assert buckets == {BUCKET * 2}  # BUCKET bf16 gradients (4,000,000 as the script asked)


def _parameter(n: int, **attributes: Any) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(n))
    p.__dict__.update(attributes)
    return p


def test_an_optimizer_s_copies_of_the_weights_are_not_more_parameters() -> None:
    model = nn.Linear(8, 8)
    masters = torch.optim.SGD([_parameter(40)])  # a flat fp32 partition, as ZeRO-1/2's
    assert model_facts([model], [masters], None, {})["parameters"] == 8 * 8 + 8
    # where no module holds parameters, the optimizer's are the model's
    assert model_facts([], [masters], None, {})["parameters"] == 40
    both = torch.optim.SGD([*model.parameters(), _parameter(3)])  # a learnt scale beside
    assert model_facts([model], [both], None, {})["parameters"] == 8 * 8 + 8 + 3


def test_a_zero_3_parameter_counts_its_whole_elements() -> None:
    layer = nn.Module()
    layer.weight = _parameter(0, ds_numel=1000)  # emptied between gathers
    facts = model_facts([layer], [], None, {})
    assert (facts["parameters"], facts["trainable"], facts["parameter_bytes"]) == \
        (1000, 1000, 4000)
