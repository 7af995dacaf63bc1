"""What a remedy is, and what its savings model may know of the run: ``Remedy``, ``Context``,
and the seed documents the remedies come from (``../shared/seeds``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memprof.advise.peak import Peak

SEEDS = {
    "000": "seed 000 (system memory standing in for GPU memory: ZeRO, offload, accumulation)",
    "001": "seed 001 (memory bandwidth: mixed precision, checkpointing, no_grad, ZeRO)",
    "003": "seed 003 (out-of-memory causes and fixes: precision, accumulation, checkpointing,"
           " 8-bit optimizers, offload)",
    "004": "seed 004 (large-model training: mixed precision, INT8, checkpointing, ZeRO)",
    "001_pipeline": "seed 001 (model and pipeline parallelism: the model split over devices)",
    "003_attention": "seed 003 (out-of-memory causes: self-attention memory grows with the"
                     " square of the sequence length)",
    "003_stages": "seed 003 (memory grows in stages: the graph in forward, gradients in"
                  " backward, the optimizer's temporaries)",
    "loss": "not a seed: a language model's cross-entropy keeps fp32 log-probabilities of"
            " every token over the whole vocabulary (Liger Kernel's fused linear"
            " cross-entropy, chunked losses)",
}
# libraries whose models switch checkpointing on themselves, by their modules' prefix
MODEL_LIBRARIES = ("transformers", "diffusers")

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
    # of the activations when they peaked, the share CUDA autocast would keep in bf16
    # (the run's traced operators: the autocast_half tag); None: not traced
    autocast_share: float | None = None
    # the most parameter bytes the run held on the card at once (the model before FSDP
    # sharded it, where the script put it there whole first)
    parameters_peak: int = 0
    # the card computes bf16 on tensor cores (compute capability 8.0 or later, or unknown)
    bf16_cores: bool = True

    @property
    def optimizer(self) -> dict[str, Any]:
        """The optimizer that holds the most state (not a library's container of them)."""
        optimizers = self.model.get("optimizers") or [{}]
        return max(optimizers, key=lambda o: o.get("state_bytes") or 0)

    @property
    def quantised_state(self) -> bool:
        """Whether the optimizer keeps 8- or 4-bit state (bitsandbytes' ``AdamW8bit``,
        ``PagedAdam8bit``, torchao's ``AdamW4bit``): its size does not follow the weights'."""
        name = str(self.optimizer.get("class", ""))
        return "8bit" in name or "4bit" in name

    @property
    def accumulation(self) -> int:
        """The backward passes the run already accumulates per optimizer step (1: none)."""
        steps = self.model.get("accumulation")
        return steps if isinstance(steps, int) and steps > 1 else 1

    @property
    def zero_stage(self) -> int:
        """The DeepSpeed ZeRO stage the run used (``deepspeed:zero<N>``), or 0."""
        strategies = (self.model.get("parallelism") or {}).get("strategies") or ()
        return max((int(s[len("deepspeed:zero"):]) for s in strategies
                    if s.startswith("deepspeed:zero") and s[len("deepspeed:zero"):].isdigit()),
                   default=0)

    @property
    def pipeline(self) -> dict[str, Any] | None:
        """The pipeline schedule that ran the model (``parallelism.pipeline``), or None."""
        return (self.model.get("parallelism") or {}).get("pipeline")

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
        "fabric", "accelerate"), for snippets in its own switches; None: the script's own loop."""
        loop = self.model.get("trainer")
        return loop if isinstance(loop, str) else None

    @property
    def lightning(self) -> tuple[str, str] | None:
        """How the run entered Lightning, for its snippets: the call that takes the switches
        and the module of its strategies (the ``Trainer``'s or ``Fabric``'s); None for
        another loop."""
        if self.loop == "lightning":
            return "trainer = L.Trainer(", "lightning.pytorch.strategies"
        if self.loop == "fabric":
            return "fabric = L.Fabric(", "lightning.fabric.strategies"
        return None

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
