"""``torch.distributed`` on the virtual GPU: a process group over NCCL is refused in one line.

The virtual GPU says CUDA is available, so a script picks NCCL for its process group
(DDP, FSDP); a CPU build of PyTorch has no NCCL, and virtual tensors hold no values to
exchange. Without this the script dies on PyTorch's "Distributed package doesn't have
NCCL built in", which reads as a broken install rather than a limit of the virtual GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from memprof.collect.virtual.unsupported import VirtualGpuUnsupported


def nccl_refusal() -> dict[tuple[Any, str], Callable[..., Any]]:
    """The ``init_process_group`` replacements, by (module, attribute); none where the
    build has NCCL or no ``torch.distributed`` at all."""
    if not dist.is_available() or dist.is_nccl_available():
        return {}
    original = c10d.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        backend = kwargs.get("backend", args[0] if args else None)
        if backend is not None and "nccl" in str(backend).lower():
            raise VirtualGpuUnsupported(
                "torch.distributed over NCCL", "this PyTorch has no NCCL, and virtual CUDA"
                " tensors hold no values to exchange", "profile one process of the script"
                " without torch.distributed, or run memprof on a GPU")
        return original(*args, **kwargs)

    return {(dist, "init_process_group"): init_process_group,
            (c10d, "init_process_group"): init_process_group}
