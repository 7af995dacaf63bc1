"""CUDA's autocast policy for virtual tensors, at the dispatcher's AutocastCUDA key.

Virtual tensors carry the ``AutocastCUDA`` dispatch key, so under
``torch.autocast("cuda", dtype)`` the dispatcher calls an autocast kernel first, above
autograd, as it does for real CUDA tensors. The CPU build's own CUDA autocast kernels
would not cast them (to C++ they are meta tensors, not CUDA), so :func:`install`
registers Python kernels for the ops of ``aten/src/ATen/autocast_mode.cpp``'s CUDA
lists with the same policies: ``lower_precision_fp`` (cast to the autocast dtype,
caching the casts of leaf tensors that require grad until autocast is left), ``fp32``,
``fp32_set_opt_dtype`` (pass ``dtype=float32``), ``fp32_append_dtype`` (``norm``) and
``promote`` (the widest floating type of the arguments).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from memprof.collect.cpu.plain_mode import PlainMode

AUTOCAST_CUDA = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)

LOWER_PRECISION = (
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    "cudnn_convolution", "cudnn_convolution_transpose",
)
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
FP32_SET_OPT_DTYPE = ("prod", "softmax", "log_softmax", "cumprod", "cumsum",
                      "linalg_vector_norm", "linalg_matrix_norm", "sum")
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler",
           "index_put", "tensordot", "scatter_add")
# fp32_append_dtype: norm without a dtype redispatches to its dtype overload
_NORM_WITH_DTYPE = {"Scalar": "ScalarOpt_dtype", "ScalarOpt_dim": "ScalarOpt_dim_dtype"}

_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def eligible(t: object) -> bool:
    """A tensor CUDA autocast would cast: CUDA, floating point, not double."""
    return (isinstance(t, torch.Tensor) and t.is_cuda and t.is_floating_point()
            and t.dtype != torch.float64)


def cast(args: Any, dtype: torch.dtype) -> Any:
    """``args`` with every eligible tensor cast to ``dtype`` (``cached_cast``)."""
    return tree_map(lambda t: _cached_cast(t, dtype) if eligible(t) else t, args)


def cast_call(args: tuple, kwargs: dict[str, Any], dtype: torch.dtype
              ) -> tuple[tuple, dict[str, Any]]:
    """An op's arguments with every eligible tensor cast to ``dtype``, the last argument
    first: the C++ kernels cast them within one argument list (``cached_cast(dtype,
    args)...``), which GCC evaluates right to left; the H200 casts a ``Linear``'s bias
    before its weight."""
    kw = {k: cast(v, dtype) for k, v in reversed(kwargs.items())}
    cast_args = [cast(a, dtype) for a in reversed(args)]
    return tuple(reversed(cast_args)), {k: kw[k] for k in kwargs}


def lower_precision(*tensors: torch.Tensor) -> Any:
    """``tensors`` as CUDA autocast hands them to a lower-precision op (unchanged outside
    autocast)."""
    if not torch.is_autocast_enabled("cuda"):
        return tensors
    return cast_call(tensors, {}, torch.get_autocast_dtype("cuda"))[0]


def clear_cache() -> None:
    """Drop the cached casts (autocast's outermost exit does)."""
    _cache.clear()


def _cached_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype == dtype:
        return t
    cacheable = (dtype == torch.get_autocast_dtype("cuda") and t.dtype == torch.float32
                 and t.requires_grad and t.is_leaf and not t._is_view()
                 and torch.is_autocast_cache_enabled()
                 and (not torch.is_inference_mode_enabled() or caches_in_inference_mode()))
    if cacheable:
        hit = _cache.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
    with torch.enable_grad() if cacheable else contextlib.nullcontext():
        out = t.to(dtype)
    if cacheable:
        _cache[id(t)] = (t, out)
    return out


class _CastCount(PlainMode):
    """Counts the operators whose first argument is ``of`` (a plain mode: torch would
    import Dynamo, a second, to wrap a ``TorchDispatchMode``'s method)."""

    def __init__(self, of: torch.Tensor) -> None:
        super().__init__()
        self.of = of
        self.seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.seen += bool(args) and args[0] is self.of
        return func(*args, **(kwargs or {}))


@functools.cache
def caches_in_inference_mode() -> bool:
    """Whether this torch's autocast caches weight casts in inference mode (2.6 does; 2.11
    and later cast a weight at every use). Learnt from CPU autocast, which shares
    ``cached_cast`` with CUDA's: two uses of one weight, counting its casts."""
    weight = torch.nn.Parameter(torch.ones(2, 2))
    count = _CastCount(weight)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16), count:
        for _ in range(2):
            torch.nn.functional.linear(torch.ones(1, 2), weight)
    return count.seen == 1


def _lower_precision_fp(op: Any) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(AUTOCAST_CUDA):
            args, kwargs = cast_call(args, kwargs, torch.get_autocast_dtype("cuda"))
            return op(*args, **kwargs)
    return kernel


def _fp32(op: Any) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(AUTOCAST_CUDA):
            args, kwargs = cast_call(args, kwargs, torch.float32)
            return op(*args, **kwargs)
    return kernel


def _fp32_set_opt_dtype(op: Any) -> Callable[..., Any]:
    names = [a.name for a in op._schema.arguments]
    at = names.index("dtype")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(AUTOCAST_CUDA):
            if args and eligible(args[0]):
                if len(args) > at:
                    if args[at] is None:
                        args = (*args[:at], torch.float32, *args[at + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)
    return kernel


def _fp32_append_dtype(op: Any, with_dtype: Any) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(AUTOCAST_CUDA):
            if args and eligible(args[0]):
                return with_dtype(*args, **kwargs, dtype=torch.float32)
            return op(*args, **kwargs)
    return kernel


def _promote(op: Any) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(AUTOCAST_CUDA):
            found = [t.dtype for t in torch.utils._pytree.tree_leaves((args, kwargs))
                     if eligible(t)]
            if not found:
                return op(*args, **kwargs)
            widest = torch.get_autocast_dtype("cuda")
            for dtype in found:
                widest = torch.promote_types(widest, dtype)
            args, kwargs = cast_call(args, kwargs, widest)
            return op(*args, **kwargs)
    return kernel


def _overloads(name: str) -> list[tuple[str, Any]]:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return []
    return [(name if o == "default" else f"{name}.{o}", getattr(packet, o))
            for o in packet.overloads() if "out" not in o.split("_")]


def install() -> torch.library.Library:
    """Register the CUDA autocast kernels; ``_destroy()`` the returned library to remove them."""
    caches_in_inference_mode()  # learnt now, before the script's modes and contexts
    lib = torch.library.Library("aten", "IMPL")
    kernels: list[tuple[str, Callable[..., Any]]] = []
    for policy, names in ((_lower_precision_fp, LOWER_PRECISION), (_fp32, FP32),
                          (_promote, PROMOTE)):
        kernels += [(q, policy(op)) for name in names for q, op in _overloads(name)]
    kernels += [(q, _fp32_set_opt_dtype(op)) for name in FP32_SET_OPT_DTYPE
                for q, op in _overloads(name)
                if "dtype" in [a.name for a in op._schema.arguments]]
    kernels += [(f"norm.{o}", _fp32_append_dtype(getattr(torch.ops.aten.norm, o),
                                                  getattr(torch.ops.aten.norm, d)))
                for o, d in _NORM_WITH_DTYPE.items()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        for qualified, kernel in kernels:
            lib.impl(qualified, kernel, "AutocastCUDA")
    return lib
