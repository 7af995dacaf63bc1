"""The remedies ``memprof suggest`` knows: what each changes at the peak, what it costs,
where it is described (the seed documents in ``../shared/seeds``), and the code change.

Each savings model rescales the measured categories of this run (``peak.py``), so a
remedy saves only bytes that are alive at the peak. A remedy that cannot apply to the run
(no optimizer state to shrink, activations a sliver of the peak, one GPU for sharding) is
not offered at all.
"""

from __future__ import annotations

from dataclasses import replace

from memprof.advise.checkpointing import checkpoint_remedies
from memprof.advise.forward_remedies import forward_remedies
from memprof.advise.optimizer_step import step_remedies
from memprof.advise.peak import Peak
from memprof.advise.pipeline import pipeline_remedies
from memprof.advise.precision import precision_remedies
from memprof.advise.remedy import SEEDS, Context, Remedy
from memprof.advise.sharding import sharding_remedies
from memprof.advise.zero_buckets import bucket_remedies
from memprof.analysis.blocks import MIN_BLOCK
from memprof.collect.hooks.model_facts import SMALL_TENSOR
from memprof.trace.model import (
    ACTIVATIONS,
    GRADIENTS,
    OPTIMIZER_STATE,
    OTHER,
    PARAMETERS,
    TEMPORARIES,
)

MICRO_BATCHES = (2, 4, 8, 16)
# bytes a weight in bitsandbytes' NF4 with double quantisation: 4 bits, a block of 64 weights'
# 8-bit scale, and a block of 256 scales' fp32 scale
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


def catalogue(peak: Peak, ctx: Context) -> list[Remedy]:
    """The remedies that apply to this run."""
    found = precision_remedies(peak, ctx) + checkpoint_remedies(peak, ctx)
    if peak.busy and not ctx.pipeline:  # a schedule's microbatches are not the script's
        found += _micro_batches(ctx)
    found += _optimizer_state(peak, ctx) + step_remedies(peak, ctx) + sharding_remedies(peak, ctx)
    found += pipeline_remedies(peak, ctx) + bucket_remedies(peak, ctx)
    found += _model_state(peak, ctx)
    found += _allocator(peak, ctx) + _hygiene(peak, ctx)
    return found + forward_remedies(peak, ctx)


def _micro_batches(ctx: Context) -> list[Remedy]:
    """Micro-batches 1/k of the batch now, and k times the run's accumulation steps."""
    def snippet(k: int, steps: int) -> str:
        if ctx.trainer:
            return ("# the Trainer accumulates gradients itself; batch: the batch size now\n"
                    f"TrainingArguments(..., per_device_train_batch_size=batch // {k},\n"
                    f"                  gradient_accumulation_steps={steps})")
        if ctx.loop == "lightning":
            return (f"# the DataLoader's batch_size: 1/{k} of the batch now\n"
                    f"trainer = L.Trainer(..., accumulate_grad_batches={steps})")
        if ctx.loop == "fabric":
            return (f"for i, batch in enumerate(loader):  # batches 1/{k} as large\n"
                    f"    accumulating = (i + 1) % {steps} != 0\n"
                    "    with fabric.no_backward_sync(model, enabled=accumulating):\n"
                    f"        fabric.backward(compute_loss(model, batch) / {steps})\n"
                    "    if not accumulating:\n"
                    "        optimizer.step()\n"
                    "        optimizer.zero_grad(set_to_none=True)")
        if ctx.loop == "accelerate":
            return (f"accelerator = Accelerator(..., gradient_accumulation_steps={steps})"
                    f"  # batches 1/{k} as large\n"
                    "for batch in loader:\n"
                    "    with accelerator.accumulate(model):\n"
                    "        accelerator.backward(compute_loss(model, batch))\n"
                    "        optimizer.step()\n"
                    "        optimizer.zero_grad(set_to_none=True)")
        return (f"for i, batch in enumerate(loader):  # batches 1/{k} as large\n"
                f"    loss = compute_loss(model, batch) / {steps}\n"
                "    loss.backward()\n"
                f"    if (i + 1) % {steps} == 0:\n"
                "        optimizer.step()\n"
                "        optimizer.zero_grad(set_to_none=True)")

    now = ctx.accumulation
    return [Remedy(
        f"micro_batch_{k}", f"micro-batch 1/{k} with {k * now} accumulation steps", "batch",
        3 + k // 2, f"time: {k} times the forward/backward passes per optimizer step; same"
        " effective batch", SEEDS["003"],
        f"activations and temporaries scale with the batch: 1/{k} of them remain"
        + (f"; the run accumulates {now} already" if now > 1 else ""),
        lambda p, k=k: p.scaled({ACTIVATIONS: 1 / k, TEMPORARIES: 1 / k}, step_too=False),
        snippet(k, k * now), {"micro_batch": k}) for k in MICRO_BATCHES]


