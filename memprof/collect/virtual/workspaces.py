"""Device memory a real card allocates through the caching allocator that is no user tensor.

What the ground-truth snapshots show (``../shared/fixtures/groundtruth``, 22 runs of
CS336 language models on torch 2.6 and 2.11, none with a convolution): the only such
allocation is **the cuBLAS workspace**, and it behaves exactly as PyTorch's
``aten/src/ATen/cuda/CublasHandlePool.cpp`` says:

- Size: ``getChosenWorkspaceSize()``: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KIB:COUNT``
  pairs, summed) if set, else ``:4096:8`` = 32 MiB on Hopper (capability 9.x; since
  PyTorch 2.0) and, in builds after pytorch#175344 (2026), Blackwell (10.x, 12.x),
  else ``:4096:2:16:8`` = 8,519,680 bytes. Every ground-truth run allocates
  8,519,680 bytes: none of those GPUs was a Hopper.
- When: at the first cuBLAS call (``mm``, ``bmm``, ``addmm``, ``einsum``'s ``bmm``,
  ...) of each (thread, device, stream): the workspace map is ``thread_local``. The
  block is requested right after that call's output tensor, with the call's stack.
  Autograd runs a CUDA backward on its own device thread, so a training run holds
  **two**: the forward's (first matmul of the script) and the backward's (first matmul
  of the first backward, no Python frames). Inference holds one.
- Lifetime: never freed (until ``torch._C._cuda_clearCublasWorkspaces()``); it stays
  allocated, so it counts in ``memory_allocated()`` and every peak.
- cuBLASLt (``addmm`` with bias, bf16 epilogues, ``_scaled_mm``): on CUDA builds the Lt
  workspace is unified with the cuBLAS one by default
  (``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` unset), so it adds no allocation. With
  ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0`` it is separate: ``CUBLASLT_WORKSPACE_SIZE``
  KiB, default 1 MiB, per (thread, device, stream) too.

The fixtures show one more kind, not modelled here yet: **the staging buffer of a
global reduction** (``aten/src/ATen/native/cuda/Reduce.cuh``: when a reduction splits
each output across several blocks, ``ReduceConfig::global_memory_size()`` bytes of
accumulators and ``semaphore_size()`` bytes of semaphores come from the caching
allocator, right after the output, and are freed when the kernel is queued). In
NiuHuangxiaozi's training runs every RMSNorm weight gradient (512 outputs summed over
batch x sequence rows) makes one: 6 MiB + 16 B at 1,500 rows, 8 MiB + 16 B at 2,000,
none at 1,000; 9 norms x 3 steps = 27 per run. Their size follows the launch
configuration (``setReduceConfig``: block shape, SM count), so a model needs that logic.

Not learnt from the fixtures (none has them): cuDNN convolution workspaces (allocated
and freed inside the op, size chosen by the algorithm search) and NCCL buffers (outside
the caching allocator).
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from dataclasses import dataclass, field

from memprof.collect.virtual.cards import Card

CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8"
CUBLAS_WORKSPACE_LARGE = 4096 * 1024 * 8  # ":4096:8", Hopper and newer
CUBLASLT_WORKSPACE_SEPARATE = 1024 * 1024  # CUBLASLT_WORKSPACE_SIZE default (KiB 1024)

# capability majors that get the 32 MiB default: Hopper (9) and Blackwell (10, 12)
_LARGE_MAJORS = frozenset({9, 10, 12})

# aten ops that call cuBLAS on CUDA (and so set up the thread's workspace)
BLAS_OPS = frozenset({
    "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "mv", "dot", "vdot",
    "_addmm_activation", "_int_mm", "_scaled_mm",
})

_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def parse_workspace_config(config: str) -> int | None:
    """Bytes ``CUBLAS_WORKSPACE_CONFIG`` asks for (``':4096:8'``: 32 MiB); None if unparsable."""
    pairs = _PAIR.findall(config)
    if not pairs:
        return None  # PyTorch warns and uses the default
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def cublas_workspace_bytes(card: Card, config: str | None = None) -> int:
    """The cuBLAS workspace PyTorch allocates per thread and stream on ``card``.

    ``config`` is ``$CUBLAS_WORKSPACE_CONFIG`` (None when unset).
    """
    if config is not None:
        chosen = parse_workspace_config(config)
        if chosen is not None:
            return chosen
    if card.capability[0] in _LARGE_MAJORS:
        return CUBLAS_WORKSPACE_LARGE
    return CUBLAS_WORKSPACE_DEFAULT


@dataclass
class CublasWorkspaces:
    """Which (thread, stream) pairs hold a cuBLAS workspace: the first BLAS call of each allocates.

    ``thread`` is any key for the calling thread; a virtual GPU should give the backward
    pass its own key, as autograd's device thread has its own workspace on a real card.
    """

    size: int
    held: set[tuple[Hashable, int]] = field(default_factory=set)

    def allocation_for(self, op_name: str, thread: Hashable, stream: int = 0) -> int:
        """Bytes to allocate (after the op's outputs) when ``op_name`` runs; 0 if none.

        ``op_name`` is an aten op, bare or qualified: ``'mm'``, ``'aten.mm.default'``.
        """
        op = op_name.removeprefix("aten.").split(".")[0]
        if op not in BLAS_OPS or (thread, stream) in self.held:
            return 0
        self.held.add((thread, stream))
        return self.size
