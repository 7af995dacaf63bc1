"""DistributedDataParallel on the virtual GPU: PyTorch's own C++ reducer, its buffers on the card.

DDP's reducer (C++) allocates its gradient buckets, and its map of used parameters, with
the options of the parameters it reads them from. C++ sees a virtual tensor as ``meta``
(``tensor.py``), so those would be plain meta tensors, memory the card's allocator never
sees, whose all-reduce has no future to read the bucket back from. While the reducer's
constructor and its bucket rebuilds run, :class:`CardFactories` makes each tensor C++
creates for the meta device a virtual CUDA tensor: the buckets are then the card's, of
the bytes, in the order and at the moments PyTorch allocates them (``bucket_cap_mb``, the
one bucket of the first iteration, the rebuild after it, ``gradient_as_bucket_view``).
``_verify_params_across_processes`` (C++, which reads shapes back with ``.item()``) is
replaced by the same allocations and collectives in Python.

    patches.update(ddp_patches())  # by (module, attribute), as gpu.py installs
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from memprof.collect.virtual.tensor import VirtualTensor, adopt

_META = torch.device("meta")


class CardFactories(TorchDispatchMode):
    """A tensor made from nothing for the meta device is a new virtual CUDA tensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (type(out) is torch.Tensor and out.is_meta and kwargs.get("device") == _META
                and not any(isinstance(a, torch.Tensor) for a in args)):
            return adopt(VirtualTensor(out))
        return out


def _on_the_card(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with CardFactories():
            return method(*args, **kwargs)
    return run


def verify_params(group: Any, params: list[torch.Tensor], logger: object = None) -> None:
    """``verify_params_across_processes`` (``reducer.cpp``): DDP's check that every rank
    holds parameters of the same shapes, with its tensors and collectives on the card (a
    count gathered from every rank, shapes and strides broadcast from rank 0). Every rank
    runs the same model here, so it passes."""
    device = params[0].device
    count = torch.tensor([len(params)], dtype=torch.long, device=device)
    counts = [torch.empty_like(count) for _ in range(group.size())]
    group.allgather([counts], [count]).wait()
    shapes = [n for p in params for n in (*p.shape, *p.stride())]
    on_device = torch.tensor(shapes, dtype=torch.long).to(device)
    group.broadcast([on_device]).wait()
    del on_device, counts, count  # as C++ frees its locals, the last made first


class _Logger(torch._C._distributed_c10d.Logger):
    """DDP's logger without its timing of iterations, which it cannot take on a device C++
    sees as meta (it warns that it collects time only on CPU and CUDA)."""

    def set_runtime_stats_and_log(self) -> None:
        """Nothing: no kernel runs to time."""


def ddp_patches() -> dict[tuple[Any, str], Any]:
    """``dist.Reducer`` allocating on the card, DDP's parameter check and its logger."""
    if not dist.is_available():
        return {}
    base = torch._C._distributed_c10d.Reducer
    reducer = type("Reducer", (base,), {
        name: _on_the_card(getattr(base, name)) for name in (
            "__init__", "_rebuild_buckets", "_get_zeros_like_grad_buckets",
            "_set_mixed_precision_param_dtype", "prepare_for_backward")})
    return {(dist, "Reducer"): reducer, (dist, "Logger"): _Logger,
            (dist, "_verify_params_across_processes"): verify_params}
