"""``scaled_dot_product_attention`` with the kernel the card would pick, and its buffers.

PyTorch's CUDA dispatcher (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``)
tries flash attention, then memory-efficient attention, then the math fallback; on
Hopper and Blackwell data-center cards (sm90, sm100) with cuDNN above 9.15, which torch
2.11's wheels pin (9.19), it tries cuDNN's attention first (``check_prefer_cudnn_
attention``), unless ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is set. An H200 with torch
2.11.0+cu130 picked cuDNN for every fp16/bf16 case tried: head dims 64 to 256, causal,
dropout, grouped-query, boolean and additive masks (``benchmarks/kernel_scratch_probe.py``).
The checks kept here are the ones that decide for dense 4-d inputs: cuDNN needs fp16/bf16,
head dims divisible by 8 and at most 128 (256 on sm90), more than one key and a unit
last stride; flash needs compute capability 8.0+, fp16/bf16, no attention mask, equal
head dims of at most 256; memory-efficient needs 5.0+ (bf16: 8.0+), head dims divisible
by 8 (fp32: 4), and equal query/key head dims. The chosen aten op runs on the virtual
tensors, so the output, ``logsumexp`` and backward buffers are the kernel's own
(``kernel_memory.py`` adds their scratch).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch

from memprof.collect.virtual.autocast import lower_precision
from memprof.collect.virtual.cards import Card

CUDNN, FLASH, EFFICIENT, MATH = "cudnn", "flash", "efficient", "math"
CUDNN_FIRST_RELEASE = (2, 11)  # the first torch seen on a card to put cuDNN first
_HALF = (torch.float16, torch.bfloat16)
_aten = torch.ops.aten


def cudnn_first(card: Card, torch_version: str = torch.__version__,
                env: Mapping[str, str] = os.environ) -> bool:
    """Whether ``torch_version`` on ``card`` tries cuDNN's attention before flash."""
    release = tuple(int(part) for part in torch_version.split("+")[0].split(".")[:2])
    return (card.capability[0] in (9, 10) and release >= CUDNN_FIRST_RELEASE
            and env.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "0") in ("", "0"))


def _cudnn_fits(card: Card, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                dropout_p: float, enable_gqa: bool) -> bool:
    """``can_use_cudnn_attention`` for dense 4-d inputs."""
    limit = 256 if card.capability == (9, 0) else 128
    d_qk, d_v = q.size(-1), v.size(-1)
    heads_fit = (q.size(1) == k.size(1) == v.size(1)
                 or (enable_gqa and k.size(1) == v.size(1) and q.size(1) % k.size(1) == 0))
    return (torch.backends.cuda.cudnn_sdp_enabled() and q.dtype in _HALF
            and q.dtype == k.dtype == v.dtype and q.size(0) == k.size(0) == v.size(0)
            and heads_fit and d_qk == k.size(-1) and d_qk <= limit and d_v <= limit
            and d_qk % 8 == 0 and d_v % 8 == 0 and k.size(-2) > 1
            and not (q.size(-2) == 1 and dropout_p > 0)
            and all(t.stride(-1) == 1 or t.size(-1) == 1 for t in (q, k, v))
            and not (torch.are_deterministic_algorithms_enabled()
                     and not torch.is_deterministic_algorithms_warn_only_enabled()))


def choose_kernel(card: Card, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  attn_mask: torch.Tensor | None, enable_gqa: bool = False,
                  dropout_p: float = 0.0) -> str:
    """The SDPA backend CUDA would run for these inputs on ``card``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return MATH
    if cudnn_first(card) and _cudnn_fits(card, q, k, v, dropout_p, enable_gqa):
        return CUDNN
    if enable_gqa:
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
    kernel = choose_kernel(card, query, key, value, attn_mask, enable_gqa, dropout_p)
    if kernel == FLASH:
        return _aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    bias = _expanded_mask(attn_mask, query, key) if attn_mask is not None else None
    if kernel == CUDNN:
        return _aten._scaled_dot_product_cudnn_attention(
            query, key, value, bias, needs_grad, dropout_p, is_causal, False, scale=scale)[0]
    if kernel == EFFICIENT:
        return _aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, needs_grad, dropout_p, is_causal, scale=scale)[0]
    return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _expanded_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A fused kernel's additive bias: a boolean mask becomes ``where(mask, 0, -inf)`` in
    the query's dtype, from two device scalars (as the H200's torch 2.11 made it)."""
    if mask.dtype == torch.bool:
        # made from the virtual tensors, since a factory asked for "cuda" here (below the
        # routing mode) would reach the real backend
        mask = torch.where(mask, q.new_zeros(()), q.new_full((), -math.inf))
    return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool
          ) -> torch.Tensor:
    return _aten._scaled_dot_product_attention_math(
        q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