def _optimizer_state(peak: Peak, ctx: Context) -> list[Remedy]:
    opt = ctx.optimizer
    state = max(peak.at_step[OPTIMIZER_STATE], peak.at_peak[OPTIMIZER_STATE])
    if not state:
        return []
    name = opt.get("class", "the optimizer")
    found = []
    numels = ctx.model.get("trainable_numels") or []
    if name in ("Adam", "AdamW") and numels:
        large = [n for n in numels if n >= SMALL_TENSOR]
        # two fp32 moments become two uint8 ones and their fp32 absmax per 256 values
        change = sum(2 * (_block(n) + _block(4 * -(-n // 256)) - _block(4 * n)) for n in large)
        small = sum(n for n in numels if n < SMALL_TENSOR)
        found.append(Remedy(
            "optimizer_8bit", f"8-bit {name} (bitsandbytes)", "optimizer", 6,
            "numerics: block-wise quantised moments (matches 32-bit Adam in its paper);"
            " a dependency", SEEDS["003"],
            f"moments take 2 bytes per parameter (and an fp32 scale per 256) instead of 8;"
            f" tensors under 4,096 elements ({small:,} parameters here) keep 32-bit state",
            lambda p: p.with_state(OPTIMIZER_STATE, change),
            _optim(ctx, "adamw_bnb_8bit",
                   f"import bitsandbytes as bnb\n\noptimizer = bnb.optim.{name}8bit("
                   "model.parameters(), lr=lr)")))
        found.append(Remedy(
            "optimizer_sgd", f"SGD with momentum instead of {name}", "optimizer", 9,
            "training: another optimizer, retune the learning rate", SEEDS["003"],
            "one momentum buffer (4 bytes per parameter) instead of two moments (8)",
            lambda p: p.scaled({OPTIMIZER_STATE: 0.5}),
            _optim(ctx, "sgd", "optimizer = torch.optim.SGD(model.parameters(), lr=lr,"
                   " momentum=0.9)")))
        found.append(Remedy(
            "optimizer_adafactor", f"Adafactor instead of {name}", "optimizer", 8,
            "training: another optimizer (factored second moments, no first moment)",
            SEEDS["003"], "a row and a column vector per matrix: about 1% of Adam's state",
            lambda p: p.scaled({OPTIMIZER_STATE: 0.01}),
            _optim(ctx, "adafactor", "optimizer = torch.optim.Adafactor(model.parameters(),"
                   " lr=lr)")))
    strategies = (ctx.model.get("parallelism") or {}).get("strategies") or ()
    if any(s.startswith("fsdp") for s in strategies):
        return found  # FSDP offloads with its own switch (sharding.py), not DeepSpeed's
    found.append(Remedy(
        "offload_optimizer", "optimizer state offloaded to CPU memory", "optimizer", 10,
        "time: the step runs on the CPU or streams state over PCIe; host RAM for the state",
        SEEDS["000"], "no optimizer state stays on the GPU",
        lambda p: p.scaled({OPTIMIZER_STATE: 0.0}), _offload_snippet(ctx)))
    return found


def _offload_snippet(ctx: Context) -> str:
    """ZeRO-Offload of the optimizer state, in the switches of the loop's library, at the
    run's own ZeRO stage where it has one above 2."""
    stage = max(2, ctx.zero_stage)
    if ctx.trainer:
        return ('TrainingArguments(..., deepspeed={"zero_optimization": {\n'
                f'    "stage": {stage}, "offload_optimizer": {{"device": "cpu"}}}}}})'
                "  # deepspeed installed")
    if ctx.lightning:
        return f'{ctx.lightning[0]}..., strategy="deepspeed_stage_{stage}_offload")'
    if ctx.loop == "accelerate":
        return ("from accelerate import Accelerator, DeepSpeedPlugin\n\n"
                "accelerator = Accelerator(..., deepspeed_plugin=DeepSpeedPlugin(\n"
                f'    zero_stage={stage}, offload_optimizer_device="cpu"))')
    return (f'ds_config = {{"zero_optimization": {{"stage": {stage},\n'
            '                                   "offload_optimizer": {"device": "cpu"}}}\n'
            "engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,"
            "\n                                               config=ds_config)")


def _optim(ctx: Context, trainer_name: str, snippet: str) -> str:
    """An optimizer's snippet (``optimizer = ...`` after its imports): the Trainer's
    ``optim`` name where it steps the optimizer, Lightning's ``configure_optimizers``."""
    if ctx.trainer:
        return f'TrainingArguments(..., optim="{trainer_name}")'
    if ctx.loop == "lightning":
        *imports, made = snippet.split("\n")
        made = made.removeprefix("optimizer = ").replace("model.parameters()", "self.parameters()")
        return "\n".join([*imports, "def configure_optimizers(self):  # your LightningModule's",
                          f"    return {made}"]).lstrip("\n")
    return snippet


def _block(size: int) -> int:
    """The caching allocator's block for a request of ``size`` bytes (default settings)."""
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def _model_state(peak: Peak, ctx: Context) -> list[Remedy]:
    params = ctx.model.get("parameters", 0)
    trainable = ctx.model.get("trainable", params)
    found = []
    loaded = ctx.model.get("loaded_state_dict") or ctx.model.get("pretrained")
    if params and trainable == params and peak.at_step[GRADIENTS] and loaded:
        found.append(Remedy(  # fine-tuning weights it loaded: not a model trained from scratch
            "lora", "LoRA adapters on a frozen model", "finetune", 12,
            "training: fine-tunes low-rank adapters only (a different model update)",
            SEEDS["004"], "adapters hold about 1% of the parameters: gradients and optimizer"
            " state shrink to 1%", lambda p: p.scaled({GRADIENTS: 0.01, OPTIMIZER_STATE: 0.01}),
            "from peft import LoraConfig, get_peft_model\n\n"
            "# adapters on every linear layer but the output (peft also takes names)\n"
            'model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))'))
    dtypes = ctx.model.get("dtypes") or {}
    # the frozen fp32 weights, at least (the trainable ones taken to be fp32, as adapters
    # on a half-precision model are): a model quantised already (QLoRA's NF4) is left
    frozen_fp32 = max(0, min(dtypes.get("float32", 0), params) - trainable)
    if params and frozen_fp32 and not {"uint8", "int8"} & set(dtypes):
        share = 4 * frozen_fp32 / ctx.model.get("parameter_bytes", 4 * params)
        found.append(Remedy(
            "int8_frozen", "INT8 weights for the frozen parameters", "quantise", 12,
            "numerics: weight-only quantisation of frozen layers", SEEDS["004"],
            f"frozen fp32 weights ({share:.0%} of the parameters' bytes: the fp32 ones but as"
            " many as train) take 1 byte instead of 4",
            lambda p: p.scaled({PARAMETERS: 1 - 0.75 * share}),
            "from torchao.quantization import int8_weight_only, quantize_\n\n"
            "quantize_(frozen_part, int8_weight_only())"))
    if params and trainable < params and ctx.transformers and ctx.model.get("pretrained") \
            and not {"uint8", "int8"} & set(ctx.model.get("dtypes") or {}):
        per_weight = ctx.model.get("parameter_bytes", 4 * params) / params
        frozen = (params - trainable) / params  # of the weights' bytes, at ``per_weight`` each
        kept = 1 - frozen * (1 - NF4_BYTES / per_weight)
        found.append(Remedy(
            "qlora", "4-bit NF4 weights for the frozen model (QLoRA)", "quantise", 12,
            "numerics: 4-bit frozen weights, dequantised in each forward (QLoRA's paper: the"
            " quality of 16-bit LoRA)", SEEDS["004"],
            f"the frozen weights ({frozen:.0%} of the parameters' bytes, all taken to be linear"
            f" layers') take {NF4_BYTES:.3f} bytes a weight instead of {per_weight:g}: 4 bits"
            " and the double-quantised scale of each 64",
            lambda p: p.scaled({PARAMETERS: kept}),
            "from peft import prepare_model_for_kbit_training\n"
            "from transformers import BitsAndBytesConfig\n\n"
            "model = AutoModelForCausalLM.from_pretrained(  # your model class and name\n"
            "    name, quantization_config=BitsAndBytesConfig(\n"
            '        load_in_4bit=True, bnb_4bit_quant_type="nf4",\n'
            "        bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16))\n"
            "model = prepare_model_for_kbit_training(model)  # then get_peft_model, as now"))
    return found


def _hygiene(peak: Peak, ctx: Context) -> list[Remedy]:
    """Fixes that cost nothing: a leak."""
    found = []
    leak = ctx.leak
    if leak and leak.get("growth_per_step_bytes"):
        grown = leak["growth_per_step_bytes"] * max(1, int(leak.get("steps") or 1) - 1)
        site = (leak.get("site") or {}).get("site", "the site that grew")
        found.append(Remedy(
            "fix_leak", f"fix the leak at {site}", "leak", 1, "none: a bug fix", SEEDS["003"],
            f"the {grown:,} bytes it grew over the run are not held at the peak",
            lambda p: p.with_state(OTHER, -grown),
            "total_loss += loss.item()  # a float, not the tensor: a tensor keeps its graph"))
    return found


def _allocator(peak: Peak, ctx: Context) -> list[Remedy]:
    ratio = ctx.expandable_ratio
    if ratio is None or ratio >= peak.cache_ratio:
        return []
    return [Remedy(
        "expandable_segments", "allocator: expandable_segments:True", "allocator", 1,
        "none (PyTorch's allocator setting)", SEEDS["003"],
        "the cache is what memprof's allocator replay of this run gives with expandable"
        " segments, kept in proportion as the peak moves",
        lambda p: replace(p, cache_ratio=ratio),
        'import os\n\nos.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"'
        "  # before the first CUDA call",
        {"alloc_conf": "expandable_segments:True"})]
