"""CUDA's autocast policy for virtual tensors (``aten/src/ATen/autocast_mode.cpp``).

On a CPU-only build the CUDA autocast kernels never see a virtual tensor (to C++ it is
a meta tensor), so the policy is applied here, at the Python call: under
``torch.autocast("cuda", dtype)`` the lower-precision ops get their floating inputs
cast to ``dtype``, the fp32 ops to float32, and the promote ops to the widest input
type. Casts of leaf tensors (parameters) are cached until autocast is left, as CUDA's
``cached_cast`` does. Ops reached only inside another Python-level torch function
(e.g. the linears of ``multi_head_attention_forward``) are not seen.
"""

from __future__ import annotations

from typing import Any

import torch

# autocast_mode.cpp, KERNEL_CUDA(..., lower_precision_fp)
LOWER_PRECISION = frozenset({
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention", "__matmul__", "__rmatmul__",
})
# KERNEL_CUDA(..., fp32)
FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
    "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d", "cross_entropy",
    "cross_entropy_loss", "softmax", "log_softmax", "cumsum", "cumprod", "prod", "sum", "norm",
    "__pow__", "__rpow__",
})
# KERNEL_CUDA(..., promote)
PROMOTE = frozenset({
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add", "stack", "cat",
})
_LOW = (torch.float16, torch.bfloat16)
_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def cast_for_cuda(func: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` as CUDA autocast would hand them to ``func``."""
    if not torch.is_autocast_enabled("cuda"):
        if _cache:
            _cache.clear()
        return args, kwargs
    name = getattr(func, "__name__", "")
    if name in LOWER_PRECISION:
        dtype = torch.get_autocast_dtype("cuda")
    elif name in FP32:
        dtype = torch.float32
    elif name in PROMOTE:
        floats = [t.dtype for t in _tensors(args) if t.is_floating_point()]
        if not floats:
            return args, kwargs
        dtype = max(floats, key=lambda d: torch.finfo(d).bits)
    else:
        return args, kwargs
    return _cast(args, dtype), _cast(kwargs, dtype)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return _cast_tensor(obj, dtype)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(x, dtype) for x in obj)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj


def _cast_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if not t.is_cuda or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
        return t
    if dtype != torch.float32 and t.dtype not in (torch.float32, *_LOW):
        return t
    cacheable = t.is_leaf and t.requires_grad and dtype in _LOW
    if cacheable:
        hit = _cache.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
    out = t.to(dtype)
    if cacheable:
        _cache[id(t)] = (t, out)
    return out
