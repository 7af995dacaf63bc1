"""Which operator outputs can be quadratic attention scores, and which ops are fused
attention (``scaled_dot_product_attention``'s kernels), as the storage tracker sees them.

A score tensor is ``(..., T, T)``: ``q @ k.transpose(-2, -1)`` (``bmm``), its scaling,
masking and softmax, and dropout's mask and output. Whether one is kept for backward is
decided later, when autograd saves it (``forward_facts.py``).
"""

from __future__ import annotations

import torch

from memprof.collect.tensors import storages_behind

_aten = torch.ops.aten


def aten_packets(*names: str) -> frozenset[object]:
    return frozenset(getattr(_aten, n) for n in names if hasattr(_aten, n))


SCORE_OPS = aten_packets("bmm", "baddbmm", "_softmax", "_safe_softmax", "masked_fill", "mul",
                     "div", "add", "where", "native_dropout", "empty_like", "_masked_softmax")
# and _safe_softmax, which only SDPA's math fallback calls (the CPU's, with dropout): the
# script calls scaled_dot_product_attention, which CUDA would run fused
FUSED_ATTENTION_OPS = aten_packets(
    "_safe_softmax",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
    "_efficient_attention_forward")


# a cross-entropy's log-probabilities (F.cross_entropy, nll_loss of log_softmax), kept for
# backward: (N, classes), and worth a loss remedy where the classes are a vocabulary
LOSS_OPS = aten_packets("_log_softmax")
VOCABULARY = 1024  # classes from which a log-softmax output is a language model's


def is_square(t: torch.Tensor) -> bool:
    """A batch of ``T x T`` matrices (at least 3 dimensions, T > 1)."""
    return t.dim() >= 3 and t.size(-1) == t.size(-2) > 1


def is_vocabulary_wide(t: torch.Tensor) -> bool:
    """Rows of at least :data:`VOCABULARY` classes."""
    return t.dim() >= 1 and t.size(-1) >= VOCABULARY


def logits_rows(logits: object, out: torch.Tensor) -> int:
    """The rows of vocabulary-wide logits that ``logits`` (a loss's input, whose output
    ``out`` has its rows) is part of: its storage's rows where it is a slice of logits
    computed whole (``logits[:, -1]``), else ``out``'s own."""
    rows = out.numel() // max(1, out.size(-1))
    if not isinstance(logits, torch.Tensor) or logits.shape[-1:] != out.shape[-1:]:
        return rows
    whole = max((st.nbytes() for st in storages_behind(logits)), default=0)
    return max(rows, whole // max(1, logits.size(-1) * logits.element_size()))

