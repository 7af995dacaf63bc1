"""Precision remedies: float32 for a float64 model; bf16 autocast, and pure bf16 weights,
gradients and optimizer state, for an fp32 one.

Autocast's saving is measured where the run's operators were traced (the virtual GPU and
the CPU recorder: ``run.model.ops_traced``): the activations autocast would make, or save
a copy of, in bf16 (``autocast_ops.py``, tagged ``autocast_half``) halve, and so do the
temporaries it would make in bf16 (``autocast_half_temporary``), and backward's temporaries
(gradients, in their activations' dtype) in the share of the activations that halve; the
bf16 copies of the weights it saves for backward are added. Elsewhere (a GPU's
run) every activation and temporary is taken to halve but a cross-entropy's
log-probabilities: the best case.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from memprof.advise.peak import Peak
from memprof.advise.remedy import SEEDS, Context, Remedy
from memprof.trace.model import (
    ACTIVATIONS,
    AUTOCAST_HALF,
    AUTOCAST_HALF_TEMPORARY,
    BUFFERS,
    GRADIENTS,
    LOSS_LOGITS,
    OPTIMIZER_STATE,
    PARAMETERS,
    TEMPORARIES,
)

_TRACED = ("the activations the run's operators show autocast would make, or save a copy of,"
           " in bf16 halve (matmul and convolution inputs and outputs, and what is computed"
           " from them alone), and so do the temporaries autocast would make in bf16, and"
           " backward's in the share of the activations that halve; norms, softmax, losses"
           " and the fp32 residual stream stay as they are; the bf16 weight copies saved for"
           " backward add half the fp32 weights")
_HALVED = ("activations and temporaries halve (matmul inputs and outputs in bf16) but a"
           " cross-entropy's log-probabilities, which stay fp32; norms, softmax and what the"
           " residual stream keeps in fp32 stay fp32 too, so this is the best case; the bf16"
           " weight copies saved for backward add half the fp32 weights")


def _traced(share: float) -> Callable[[Peak], Peak]:
    """Autocast from the traced operators: the tagged activations and temporaries halve;
    the other temporaries, backward's gradients of the activations, in ``share``."""
    def autocast(p: Peak) -> Peak:
        half = p.tags_at_peak.get(AUTOCAST_HALF, 0)
        temporary = min(p.tags_at_peak.get(AUTOCAST_HALF_TEMPORARY, 0), p.at_peak[TEMPORARIES])
        backward = p.at_peak[TEMPORARIES] - temporary
        return replace(p, at_peak={
            **p.at_peak,
            ACTIVATIONS: p.at_peak[ACTIVATIONS] - half // 2 + p.at_peak[PARAMETERS] // 2,
            TEMPORARIES: temporary - temporary // 2 + backward - int(backward * share / 2)},
            tags_at_peak={**p.tags_at_peak, AUTOCAST_HALF: half - half // 2,
                          AUTOCAST_HALF_TEMPORARY: temporary - temporary // 2})
    return autocast


def _halved_autocast(p: Peak) -> Peak:
    # a cross-entropy's log-probabilities stay fp32 (log_softmax is on autocast's fp32
    # list); bf16 copies of the weights are saved for backward: half the fp32 weights
    fp32 = p.tags_at_peak.get(LOSS_LOGITS, 0)
    halved = p.scaled({ACTIVATIONS: 0.5, TEMPORARIES: 0.5}, step_too=False)
    return replace(halved, at_peak={**halved.at_peak, ACTIVATIONS: halved.at_peak[
        ACTIVATIONS] + fp32 - fp32 // 2 + p.at_peak[PARAMETERS] // 2},
        tags_at_peak={**halved.tags_at_peak, **({LOSS_LOGITS: fp32} if fp32 else {})})


def precision_remedies(peak: Peak, ctx: Context) -> list[Remedy]:
    """fp32 for a float64 model; bf16 autocast, and pure bf16, for an fp32 one."""
    busy = peak.busy
    dtypes = ctx.model.get("dtypes") or {"float32": 1}
    if dtypes.get("float64"):
        return _single(dtypes["float64"] / sum(dtypes.values()))
    if set(dtypes) != {"float32"}:
        return []
    # autocast, or FSDP's mixed precision: the forward computes in half precision already
    amp = bool(ctx.model.get("autocast")) or (ctx.model.get("parallelism") or {}).get(
        "param_dtype") in ("bfloat16", "float16")
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
        f'{ctx.lightning[0]}..., precision="bf16-true")' if ctx.lightning else
        "model = model.to(torch.bfloat16)  # before the optimizer is built")
    # DeepSpeed keeps fp32 master weights and optimizer state whatever the model's dtype:
    # pure bf16's model of the state does not hold there, autocast's of the forward does
    deepspeed = any(str(s).startswith("deepspeed") for s in (
        ctx.model.get("parallelism") or {}).get("strategies") or ())
    kept = [] if deepspeed else [pure]
    if amp or not busy:
        return kept

    share = ctx.autocast_share
    autocast = _halved_autocast if share is None else _traced(share)
    # a card without bf16 tensor cores (before compute capability 8.0: T4, V100) emulates
    # bf16 and runs attention's math path for it: fp16, with its loss scaling, is the one
    half, dtype = ("bf16", "bfloat16") if ctx.bf16_cores else ("fp16", "float16")
    loop = ('with torch.autocast("cuda", dtype=torch.bfloat16):\n'
            "    loss = compute_loss(model, batch)  # the forward pass and the loss only\n"
            "loss.backward()") if ctx.bf16_cores else (
        'scaler = torch.amp.GradScaler("cuda")\n'
        'with torch.autocast("cuda", dtype=torch.float16):\n'
        "    loss = compute_loss(model, batch)  # the forward pass and the loss only\n"
        "scaler.scale(loss).backward()\n"
        "scaler.step(optimizer)  # instead of optimizer.step()\n"
        "scaler.update()")
    return [Remedy(
        "autocast", "bf16 autocast (mixed precision)" if ctx.bf16_cores else
        "fp16 autocast with loss scaling (mixed precision)", "precision", 3,
        "numerics: bf16 matmuls (fp32 where CUDA's autocast lists keep it); faster on tensor"
        " cores" if ctx.bf16_cores else "numerics: fp16 matmuls, a GradScaler against"
        " underflow (this card has no bf16 tensor cores); faster on tensor cores",
        SEEDS["004"], (_HALVED if share is None else _TRACED).replace("bf16", half), autocast,
        f"TrainingArguments(..., {half}=True)  # the Trainer's forward under {half} autocast"
        if ctx.trainer else
        f'{ctx.lightning[0]}..., precision="{half.removeprefix("fp")}-mixed")' if ctx.lightning
        else f'accelerator = Accelerator(..., mixed_precision="{half}")  # prepare() wraps the'
        " forward" if ctx.loop == "accelerate" else loop,
        {"autocast": dtype}), *kept]


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
