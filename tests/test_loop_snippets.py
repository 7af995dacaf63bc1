"""Remedies in the switches of the library whose loop steps the optimizer: which loop it
is (read from the step's stack), and the snippets each gets."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest

from memprof.advise.peak import Peak
from memprof.advise.remedies import Context, catalogue
from memprof.collect.hooks.roles import _loop_of
from memprof.trace.model import ACTIVATIONS, CATEGORIES, OPTIMIZER_STATE, PARAMETERS


def _called_through(*files: str) -> str | None:
    """What ``_loop_of`` finds when called from functions defined in ``files``, the
    outermost first (each a file of that name, as a library's frames are)."""
    call: Callable[[], str | None] = lambda: _loop_of(sys._getframe())  # noqa: E731
    for filename in reversed(files):
        namespace = {"inner": call}
        exec(compile("def outer():\n    return inner()\n", filename, "exec"), namespace)
        call = namespace["outer"]
    return call()


@pytest.mark.parametrize(("files", "loop"), [
    (("/u/train.py",), None),
    (("/env/site-packages/lightning/pytorch/loops/fit_loop.py",), "lightning"),
    (("/env/site-packages/pytorch_lightning/loops/optimization/automatic.py",), "lightning"),
    # Lightning Fabric: the script's loop steps Fabric's wrapped optimizer
    (("/u/train.py", "/env/site-packages/lightning/fabric/wrappers.py"), "fabric"),
    (("/u/train.py", "/env/site-packages/lightning_fabric/wrappers.py"), "fabric"),
    (("/u/train.py", "/env/site-packages/accelerate/optimizer.py"), "accelerate"),
    # Hugging Face's Trainer steps through accelerate's optimizer: the Trainer is the loop
    (("/env/site-packages/transformers/trainer.py", "/env/site-packages/accelerate/optimizer.py"),
     "transformers"),
])
def test_the_loop_that_steps_the_optimizer_is_read_from_its_stack(files: tuple[str, ...],
                                                                   loop: str | None) -> None:
    assert _called_through(*files) == loop


def _remedies(loop: str | None) -> dict[str, str]:
    """Each remedy's snippet for a float32 model whose activations fill the peak."""
    moment = {**dict.fromkeys(CATEGORIES, 0), ACTIVATIONS: 100 << 20}
    facts = {"trainer": loop, "dtypes": {"float32": 1 << 20}, "autocast": None}
    return {r.key: r.snippet for r in catalogue(Peak(moment, dict.fromkeys(CATEGORIES, 0), 0.0),
                                                Context(facts))}


@pytest.mark.parametrize(("loop", "accumulate", "autocast", "pure"), [
    ("lightning", "accumulate_grad_batches=4", 'precision="bf16-mixed"',
     'precision="bf16-true"'),
    ("fabric", "fabric.no_backward_sync(model, enabled=accumulating)",
     'fabric = L.Fabric(..., precision="bf16-mixed")',
     'fabric = L.Fabric(..., precision="bf16-true")'),
    ("accelerate", "Accelerator(..., gradient_accumulation_steps=4)",
     'Accelerator(..., mixed_precision="bf16")', "model.to(torch.bfloat16)"),
    ("transformers", "gradient_accumulation_steps=4", "bf16=True", "model.to(torch.bfloat16)"),
    (None, "% 4 == 0", 'torch.autocast("cuda"', "model.to(torch.bfloat16)"),
])
def test_each_loop_gets_its_own_switches(loop: str | None, accumulate: str, autocast: str,
                                         pure: str) -> None:
    snippets = _remedies(loop)
    assert accumulate in snippets["micro_batch_4"]
    assert autocast in snippets["autocast"]
    assert pure in snippets["pure_bf16"]
    for snippet in snippets.values():
        compile(snippet, "<snippet>", "exec")


@pytest.mark.parametrize(("module", "switch"), [
    ("transformers.models.llama.modeling_llama", "model.gradient_checkpointing_enable("),
    ("diffusers.models.unets.unet_2d_blocks", "model.enable_gradient_checkpointing()"),
    ("my_model", "x = checkpoint(block, x, use_reentrant=False)"),
])
def test_a_library_model_checkpoints_by_its_own_switch(module: str, switch: str) -> None:
    """A model whose blocks are a library's classes gets that library's switch, and no
    hand-made segments; a model of the script's own gets both by hand."""
    moment = {**dict.fromkeys(CATEGORIES, 0), ACTIVATIONS: 100 << 20}
    # inputs half of what the blocks save: keeping 4 of them beats keeping all 16
    saved = {"inside_bytes": 64 << 20, "kept_inputs_bytes": 32 << 20,
             "largest_call_bytes": 4 << 20, "forward_bytes": 100 << 20}
    facts = {"dtypes": {"float32": 1 << 20}, "autocast": None, "repeated_blocks": [
        {"class": "Block", "module": module, "count": 16, "saved": saved,
         "call": {"args": ["x"], "kwargs": []}}]}
    peak, ctx = Peak(moment, dict.fromkeys(CATEGORIES, 0), 0.0), Context(facts)
    snippets = {r.key: r.snippet for r in catalogue(peak, ctx)}
    assert switch in snippets["checkpoint_blocks"]
    compile(snippets["checkpoint_blocks"], "<snippet>", "exec")
    assert ("checkpoint_sqrt" in snippets) == (module == "my_model")


def test_a_frozen_pretrained_transformers_model_is_offered_qlora() -> None:
    """LoRA on a bf16 model from_pretrained loaded: its frozen weights in 4-bit NF4 take
    half a byte and the double-quantised scales (an 8-bit scale per 64 weights, an fp32
    scale per 256 scales) instead of 2 bytes; the adapters stay as they are."""
    params, trainable = 1_000_000, 10_000
    weights = 2 * params
    moment = {**dict.fromkeys(CATEGORIES, 0), PARAMETERS: weights, ACTIVATIONS: 100 << 20}
    facts = {"parameters": params, "trainable": trainable, "parameter_bytes": weights,
             "dtypes": {"bfloat16": params}, "autocast": None, "pretrained": True,
             "repeated_blocks": [{"class": "LlamaDecoderLayer", "count": 4,
                                  "module": "transformers.models.llama.modeling_llama"}]}
    peak = Peak(moment, dict.fromkeys(CATEGORIES, 0), 0.0)
    found = {r.key: r for r in catalogue(peak, Context(facts))}
    qlora = found["qlora"]
    per_weight = 0.5 + 1 / 64 + 4 / (64 * 256)
    assert qlora.change(peak).moment[PARAMETERS] == pytest.approx(
        2 * trainable + per_weight * (params - trainable))
    assert "load_in_4bit=True" in qlora.snippet and "prepare_model_for_kbit_training" in \
        qlora.snippet
    compile(qlora.snippet, "<snippet>", "exec")
    # already 4-bit (bitsandbytes keeps the packed weights as uint8), or a model of its own
    for other in ({"dtypes": {"uint8": params, "bfloat16": trainable}},
                  {"repeated_blocks": [{"class": "Block", "count": 4, "module": "mine"}]}):
        assert "qlora" not in {r.key for r in catalogue(peak, Context({**facts, **other}))}


@pytest.mark.parametrize(("loop", "switch"), [
    ("transformers", "TrainingArguments(..., deepspeed="),
    ("lightning", 'strategy="deepspeed_stage_2_offload"'),
    ("fabric", 'fabric = L.Fabric(..., strategy="deepspeed_stage_2_offload")'),
    ("accelerate", 'DeepSpeedPlugin(\n    zero_stage=2, offload_optimizer_device="cpu")'),
    (None, "deepspeed.initialize("),
])
def test_optimizer_offload_is_configured_in_the_loops_library(loop: str | None,
                                                             switch: str) -> None:
    moment = {**dict.fromkeys(CATEGORIES, 0), OPTIMIZER_STATE: 8 << 20, ACTIVATIONS: 1 << 20}
    facts = {"trainer": loop, "dtypes": {"float32": 1 << 20}, "autocast": None}
    found = {r.key: r for r in catalogue(Peak(moment, dict.fromkeys(CATEGORIES, 0), 0.0),
                                         Context(facts))}
    assert switch in found["offload_optimizer"].snippet
    compile(found["offload_optimizer"].snippet, "<snippet>", "exec")


@pytest.mark.parametrize("loop", ["transformers", "lightning", "accelerate", None])
def test_a_zero_3_run_is_offered_offload_at_its_own_stage(loop: str | None) -> None:
    moment = {**dict.fromkeys(CATEGORIES, 0), OPTIMIZER_STATE: 8 << 20, ACTIVATIONS: 1 << 20}
    facts = {"trainer": loop, "dtypes": {"float32": 1 << 20}, "autocast": None,
             "parallelism": {"strategies": ["deepspeed:zero3"], "meshes": []}}
    found = {r.key: r for r in catalogue(Peak(moment, dict.fromkeys(CATEGORIES, 0), 0.0),
                                         Context(facts, world_size=2))}
    snippet = found["offload_optimizer"].snippet
    assert ("stage_3" if loop == "lightning" else "3") in snippet and "2" not in snippet
    compile(snippet, "<snippet>", "exec")


def test_a_deepspeed_run_is_not_offered_pure_bf16() -> None:
    """DeepSpeed keeps fp32 master weights and optimizer state in bf16 too: halving them is
    no model of it; autocast's halved forward is."""
    moment = {**dict.fromkeys(CATEGORIES, 0), OPTIMIZER_STATE: 8 << 20, ACTIVATIONS: 8 << 20}
    facts = {"trainer": "transformers", "dtypes": {"float32": 1 << 20}, "autocast": None,
             "parallelism": {"strategies": ["deepspeed:zero3"], "meshes": []}}
    keys = {r.key for r in catalogue(Peak(moment, dict.fromkeys(CATEGORIES, 0), 0.0),
                                     Context(facts, world_size=2))}
    assert "autocast" in keys and "pure_bf16" not in keys


def test_int8_weights_are_offered_for_frozen_fp32_weights_only() -> None:
    """A QLoRA model (4-bit weights packed as uint8, fp32 adapters and embedding) is not
    offered INT8 weights; a bf16 model with fp32 adapters neither (nothing frozen is fp32);
    a frozen fp32 model of 1M weights with 10k trainable saves 3 bytes of each frozen."""
    params, trainable = 1_000_000, 10_000
    moment = {**dict.fromkeys(CATEGORIES, 0), PARAMETERS: 4 * params, ACTIVATIONS: 1 << 20}
    peak = Peak(moment, dict.fromkeys(CATEGORIES, 0), 0.0)

    def offered(dtypes: dict[str, int], parameter_bytes: int) -> dict[str, object]:
        facts = {"parameters": params, "trainable": trainable, "dtypes": dtypes,
                 "parameter_bytes": parameter_bytes, "autocast": None}
        return {r.key: r for r in catalogue(peak, Context(facts))}

    assert "int8_frozen" not in offered({"uint8": params // 2, "float32": trainable}, params)
    assert "int8_frozen" not in offered({"bfloat16": params - trainable, "float32": trainable},
                                        2 * params)
    int8 = offered({"float32": params}, 4 * params)["int8_frozen"]
    assert int8.change(peak).moment[PARAMETERS] == pytest.approx(  # type: ignore[attr-defined]
        4 * trainable + (params - trainable), abs=1)


def test_an_fsdp_run_offloads_with_fsdps_switch_not_deepspeeds() -> None:
    moment = {**dict.fromkeys(CATEGORIES, 0), PARAMETERS: 4 << 20, OPTIMIZER_STATE: 8 << 20,
              ACTIVATIONS: 1 << 20}
    facts = {"trainer": "lightning", "dtypes": {"float32": 1 << 20}, "autocast": None,
             "parallelism": {"strategies": ["fsdp1:full_shard"], "meshes": []}}
    found = {r.key: r for r in catalogue(Peak(moment, moment, 0.0), Context(facts, world_size=2))}
    assert "offload_optimizer" not in found
    assert "FSDPStrategy(..., cpu_offload=True)" in found["fsdp_offload"].snippet



def test_fsdp1_hybrid_shard_is_offered_fsdp_over_every_rank() -> None:
    """HYBRID_SHARD over 2 replicas of 2 ranks: FULL_SHARD over all 4 splits the model
    state 4 ways instead of 2, in FSDP1's own terms."""
    moment = {**dict.fromkeys(CATEGORIES, 0), PARAMETERS: 4 << 20, OPTIMIZER_STATE: 8 << 20,
              ACTIVATIONS: 1 << 20}
    facts = {"dtypes": {"float32": 1 << 20}, "autocast": None, "parallelism": {
        "strategies": ["fsdp1:hybrid_shard"],
        "meshes": [{"shape": [2, 2], "dims": [], "placements": ["Replicate()", "Shard(dim=0)"]}]}}
    peak = Peak(moment, moment, 0.0)
    flat = {r.key: r for r in catalogue(peak, Context(facts, world_size=4))}["fsdp_flat_mesh"]
    assert flat.title == "FSDP over all 4 GPUs instead of HSDP (2 replicas of 2)"
    assert flat.change(peak).at_step[OPTIMIZER_STATE] == (8 << 20) // 2
    assert "ShardingStrategy.FULL_SHARD" in flat.snippet and flat.verify == {"flat_mesh": True}
    compile(flat.snippet, "<snippet>", "exec")


@pytest.mark.parametrize(("stage", "overlap", "buffers"), [(2, True, 2), (2, False, 1),
                                                           (3, True, 1)])
def test_deepspeeds_reduce_buckets_are_offered_smaller(stage: int, overlap: bool,
                                                       buffers: int) -> None:
    """Lightning's DeepSpeed default (2e8-element buckets, overlap_comm) over a bf16 model:
    ZeRO-2 holds two buckets (the gradients' and a communication buffer), ZeRO-3 one; each
    shrinks to 5e7 elements of 2 bytes. The engine's config is read from the engine."""
    import torch

    from memprof.collect.hooks.parallelism import parallelism

    class DeepSpeedEngine(torch.nn.Module):  # the engine's own methods, as DeepSpeed's
        def zero_optimization_stage(self) -> int:
            return stage

        def zero_reduce_bucket_size(self) -> int:
            return 200_000_000

        def zero_overlap_comm(self) -> bool:
            return overlap

    facts = parallelism([DeepSpeedEngine()])
    assert facts == {"strategies": [f"deepspeed:zero{stage}"], "meshes": [], "deepspeed": {
        "reduce_bucket_size": 200_000_000, "overlap_comm": overlap}}
    bucket = 200_000_000 * 2
    moment = {**dict.fromkeys(CATEGORIES, 0), PARAMETERS: 8 << 20, ACTIVATIONS: 1 << 20,
              "gradients": bucket + (4 << 20), "communication": bucket if buffers == 2 else 0}
    peak = Peak(moment, moment, 0.0)
    context = Context({"trainer": "lightning", "dtypes": {"bfloat16": 1 << 22},
                       "autocast": None, "parallelism": facts}, world_size=2)
    remedy = {r.key: r for r in catalogue(peak, context)}["zero_buckets"]
    saved = (200_000_000 - 50_000_000) * 2
    assert remedy.change(peak).moment == {**moment, "gradients": moment["gradients"] - saved,
                                          "communication": moment["communication"]
                                          - saved * (buffers == 2)}
    assert f"DeepSpeedStrategy(stage={stage}, reduce_bucket_size=50_000_000" in remedy.snippet
    compile(remedy.snippet, "<snippet>", "exec")
    # buckets already small, or bytes the categories do not hold: not offered
    small = {**facts, "deepspeed": {"reduce_bucket_size": 50_000_000, "overlap_comm": overlap}}
    other = Context({**context.model, "parallelism": small}, world_size=2)
    assert "zero_buckets" not in {r.key for r in catalogue(peak, other)}
    empty = Peak({**moment, "gradients": 0}, {**moment, "gradients": 0}, 0.0)
    assert "zero_buckets" not in {r.key for r in catalogue(empty, context)}


def test_lightning_gets_its_optimizers_in_configure_optimizers() -> None:
    moment = {**dict.fromkeys(CATEGORIES, 0), OPTIMIZER_STATE: 8 << 20, ACTIVATIONS: 1 << 20}
    facts = {"trainer": "lightning", "dtypes": {"float32": 1 << 20}, "autocast": None,
             "optimizers": [{"class": "AdamW"}], "trainable_numels": [1 << 20]}
    found = {r.key: r for r in catalogue(Peak(moment, dict.fromkeys(CATEGORIES, 0), 0.0),
                                         Context(facts))}
    for key in ("optimizer_8bit", "optimizer_sgd", "optimizer_adafactor"):
        snippet = found[key].snippet
        assert "def configure_optimizers(self):" in snippet and "self.parameters()" in snippet
        assert "model.parameters()" not in snippet
        compile(snippet, "<snippet>", "exec")
