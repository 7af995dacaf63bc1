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
- cuBLASLt (``addmm`` with a bias vector, as ``nn.Linear`` calls it, ``_addmm_activation``,
  ``_scaled_mm``): up to torch 2.11 its first call on a (thread, stream) also allocates
  a **separate Lt workspace**, right after the cuBLAS one (its handle's):
  ``CUBLASLT_WORKSPACE_SIZE`` KiB, default 1 MiB, capped at the cuBLAS workspace's size,
  never freed; ``getCUDABlasLtWorkspace()`` shared the cuBLAS workspace only when
  ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` was set true (its size function took unset as
  unified, its allocator did not). Seen on an H200 with torch 2.11.0+cu130
  (``tests/fixtures/gpu``: every training run holds 32 MiB + 1 MiB from its first
  ``Linear`` and 32 MiB from the backward's first matmul). From torch 2.12
  (pytorch#175879) unset means shared: no separate block unless the variable is false.

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
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import torch

from memprof.collect.virtual.cards import Card

CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8"
CUBLAS_WORKSPACE_LARGE = 4096 * 1024 * 8  # ":4096:8", Hopper and newer
CUBLASLT_WORKSPACE_DEFAULT_KIB = 1024  # CUBLASLT_WORKSPACE_SIZE's default

# capability majors that get the 32 MiB default: Hopper (9) and Blackwell (10, 12)
_LARGE_MAJORS = frozenset({9, 10, 12})

# aten ops that call cuBLAS on CUDA (and so set up the thread's workspace)
BLAS_OPS = frozenset({
    "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "mv", "dot", "vdot",
    "_addmm_activation", "_int_mm", "_scaled_mm",
})

# aten ops that always go through cuBLASLt; ``addmm`` does when its bias is a vector
LT_OPS = frozenset({"_addmm_activation", "_scaled_mm", "_scaled_grouped_mm"})
_LT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})

_PAIR = re.compile(r":([0-9]+):([0-9]+)")
_TRUE = ("1", "true", "yes", "on", "y")
_FALSE = ("0", "false", "no", "off", "n")


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
    return _cublas_bytes(card.capability, config)


def _cublas_bytes(capability: tuple[int, int], config: str | None) -> int:
    if config is not None:
        chosen = parse_workspace_config(config)
        if chosen is not None:
            return chosen
    if capability[0] in _LARGE_MAJORS:
        return CUBLAS_WORKSPACE_LARGE
    return CUBLAS_WORKSPACE_DEFAULT


def blas_workspace_sizes(capability: tuple[int, int], env: Mapping[str, str],
                         torch_version: str = torch.__version__) -> tuple[int, int]:
    """(cuBLAS, separate cuBLASLt) workspace bytes on a card of ``capability`` under the
    environment ``env`` with ``torch_version``: what each thread's first BLAS and Lt
    calls allocate."""
    cublas = _cublas_bytes(capability, env.get("CUBLAS_WORKSPACE_CONFIG"))
    return cublas, cublaslt_workspace_bytes(
        cublas, env.get("CUBLASLT_WORKSPACE_SIZE"), env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE"),
        unified_by_default(torch_version))


def cublaslt_workspace_bytes(cublas_bytes: int, size_kib: str | None = None,
                             unified: str | None = None, unified_by_default: bool = False
                             ) -> int:
    """The separate cuBLASLt workspace PyTorch allocates per thread and stream; 0 when it
    shares the cuBLAS one. ``size_kib`` is ``$CUBLASLT_WORKSPACE_SIZE``, ``unified``
    ``$TORCH_CUBLASLT_UNIFIED_WORKSPACE`` (None when unset), ``unified_by_default``
    what an unset one means in the torch at hand (``unified_by_default``)."""
    setting = (unified or "").strip().lower()
    if setting in _TRUE or (unified_by_default and setting not in _FALSE):
        return 0
    kib = CUBLASLT_WORKSPACE_DEFAULT_KIB
    if size_kib is not None and size_kib.strip().isdigit():  # else PyTorch warns, keeps it
        kib = int(size_kib)
    return min(kib * 1024, cublas_bytes)


def unified_setting(torch_version: str) -> str:
    """The ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` that makes any torch keep cuBLASLt's
    workspace as ``torch_version`` does by default (to predict a run it recorded)."""
    return "1" if unified_by_default(torch_version) else "0"


def unified_by_default(torch_version: str) -> bool:
    """Whether an unset ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` shares the cuBLAS workspace:
    from torch 2.12 (pytorch#175879 made the allocation follow the size parsing, which
    already took unset as unified); torch 2.11 and before allocate the Lt one apart, as
    the H200's runs show."""
    major, minor = (int(part) for part in torch_version.split(".")[:2])
    return (major, minor) >= (2, 12)


def uses_cublaslt(op: str, args: tuple, kwargs: dict) -> bool:
    """Whether an aten op (bare name) runs through cuBLASLt: ``addmm`` with a bias vector
    (``addmm_out_cuda_impl``'s Lt path: beta 1, a floating dtype, matrices larger than
    one row and column), or one of ``LT_OPS``."""
    if op in LT_OPS:
        return True
    if op != "addmm" or len(args) < 3:
        return False
    bias, mat1, mat2 = args[:3]
    if not all(isinstance(t, torch.Tensor) for t in (bias, mat1, mat2)):
        return False
    vector = bias.dim() == 1 or (bias.dim() == 2 and bias.shape[0] == 1)
    return (vector and kwargs.get("beta", 1) == 1 and bias.dtype in _LT_DTYPES
            and mat1.dim() == 2 and mat2.dim() == 2 and bias.shape[-1] == mat2.shape[1]
            and mat1.shape[0] > 1 and mat2.shape[0] > 1 and mat2.shape[1] > 1)


@dataclass
class CublasWorkspaces:
    """Which (thread, stream) pairs hold a cuBLAS workspace (the first BLAS call of each
    allocates it) and a separate cuBLASLt one (the first Lt call of each, ``lt_size``
    bytes; 0 when the two are unified).

    ``thread`` is any key for the calling thread; a virtual GPU should give the backward
    pass its own key, as autograd's device thread has its own workspaces on a real card.
    """

    size: int
    lt_size: int = 0
    held: set[tuple[Hashable, int]] = field(default_factory=set)
    held_lt: set[tuple[Hashable, int]] = field(default_factory=set)

    def allocations_for(self, op_name: str, thread: Hashable, stream: int = 0,
                        args: tuple = (), kwargs: dict | None = None) -> list[int]:
        """Bytes to allocate, in order (after the op's outputs), when ``op_name`` runs
        with ``args`` and ``kwargs``; none when it calls no BLAS library or the thread
        already holds what it uses.

        ``op_name`` is an aten op, bare or qualified: ``'mm'``, ``'aten.mm.default'``.
        """
        op = op_name.removeprefix("aten.").split(".")[0]
        if op not in BLAS_OPS and op not in LT_OPS:
            return []
        key = (thread, stream)
        sizes = []
        if key not in self.held:
            self.held.add(key)
            sizes.append(self.size)
        if self.lt_size and key not in self.held_lt and uses_cublaslt(op, args, kwargs or {}):
            self.held_lt.add(key)
            sizes.append(self.lt_size)
        return sizes
