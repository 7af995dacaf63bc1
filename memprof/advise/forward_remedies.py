"""Remedies that need facts ``memprof run`` records about the forward pass: fused
attention where quadratic attention scores are saved for backward, a chunked (or fused)
cross-entropy where a vocabulary's log-probabilities are (or one in the model's half
precision, where its logits were upcast for the loss), logits for the rows a loss reads
where it reads a slice of them, ``no_grad`` for evaluation
passes run with grad enabled, and ``zero_grad(set_to_none=True)`` where gradients are
zeroed and kept through the next forward pass.

Each saves bytes alive at the peak only: the tagged activations (``report.json``'s
``tagged``) or the gradients at the activation moment. ``--verify`` measures the chunked
loss (it chunks ``F.cross_entropy`` itself, not the output layer); the others are
estimates.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from memprof.advise.peak import Peak
from memprof.advise.remedy import SEEDS, Context, Remedy
from memprof.trace.model import (
    ATTENTION_SCORES,
    EVAL_ACTIVATIONS,
    GRADIENTS,
    LOSS_LOGITS,
    OTHER,
    TEMPORARIES,
)

SCORES_SHARE = 0.03  # attention scores under this share of the peak: not worth a rewrite
LOSS_SHARE = 0.03  # the same for a cross-entropy's log-probabilities
LOSS_CHUNKS = 8  # the chunked loss's chunks of rows: one chunk's log-probabilities at a time
HALF_MODEL = 0.9  # a model with this share of its weights in half precision computes in it
LSE_BYTES = 4  # SDPA keeps an fp32 logsumexp per row of scores for backward
_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def forward_remedies(peak: Peak, ctx: Context) -> list[Remedy]:
    """The remedies of this module that apply to the run."""
    return (_fused_attention(peak, ctx) + _fp16_attention(peak, ctx) + _chunked_loss(peak, ctx)
            + _loss_in_model_dtype(peak, ctx) + _logits_to_keep(peak, ctx) + _no_grad(peak, ctx)
            + _set_to_none(peak, ctx))


def _fused_attention(peak: Peak, ctx: Context) -> list[Remedy]:
    facts = ctx.model.get("attention")
    scores = peak.tagged(ATTENTION_SCORES)
    if not facts or facts["fused"] or scores < SCORES_SHARE * peak.allocated:
        return []
    shape, dtype = facts["score_shape"], facts["score_dtype"]
    t, kept = shape[-1], _kept(facts)
    owner = facts.get("module") or "the attention module"
    if owner == "MultiheadAttention":  # PyTorch's own: the fused kernel is a switch away
        return [Remedy(
            "fused_attention", "nn.MultiheadAttention called with need_weights=False",
            "attention", 2, "none: the same output, from its fused kernel (faster too); the"
            " averaged attention weights it returns become None", SEEDS["003_attention"],
            f"the T x T attention weights it computes to return ({'x'.join(map(str, shape))}"
            f" {dtype} the largest, {scores:,} bytes at the peak) are not kept;"
            f" scaled_dot_product_attention keeps a {LSE_BYTES}-byte logsumexp per row"
            " instead; the kernel's own workspace is not counted",
            lambda p: p.without_tag(ATTENTION_SCORES, 1 - kept),
            "# where the script calls its nn.MultiheadAttention (self.attn, say):\n"
            "out, _ = self.attn(query, key, value, attn_mask=mask, need_weights=False)",
            {"attention_weights": False})]
    return [Remedy(
        "fused_attention", f"fused attention (scaled_dot_product_attention) in {owner}",
        "attention", 2, "none: the same result from a flash or memory-efficient kernel"
        " (faster too)", SEEDS["003_attention"],
        f"the T x T attention scores saved for backward ({'x'.join(map(str, shape))} {dtype}"
        f" the largest, {scores:,} bytes at the peak) are not kept; SDPA keeps a {LSE_BYTES}-byte"
        f" logsumexp per row of {t} scores instead (1/{t * _ITEMSIZE.get(dtype, 4) // LSE_BYTES}"
        " of them); the kernel's own workspace is not counted",
        lambda p: p.without_tag(ATTENTION_SCORES, 1 - kept),
        f"# in {owner}.forward, instead of softmax(q @ k.transpose(-2, -1) * scale) @ v\n"
        "# (is_causal=True for a causal mask, attn_mask=mask for another one):\n"
        "out = torch.nn.functional.scaled_dot_product_attention(\n"
        "    q, k, v, is_causal=True, dropout_p=dropout if self.training else 0.0)")]


def _kept(facts: dict[str, Any]) -> float:
    """Of the attention scores, the share a fused kernel keeps: its logsumexp per row."""
    return LSE_BYTES / (facts["score_shape"][-1] * _ITEMSIZE.get(facts["score_dtype"], 4))


def _fp16_attention(peak: Peak, ctx: Context) -> list[Remedy]:
    """bf16 autocast on a card without bf16 tensor cores: scaled_dot_product_attention has
    no fused bf16 kernel there and computes the scores whole (its math path); in fp16 its
    memory-efficient kernel runs."""
    facts = ctx.model.get("attention")
    scores = peak.tagged(ATTENTION_SCORES)
    if ctx.bf16_cores or ctx.model.get("autocast") != "bfloat16" or not facts \
            or not facts["fused"] or scores < SCORES_SHARE * peak.allocated:
        return []
    kept = _kept(facts)
    return [Remedy(
        "fp16_autocast", "fp16 autocast with loss scaling instead of bf16", "precision", 2,
        "numerics: fp16's narrower range, a GradScaler against underflow; faster (this card"
        " has no bf16 tensor cores, and emulates bf16)", SEEDS["003_attention"],
        "scaled_dot_product_attention runs its memory-efficient kernel in fp16, where in bf16"
        f" this card takes its math path: the attention scores ({scores:,} bytes at the peak)"
        " are not kept, a logsumexp per row instead; the rest keeps its half-precision size",
        lambda p: p.without_tag(ATTENTION_SCORES, 1 - kept),
        "TrainingArguments(..., fp16=True)  # instead of bf16=True" if ctx.trainer else
        f'{ctx.lightning[0]}..., precision="16-mixed")' if ctx.lightning else
        'scaler = torch.amp.GradScaler("cuda")\n'
        'with torch.autocast("cuda", dtype=torch.float16):  # instead of torch.bfloat16\n'
        "    loss = compute_loss(model, batch)\n"
        "scaler.scale(loss).backward()\n"
        "scaler.step(optimizer)  # instead of optimizer.step()\n"
        "scaler.update()",
        {"autocast": "float16"})]


def _chunked_loss(peak: Peak, ctx: Context) -> list[Remedy]:
    facts = ctx.model.get("loss")
    held = peak.tagged(LOSS_LOGITS)
    if not facts or held < LOSS_SHARE * peak.allocated:
        return []
    shape = facts["shape"]
    rows, classes = (shape[0] if len(shape) > 1 else 1), shape[-1]
    liger = ("# TrainingArguments(..., use_liger_kernel=True)  # pip install liger-kernel: its"
             " fused\n# linear cross-entropy never makes the logits whole; or by hand:\n"
             if ctx.trainer else "")
    return [Remedy(
        "chunked_loss", f"the cross-entropy over the {classes:,}-class vocabulary in"
        f" {LOSS_CHUNKS} chunks of rows", "loss", 2,
        "none: the same loss; the output layer runs once per chunk (Liger Kernel's fused"
        " linear cross-entropy does it in one kernel)", SEEDS["loss"],
        f"the log-probabilities a cross-entropy saves for backward ({rows:,} x {classes:,}"
        f" {facts['dtype']} the largest, {held:,} bytes at the peak) are kept for one chunk"
        f" of rows at a time, 1/{LOSS_CHUNKS} of them; the logits the script holds itself"
        " (and an fp32 copy of them) go too where it stops holding them: not counted here",
        lambda p: p.without_tag(LOSS_LOGITS, 1 - 1 / LOSS_CHUNKS),
        f"{liger}# instead of F.cross_entropy(model.head(hidden).flatten(0, -2), targets"
        ".flatten()):\n"
        "def chunk_loss(h, t):  # the output layer and the loss of one chunk of rows\n"
        "    return F.cross_entropy(model.head(h).float(), t, reduction=\"sum\")\n"
        "rows, labels = hidden.flatten(0, -2), targets.flatten()\n"
        "loss = sum(torch.utils.checkpoint.checkpoint(chunk_loss, h, t, use_reentrant=False)\n"
        f"           for h, t in zip(rows.chunk({LOSS_CHUNKS}), labels.chunk({LOSS_CHUNKS})))"
        " / labels.numel()",
        {"chunked_loss": LOSS_CHUNKS})]  # --verify chunks the loss alone, not the head


def _loss_in_model_dtype(peak: Peak, ctx: Context) -> list[Remedy]:
    """A model whose weights are half precision (no autocast, which keeps a loss in fp32
    whatever its input) whose cross-entropy saves fp32 log-probabilities: its logits were
    upcast for the loss (``logits.float()``)."""
    facts, dtypes = ctx.model.get("loss"), ctx.model.get("dtypes") or {}
    held = peak.tagged(LOSS_LOGITS)
    half = max(("bfloat16", "float16"), key=lambda d: dtypes.get(d, 0))
    if not facts or facts["dtype"] != "float32" or ctx.model.get("autocast") \
            or dtypes.get(half, 0) < HALF_MODEL * sum(dtypes.values()) \
            or held < LOSS_SHARE * peak.allocated:
        return []
    library = ("# transformers upcasts them in its own loss (logits.float()): compute the"
               " loss yourself\nlogits = model(input_ids).logits\n" if ctx.transformers else "")
    return [Remedy(
        "loss_model_dtype", f"the cross-entropy in {half}, the model's dtype", "loss", 3,
        f"numerics: {half} log-probabilities (PyTorch's log_softmax sums the vocabulary in"
        " fp32, and rounds each result); a loss in fp32 is the common default for a reason",
        SEEDS["loss"],
        f"the fp32 log-probabilities the cross-entropy saves for backward ({held:,} bytes at"
        f" the peak) are {half}, half as large; the fp32 copy of the logits is not made"
        " either: not counted here",
        lambda p: p.without_tag(LOSS_LOGITS, 0.5),
        f"{library}# without .float(): the logits stay {half}\n"
        "loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())")]


def _logits_to_keep(peak: Peak, ctx: Context) -> list[Remedy]:
    """A loss that reads a slice of logits computed whole (``logits[:, -1]``, a
    generation-style loss over the last positions): the rows it never reads need not be."""
    facts = ctx.model.get("loss") or {}
    shape, computed = facts.get("shape") or [], facts.get("logits_rows")
    if not shape or not computed:
        return []
    classes, used = shape[-1], math.prod(shape[:-1])
    unread = (computed - used) * classes * _ITEMSIZE.get(facts["dtype"], 4)
    if unread < LOSS_SHARE * peak.allocated:
        return []
    snippet = ("outputs = model(input_ids, logits_to_keep=k)  # the last k positions' logits"
               if ctx.transformers else
               "logits = model.head(hidden[:, -k:])  # the output layer on the rows the loss"
               " reads")
    return [Remedy(
        "logits_to_keep", f"logits for the {used:,} rows the loss reads, not all {computed:,}",
        "loss", 1, "none: the same loss", SEEDS["loss"],
        f"the loss reads {used:,} of the {computed:,} rows of {classes:,}-class logits the"
        f" model computes; the other rows' logits ({unread:,} bytes) and their zero gradient"
        " in backward, as large, are not made, where the peak holds them (as temporaries,"
        " or kept by the script to its end)",
        lambda p: _without_logits(p, unread),
        snippet)]


def _without_logits(p: Peak, unread: int) -> Peak:
    """``p`` without ``unread`` bytes of logits and as many of their gradient among the
    temporaries, and without the logits the script still holds at its end (``other``), at
    each moment (the recorded peak may be either), as far as each holds that many."""
    def fewer(held: dict[str, int]) -> dict[str, int]:
        return {**held, TEMPORARIES: held[TEMPORARIES] - min(held[TEMPORARIES], 2 * unread),
                OTHER: held[OTHER] - min(held[OTHER], unread)}
    return replace(p, at_peak=fewer(p.at_peak), at_step=fewer(p.at_step))


def _no_grad(peak: Peak, ctx: Context) -> list[Remedy]:
    held = peak.tagged(EVAL_ACTIVATIONS)
    if not held:
        return []
    model = ctx.model.get("eval_module") or "Module"
    return [Remedy(
        "no_grad_eval", f"torch.no_grad() around the evaluation of {model}", "eval", 1,
        "none: evaluation needs no graph", SEEDS["001"],
        f"the {held:,} bytes that forwards of the {model} in eval mode saved for a"
        " backward that never read them are not kept; only forwards in eval mode with grad"
        " enabled are seen (an evaluation in training mode is not)",
        lambda p: p.without_tag(EVAL_ACTIVATIONS),
        f"model.eval()  # the {model}\n"
        "with torch.inference_mode():  # or torch.no_grad()\n"
        "    val_loss = compute_loss(model, batch).item()\n"
        "model.train()")]


def _set_to_none(peak: Peak, ctx: Context) -> list[Remedy]:
    grads = peak.at_peak[GRADIENTS]
    if ctx.model.get("zero_grad_set_to_none") is not False or not grads:
        return []
    name = ctx.optimizer.get("class", "optimizer")
    return [Remedy(
        "zero_grad_set_to_none", "optimizer.zero_grad(set_to_none=True)", "zero_grad", 1,
        "none: gradients are None until backward makes them (code reading p.grad between"
        " steps must allow None)", SEEDS["003_stages"],
        f"the {grads:,} bytes of gradients held at the activation peak are zeros kept"
        " from the last step; with set_to_none backward allocates them after the forward"
        " pass (the peak is taken to be before backward makes any)",
        lambda p: p.scaled({GRADIENTS: 0.0}, step_too=False),
        f"optimizer.zero_grad(set_to_none=True)  # the {name}; set_to_none=False keeps"
        " zeroed gradients through the next forward pass")]
