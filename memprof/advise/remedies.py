"""The remedies ``memprof suggest`` knows: what each changes at the peak, what it costs,
where it is described (the seed documents in ``../shared/seeds``), and the code change.

Each savings model rescales the measured categories of this run (``peak.py``), so a
remedy saves only bytes that are alive at the peak. A remedy that cannot apply to the run
(no optimizer state to shrink, activations a sliver of the peak, one GPU for sharding) is
not offered at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from memprof.advise.peak import Peak
from memprof.analysis.blocks import MIN_BLOCK
from memprof.collect.hooks.model_facts import SMALL_TENSOR
from memprof.trace.model import (
    ACTIVATIONS,
    BUFFERS,
    GRADIENTS,
    LOSS_LOGITS,
    OPTIMIZER_STATE,
    OTHER,
    PARAMETERS,
    TEMPORARIES,
)

SEEDS = {
    "000": "seed 000 (system memory standing in for GPU memory: ZeRO, offload, accumulation)",
    "001": "seed 001 (memory bandwidth: mixed precision, checkpointing, no_grad, ZeRO)",
    "003": "seed 003 (out-of-memory causes and fixes: precision, accumulation, checkpointing,"
           " 8-bit optimizers, offload)",
    "004": "seed 004 (large-model training: mixed precision, INT8, checkpointing, ZeRO)",
    "003_attention": "seed 003 (out-of-memory causes: self-attention memory grows with the"
                     " square of the sequence length)",
    "003_stages": "seed 003 (memory grows in stages: the graph in forward, gradients in"
                  " backward, the optimizer's temporaries)",
    "loss": "not a seed: a language model's cross-entropy keeps fp32 log-probabilities of"
            " every token over the whole vocabulary (Liger Kernel's fused linear"
            " cross-entropy, chunked losses)",
}
MICRO_BATCHES = (2, 4, 8, 16)
# libraries whose models switch checkpointing on themselves, by their modules' prefix
MODEL_LIBRARIES = ("transformers", "diffusers")
# bytes a weight in bitsandbytes' NF4 with double quantisation: 4 bits, a block of 64 weights'
# 8-bit scale, and a block of 256 scales' fp32 scale
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


@dataclass(frozen=True)
class Context:
    """What a savings model may use: the run's model facts, the GPUs, the allocator's
    what-if for expandable segments."""

    model: dict[str, Any]
    gpus: int = 1
    world_size: int = 1
    expandable_ratio: float | None = None  # cache per allocated byte with expandable segments
    leak: dict[str, Any] | None = None  # the report's leak verdict
    # of the activations and temporaries at the recorded peak, the share that the repeated
    # blocks' modules held (memprof run's attribution); None: unknown, taken as all
    block_shares: dict[str, float] | None = None

    @property
    def optimizer(self) -> dict[str, Any]:
        optimizers = self.model.get("optimizers") or [{}]
        return optimizers[0]

    @property
    def quantised_state(self) -> bool:
        """Whether the optimizer keeps 8- or 4-bit state (bitsandbytes' ``AdamW8bit``,
        ``PagedAdam8bit``, torchao's ``AdamW4bit``): its size does not follow the weights'."""
        name = str(self.optimizer.get("class", ""))
        return "8bit" in name or "4bit" in name

    @property
    def block(self) -> dict[str, Any] | None:
        blocks = self.model.get("repeated_blocks") or []
        return blocks[0] if blocks else None

    @property
    def trainer(self) -> bool:
        """Whether the Hugging Face Trainer stepped the optimizer: its snippets are
        ``TrainingArguments``."""
        return self.model.get("trainer") == "transformers"

    @property
    def loop(self) -> str | None:
        """The library whose loop stepped the optimizer ("transformers", "lightning",
        "accelerate"), for snippets in its own switches; None: the script's own loop."""
        loop = self.model.get("trainer")
        return loop if isinstance(loop, str) else None

    @property
    def model_library(self) -> str | None:
        """The library whose classes the model's blocks are ("transformers", "diffusers"),
        whose snippets use its own switches; None: a model of the script's own."""
        module = str((self.block or {}).get("module", ""))
        return next((library for library in MODEL_LIBRARIES
                     if module.startswith(f"{library}.")), None)

    @property
    def transformers(self) -> bool:
        """Whether the model is a Hugging Face transformers model."""
        return self.model_library == "transformers"


@dataclass(frozen=True)
class Remedy:
    """One remedy, its savings model applied through ``change``."""

    key: str
    title: str
    group: str  # at most one remedy of a group in a plan
    cost: int  # the planner's price: lower is cheaper to adopt
    cost_text: str
    seed: str
    assumptions: str
    change: Callable[[Peak], Peak]
    snippet: str
    verify: dict[str, Any] = field(default_factory=dict)  # how --verify applies it


def catalogue(peak: Peak, ctx: Context) -> list[Remedy]:
    """The remedies that apply to this run."""
    found: list[Remedy] = []
    moment = peak.moment
    active = moment[ACTIVATIONS] + moment[TEMPORARIES]
    busy = active >= 0.05 * peak.allocated
    found += _precision(ctx, busy)
    if busy:
        found += _micro_batches(ctx)
    found += _optimizer_state(peak, ctx) + _sharding(peak, ctx) + _model_state(peak, ctx)
    found += _allocator(peak, ctx) + _hygiene(peak, ctx)
    return found


def _precision(ctx: Context, busy: bool) -> list[Remedy]:
    dtypes = ctx.model.get("dtypes") or {"float32": 1}
    if dtypes.get("float64"):
        return _single(dtypes["float64"] / sum(dtypes.values()))
    if set(dtypes) != {"float32"}:
        return []
    amp = bool(ctx.model.get("autocast"))
    quantised = ctx.quantised_state  # its moments are 8- or 4-bit: bf16 weights leave them
    pure = Remedy(
        "pure_bf16", "bf16 weights, gradients" + ("" if quantised else " and optimizer state"),
        "precision", 9,
        "numerics: bf16 weight updates lose small steps (keep fp32 master weights, or use"
        " Kahan summation, where that matters)", SEEDS["004"],
        "parameters, floating-point buffers and gradients halve"
        + (f"; the {ctx.optimizer.get('class')}'s quantised state stays as it is" if quantised
           else ", and so does the optimizer state")
        + ("" if amp else "; activations and temporaries halve too"),
        lambda p: p.scaled({PARAMETERS: 0.5, BUFFERS: 0.5, GRADIENTS: 0.5,
                            OPTIMIZER_STATE: 1.0 if quantised else 0.5,
                            **({} if amp else {ACTIVATIONS: 0.5, TEMPORARIES: 0.5})}),
        'trainer = L.Trainer(..., precision="bf16-true")' if ctx.loop == "lightning" else
        "model = model.to(torch.bfloat16)  # before the optimizer is built")
    if amp or not busy:
        return [pure]

    def autocast(p: Peak) -> Peak:
        # a cross-entropy's log-probabilities stay fp32 (log_softmax is on autocast's fp32
        # list); bf16 copies of the weights are saved for backward: half the fp32 weights
        fp32 = p.tags_at_peak.get(LOSS_LOGITS, 0)
        halved = p.scaled({ACTIVATIONS: 0.5, TEMPORARIES: 0.5}, step_too=False)
        return replace(halved, at_peak={**halved.at_peak, ACTIVATIONS: halved.at_peak[
            ACTIVATIONS] + fp32 - fp32 // 2 + p.at_peak[PARAMETERS] // 2},
            tags_at_peak={**halved.tags_at_peak, **({LOSS_LOGITS: fp32} if fp32 else {})})

    return [Remedy(
        "autocast", "bf16 autocast (mixed precision)", "precision", 3,
        "numerics: bf16 matmuls (fp32 where CUDA's autocast lists keep it); faster on tensor"
        " cores", SEEDS["004"],
        "activations and temporaries halve (matmul inputs and outputs in bf16) but a"
        " cross-entropy's log-probabilities, which stay fp32; norms, softmax and what the"
        " residual stream keeps in fp32 stay fp32 too, so this is the best case; the bf16"
        " weight copies saved for backward add half the fp32 weights",
        autocast,
        "TrainingArguments(..., bf16=True)  # the Trainer's forward under bf16 autocast"
        if ctx.trainer else
        'trainer = L.Trainer(..., precision="bf16-mixed")' if ctx.loop == "lightning" else
        'accelerator = Accelerator(mixed_precision="bf16")  # prepare() wraps the forward'
        if ctx.loop == "accelerate" else
        'with torch.autocast("cuda", dtype=torch.bfloat16):\n'
        "    loss = compute_loss(model, batch)  # the forward pass and the loss only\n"
        "loss.backward()",
        {"autocast": "bfloat16"}), pure]


def _single(share: float) -> list[Remedy]:
    """float32 for a model in float64 (``share`` of its parameters)."""
    kept = 1 - share / 2
    return [Remedy(
        "float32", "float32 instead of float64", "precision", 2,
        "numerics: float32's 7 significant digits, as nearly all training uses", SEEDS["004"],
        f"the float64 parameters ({share:.0%} of them), their gradients and optimizer state"
        " halve, and so do the activations and temporaries in that share",
        lambda p: p.scaled({k: kept for k in (PARAMETERS, BUFFERS, GRADIENTS, OPTIMIZER_STATE,
                                              ACTIVATIONS, TEMPORARIES)}),
        "model = model.float()  # or never .double(); and float32 inputs:\n"
        "torch.set_default_dtype(torch.float32)")]


def _micro_batches(ctx: Context) -> list[Remedy]:
    def snippet(k: int) -> str:
        if ctx.trainer:
            return ("# the Trainer accumulates gradients itself; batch: the batch size now\n"
                    f"TrainingArguments(..., per_device_train_batch_size=batch // {k},\n"
                    f"                  gradient_accumulation_steps={k})")
        if ctx.loop == "lightning":
            return (f"# the DataLoader's batch_size: 1/{k} of the batch now\n"
                    f"trainer = L.Trainer(..., accumulate_grad_batches={k})")
        if ctx.loop == "accelerate":
            return (f"accelerator = Accelerator(gradient_accumulation_steps={k})  # batches"
                    f" 1/{k} as large\n"
                    "for batch in loader:\n"
                    "    with accelerator.accumulate(model):\n"
                    "        accelerator.backward(compute_loss(model, batch))\n"
                    "        optimizer.step()\n"
                    "        optimizer.zero_grad(set_to_none=True)")
        return (f"for i, batch in enumerate(loader):  # batches 1/{k} as large\n"
                f"    loss = compute_loss(model, batch) / {k}\n"
                "    loss.backward()\n"
                f"    if (i + 1) % {k} == 0:\n"
                "        optimizer.step()\n"
                "        optimizer.zero_grad(set_to_none=True)")

    return [Remedy(
        f"micro_batch_{k}", f"micro-batch 1/{k} with {k} accumulation steps", "batch",
        3 + k // 2, f"time: {k} forward/backward passes per optimizer step; same effective"
        " batch", SEEDS["003"],
        f"activations and temporaries scale with the batch: 1/{k} of them remain",
        lambda p, k=k: p.scaled({ACTIVATIONS: 1 / k, TEMPORARIES: 1 / k}, step_too=False),
        snippet(k), {"micro_batch": k}) for k in MICRO_BATCHES]


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
            "optimizer_sgd", "SGD with momentum instead of Adam", "optimizer", 9,
            "training: another optimizer, retune the learning rate", SEEDS["003"],
            "one momentum buffer (4 bytes per parameter) instead of two moments (8)",
            lambda p: p.scaled({OPTIMIZER_STATE: 0.5}),
            _optim(ctx, "sgd", "optimizer = torch.optim.SGD(model.parameters(), lr=lr,"
                   " momentum=0.9)")))
        found.append(Remedy(
            "optimizer_adafactor", "Adafactor instead of Adam", "optimizer", 8,
            "training: another optimizer (factored second moments, no first moment)",
            SEEDS["003"], "a row and a column vector per matrix: about 1% of Adam's state",
            lambda p: p.scaled({OPTIMIZER_STATE: 0.01}),
            _optim(ctx, "adafactor", "optimizer = torch.optim.Adafactor(model.parameters(),"
                   " lr=lr)")))
    found.append(Remedy(
        "offload_optimizer", "optimizer state offloaded to CPU memory", "optimizer", 10,
        "time: the step runs on the CPU or streams state over PCIe; host RAM for the state",
        SEEDS["000"], "no optimizer state stays on the GPU",
        lambda p: p.scaled({OPTIMIZER_STATE: 0.0}), _offload_snippet(ctx)))
    return found


