"""``scaled_dot_product_attention`` with the kernel the card would pick, and its buffers.

PyTorch's CUDA dispatcher (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``)
tries flash attention, then memory-efficient attention, then the math fallback. The
checks kept here are the ones that decide for dense 4-d inputs: flash needs compute
capability 8.0+, fp16/bf16, no attention mask, equal head dims of at most 256;
memory-efficient needs 5.0+ (bf16: 8.0+), head dims divisible by 8 (fp32: 4), and
equal query/key head dims. The chosen aten op runs on the virtual tensors, so the
output, ``logsumexp`` and backward buffers are the kernel's own.
"""

from __future__ import annotations

import math

import torch

from memprof.collect.virtual.autocast import lower_precision
from memprof.collect.virtual.cards import Card

FLASH, EFFICIENT, MATH = "flash", "efficient", "math"
_aten = torch.ops.aten


def choose_kernel(card: Card, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  attn_mask: torch.Tensor | None, enable_gqa: bool = False) -> str:
    """The SDPA backend CUDA would run for these inputs on ``card``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or enable_gqa:
        return MATH
    dims_equal = q.size(-1) == k.size(-1) == v.size(-1)
    same_dtype = q.dtype == k.dtype == v.dtype
    enabled = torch.backends.cuda
    if (enabled.flash_sdp_enabled() and card.capability >= (8, 0) and same_dtype
            and q.dtype in (torch.float16, torch.bfloat16) and attn_mask is None
            and dims_equal and q.size(-1) <= 256):
        return FLASH
    align = 4 if q.dtype == torch.float32 else 8
    if (enabled.mem_efficient_sdp_enabled() and card.capability >= (5, 0) and same_dtype
            and (q.dtype != torch.bfloat16 or card.capability >= (8, 0))
            and q.size(-1) == k.size(-1) and q.size(-1) % align == 0
            and v.size(-1) % align == 0):
        return EFFICIENT
    return MATH


def sdpa(card: Card, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
         scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as CUDA runs it on ``card``."""
    if not (query.is_cuda and key.is_cuda and value.is_cuda):
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa)
    # autocast casts at scaled_dot_product_attention, before the kernel is chosen
    query, key, value = lower_precision(query, key, value)
    kernel = choose_kernel(card, query, key, value, attn_mask, enable_gqa)
    if kernel == FLASH:
        return _aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if kernel == EFFICIENT:
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (query, key, value))
        bias = _expanded_mask(attn_mask, query, key) if attn_mask is not None else None
        return _aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, needs_grad, dropout_p, is_causal, scale=scale)[0]
    return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _expanded_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        # as sdp_utils' convert_boolean_attn_mask; made from the virtual tensors, since a
        # factory asked for "cuda" here (below the routing mode) would reach the real backend
        mask = torch.where(mask.logical_not(), -math.inf, q.new_zeros(()))
    return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool
          ) -> torch.Tensor:
    return _aten._scaled_dot_product_attention_math(
        q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