def _offload_snippet(ctx: Context) -> str:
    """ZeRO-Offload of the optimizer state, in the switches of the loop's library."""
    if ctx.trainer:
        return ('TrainingArguments(..., deepspeed={"zero_optimization": {\n'
                '    "stage": 2, "offload_optimizer": {"device": "cpu"}}})'
                "  # deepspeed installed")
    if ctx.loop == "lightning":
        return 'trainer = L.Trainer(..., strategy="deepspeed_stage_2_offload")'
    if ctx.loop == "accelerate":
        return ("from accelerate import Accelerator, DeepSpeedPlugin\n\n"
                "accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(\n"
                '    zero_stage=2, offload_optimizer_device="cpu"))')
    return ('ds_config = {"zero_optimization": {"stage": 2,\n'
            '                                   "offload_optimizer": {"device": "cpu"}}}\n'
            "engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,"
            "\n                                               config=ds_config)")


def _optim(ctx: Context, trainer_name: str, snippet: str) -> str:
    """An optimizer's snippet: the Trainer's ``optim`` name where it steps the optimizer."""
    if ctx.trainer:
        return f'TrainingArguments(..., optim="{trainer_name}")'
    return snippet


def _block(size: int) -> int:
    """The caching allocator's block for a request of ``size`` bytes (default settings)."""
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def _sharding(peak: Peak, ctx: Context) -> list[Remedy]:
    n = ctx.gpus
    if n < 2 or not peak.at_step[PARAMETERS]:
        return []
    stages = (
        (1, {OPTIMIZER_STATE: 1 / n}, "optimizer state"),
        (2, {OPTIMIZER_STATE: 1 / n, GRADIENTS: 1 / n}, "optimizer state and gradients"),
        (3, {OPTIMIZER_STATE: 1 / n, GRADIENTS: 1 / n, PARAMETERS: 1 / n},
         "optimizer state, gradients and parameters"))
    snippets = {
        1: "from torch.distributed.optim import ZeroRedundancyOptimizer\n\n"
           "optimizer = ZeroRedundancyOptimizer(model.parameters(),"
           " optimizer_class=torch.optim.AdamW, lr=lr)",
        2: 'ds_config = {"zero_optimization": {"stage": 2}}',
        3: "from torch.distributed.fsdp import fully_shard\n\n"
           "for module in model.modules():\n"
           f"    if type(module).__name__ == {(ctx.block or {}).get('class', 'Block')!r}:\n"
           "        fully_shard(module)\nfully_shard(model)"}
    return [Remedy(
        f"zero_{stage}", f"ZeRO-{stage}{' / FSDP' if stage == 3 else ''} over {n} GPUs",
        "sharding", 6 + stage, f"infrastructure: {n} GPUs and their communication",
        SEEDS["000"], f"{what} split {n} ways (ZeRO paper: per GPU"
        f" {['4P + 12P/N', '2P + 14P/N', '16P/N'][stage - 1]} bytes of mixed-precision Adam"
        " state); the parameters of the layer being computed, gathered, are not counted",
        lambda p, f=factors: p.scaled(f), snippets[stage])
        for stage, factors, what in stages]


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
    if params and trainable < params and ctx.model.get("dtypes", {}).get("float32"):
        frozen_share = (params - trainable) / params
        found.append(Remedy(
            "int8_frozen", "INT8 weights for the frozen parameters", "quantise", 12,
            "numerics: weight-only quantisation of frozen layers", SEEDS["004"],
            f"frozen fp32 weights ({frozen_share:.0%} of the parameters) take 1 byte instead"
            " of 4", lambda p: p.scaled({PARAMETERS: 1 - 0.75 * frozen_share}),
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
    """Fixes that cost nothing: a leak, DDP's gradient buckets."""
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
    if ctx.world_size > 1 and peak.at_step[GRADIENTS]:
        found.append(Remedy(
            "bucket_view", "DDP gradient_as_bucket_view=True", "ddp", 1,
            "none (gradients become views into DDP's buckets)", SEEDS["000"],
            "DDP's bucket copy of the gradients (as large as the gradients) is not held",
            lambda p: p.with_state(OTHER, -p.at_step[GRADIENTS]),
            "model = DistributedDataParallel(model, gradient_as_bucket_view=True)"))
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
