"""Device memory a CUDA kernel requests that its meta kernel does not show.

A meta kernel returns outputs; the CUDA kernel behind it may also request scratch memory
from the caching allocator while it is queued, and an output may sit on a larger storage
than its shape needs. Both were seen on a real card (``tests/fixtures/gpu``, an H200 with
torch 2.11.0+cu130):

- **Reductions** (``sum``, ``mean``, ``amax``, ``var``, ``argmax``, ...) that split each
  output over several blocks stage their partial results in a buffer and count finished
  blocks in semaphores, both requested right after the output and freed once the kernel
  is queued (``reductions.py`` ports the sizing). A ``Linear``'s bias gradient over a
  large batch stages up to (SM count) x (outputs) x (block width) floats: 132 MiB for
  2,048 outputs on an H200.
- **``mse_loss``** with a reduction is a structured kernel whose meta function first
  sizes its output as the elementwise loss, then as a scalar: the scalar keeps the
  elementwise storage. Its CUDA kernel then computes the elementwise loss into a
  temporary of that size, reduces it into the output, and frees it.
- **Embeddings.** The forward flattens its indices (``indices.reshape(-1)``: a copy when
  they are not contiguous, as ``tokens[:, :-1]`` is). The backward on more than 3,072
  indices (``embedding_dense_backward_cuda``) sorts them and sums each row's gradient by
  segments (``EmbeddingBackwardKernel.cu``): index buffers of n entries, and a gradient
  per partial segment of (n / 10 + min(n, V)) rows in the accumulation type, freed at
  once (27.7 MB for 8,192 tokens of GPT-2's 768 wide embedding). Where few rows would
  leave the card idle (a character model's 65), it accumulates atomically instead, with
  an index per partial segment (and, for 16-bit gradients, an fp32 copy of the weight's
  gradient). CUB's temporary storage for the sort and scans (150,015 and 1,279 bytes
  there) is fit to what the H200 requested.
- **Memory-efficient attention's backward** (``_efficient_attention_backward``) needs each
  row's ``delta``, an fp32 (B, H, M) tensor held through the kernel: 16-bit kernels fill
  an empty one; fp32 ones compute it in ATen from an fp32 product of the output and its
  gradient, summed over the head dim. Its workspace accumulates dQ over key splits in
  tiles of 64 rows (``cutlassB.h``'s kernels): B x H x ceil(M / 64) x ceil(D / w) x
  (64 x w + 4) floats, w = 64 up to head dim 64 (24 MiB per GPT-2-small layer) and 128
  above (+ 2 for 16-bit kernels, whose heads above 128 are not modelled). A gradient not
  laid out (B, M, H, D) is copied first. All measured on the H200
  (``benchmarks/kernel_scratch_probe.py``).
- **cuDNN's attention** (``MHA.cpp``; 316 cases on the H200, every one to the byte:
  ``benchmarks/kernel_scratch_probe.py``) runs its forward plan with a 256-byte workspace,
  freed at once. Its backward's one workspace holds dQ's fp32 accumulator (B, H, S_q,
  D_qk), the softmax sums (B, H, S_q) in fp32, the plan's 256 bytes and, for
  grouped-query attention, dK and dV over every query head in the input dtype.
- **Foreach norms** (``clip_grad_norm_``) stage each chunk's partial norm.
- **Flash attention's backward** (FA2's ``mha_bwd`` in ``flash_api.cpp``, read, not seen
  on a card: the H200's torch 2.11 ran cuDNN's attention, whose one block, dQ's
  accumulator and the softmax sums, is as large) holds ``softmax_d``, fp32 (B, H,
  round128(S)), and accumulates dQ in fp32 (B, round128(S), H, D rounded to 32, or to 64
  above 128), freed in reverse when it returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from memprof.collect.virtual.cards import Card
from memprof.collect.virtual.reductions import max_threads_per_sm, reduction_staging

# accumulator (arg_t) bytes per op: None means the opmath type of the output
_OPMATH = {"sum", "nansum", "prod", "mean", "linalg_vector_norm", "norm"}
_INPUT_TYPE = {"amax", "amin"}
_PAIRED = {"argmax", "argmin"}  # pair<value, int64> (16 bytes); max.dim/min.dim too
_WELFORD = {"var", "std", "var_mean", "std_mean"}
_BOOLEAN = {"any", "all"}
_HALF = (torch.float16, torch.bfloat16)
# every op name ``scratch`` looks at: the rest pass by at the cost of a set lookup
NAMES = frozenset({*_OPMATH, *_INPUT_TYPE, *_PAIRED, *_WELFORD, *_BOOLEAN, "max", "min",
                   "mse_loss", "embedding", "embedding_dense_backward",
                   "_scaled_dot_product_efficient_attention_backward",
                   "_scaled_dot_product_flash_attention_backward",
                   "_scaled_dot_product_cudnn_attention",
                   "_scaled_dot_product_cudnn_attention_backward",
                   "_scaled_dot_product_flash_attention", "_foreach_norm"})
_FOREACH_CHUNK = 65536  # elements per multi_tensor_apply chunk
_CUDNN_PLAN = 256  # bytes of cuDNN's own attention plans' workspace
_SORTED_BACKWARD = 3072  # more indices than this: embedding_dense_backward sorts them
_ROWS_PER_THREAD, _ATOMIC_BLOCKS_PER_SM, _MAX_BLOCK = 10, 4, 1024  # EmbeddingBackwardKernel.cu


@dataclass(frozen=True)
class Scratch:
    """What a kernel requests beyond its outputs, in request order. A step is a block held
    to the kernel's end (an int) or a launch's blocks, freed (last first) once queued (a
    tuple); held blocks are freed last first when the kernel returns."""

    steps: tuple[int | tuple[int, ...], ...] = ()  # after the outputs are made
    early: tuple[int | tuple[int, ...], ...] = ()  # before them: copies, sorts


def output_storage_bytes(func: torch._ops.OpOverload, args: tuple) -> int | None:
    """The storage a reduced ``mse_loss`` returns its scalar on: the elementwise loss's."""
    if func._opname != "mse_loss" or _loss_reduction(args) == 0:
        return None
    return _elementwise_bytes(args)


def scratch(func: torch._ops.OpOverload, args: tuple, kwargs: dict, card: Card
            ) -> Scratch | None:
    """What ``func`` requests on ``card`` beyond its outputs; None for nothing."""
    name, overload = func._opname, func._overloadname
    if name == "mse_loss":
        if _loss_reduction(args) == 0:
            return None
        dtype = args[0].dtype
        shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
        held, launches = _staging(shape, _contiguous(shape), (), dtype, dtype,
                                  4 if dtype in _HALF else args[0].element_size(), card,
                                  can_accumulate=dtype not in _HALF)
        return Scratch((_elementwise_bytes(args), *held, *launches))
    if name == "embedding":
        return _embedding(args)
    if name == "embedding_dense_backward":
        return _embedding_backward(args, card)
    if name == "_scaled_dot_product_efficient_attention_backward":
        return _efficient_attention_backward(args, card)
    if name == "_scaled_dot_product_flash_attention_backward":
        return _flash_attention_backward(args)
    if name == "_scaled_dot_product_flash_attention":
        return _flash_attention_forward(args, card)
    if name == "_foreach_norm":
        return _foreach_norm(args)
    if name == "_scaled_dot_product_cudnn_attention":
        return Scratch(((_CUDNN_PLAN,),))
    if name == "_scaled_dot_product_cudnn_attention_backward":
        return _cudnn_attention_backward(args)
    acc = _accumulator_bytes(name, overload, args, kwargs)
    if acc is None or not args or not isinstance(args[0], torch.Tensor):
        return None
    t = args[0]
    out_dtype = kwargs.get("dtype") or t.dtype
    held, launches = _staging(
        t.shape, t.stride(), _reduced_dims(name, overload, args, kwargs), t.dtype, out_dtype,
        acc, card, t.storage_offset(),
        can_accumulate=not (name in _PAIRED or name in _WELFORD
                            or (overload == "dim" and name in ("max", "min"))
                            or (t.dtype in _HALF and out_dtype in _HALF)))
    return Scratch((*held, *launches)) if held or launches else None


def _embedding(args: tuple) -> Scratch | None:
    """``embedding(weight, indices)``: the flattened copy of indices that are not
    contiguous, made before the output and freed once the rows are gathered."""
    indices = args[1]
    if indices.is_contiguous():
        return None
    return Scratch(early=(indices.numel() * indices.element_size(),))


def _embedding_backward(args: tuple, card: Card) -> Scratch | None:
    """``embedding_dense_backward(grad, indices, num_weights, padding_idx, by_freq)``: a
    contiguous copy of a strided gradient; on the sorting path its index buffers, held to
    the end, and the range and the sort's temporary storage, the unique keys' copy and
    the scan's, and the per-segment gradient (or the atomic path's buffers), each freed at
    once."""
    grad, indices, num_weights = args[0], args[1], args[2]
    n, index = indices.numel(), indices.element_size()
    copied = () if grad.is_contiguous() else (grad.numel() * grad.element_size(),)
    by_freq = len(args) > 4 and bool(args[4])
    if n <= _SORTED_BACKWARD and not by_freq:
        return Scratch(early=copied) if copied else None
    rows = min(n, num_weights)
    partial = n // _ROWS_PER_THREAD + rows
    acc = 8 if grad.dtype == torch.float64 else 4
    width = grad.shape[-1]
    warped = -(-width // 32) * 32
    scatter_blocks = -(-rows * warped // min(warped, _MAX_BLOCK))
    if (scatter_blocks < card.sm_count * _ATOMIC_BLOCKS_PER_SM
            and partial > scatter_blocks * 4 and not torch.are_deterministic_algorithms_enabled()):
        # the fused kernel: partial segments' owners, and the fp32 sums of 16-bit gradients
        last = (partial * index, *((num_weights * width * 4,) if grad.dtype in _HALF else ()))
    else:
        last = (partial * width * acc,)
    if not indices.is_contiguous():
        copied += (n * index,)
    # sorted before the gradient (the output) is made: the sorted indices, their positions
    sort = (*copied, n * index, n * index, (n * index, _radix_sort_bytes(n, index)))
    return Scratch((n * index, 8, (n * index, _scan_bytes(n, 1024)),  # segments, their count
                    rows * index, rows * index, (_scan_bytes(rows, 512),),  # partials, offsets
                    8, partial * index, last), sort)  # their count, partial segment offsets


def _radix_sort_bytes(n: int, index: int) -> int:
    """CUB's temporary storage to sort ``n`` index/position pairs: a second buffer for each,
    and tile counters (fit to the H200's 83,455, 150,015 and 283,135 bytes at 4,096, 8,192
    and 16,384 int64 indices, for vocabularies of 65 to 50,304)."""
    return 2 * index * n + n // 4 + 16_895


def _scan_bytes(items: int, tile: int) -> int:
    """CUB's temporary storage for a scan (``tile`` 512) or unique-by-key (1,024) over
    ``items``: tile states, aligned (fit to the H200's 1,279 bytes for scans up to 8,192
    items and unique-by-key up to 16,384, 1,535 for a scan of 16,384)."""
    return -(-16 * (-(-items // tile) + 48) // 256) * 256 + 255


def _efficient_attention_backward(args: tuple, card: Card) -> Scratch:
    """``_scaled_dot_product_efficient_attention_backward(grad_out, q, k, v, ...)``, its
    tensors (B, H, M, D): a copy of a gradient not laid out (B, M, H, D), ``delta`` and,
    for fp32, its product and sum, and the dQ accumulator; the gradients are its outputs."""
    grad_out, query, value = args[0], args[1], args[3]
    batch, heads, rows, dim = query.shape
    copied = _bshd_copy(grad_out)
    delta = batch * heads * rows * 4
    launches: tuple[tuple[int, ...], ...] = ()
    if query.dtype == torch.float32:  # freed: the sum, the product
        launches = ((batch * rows * heads * value.shape[-1] * 4, delta),)
    tile = _dq_tile(query.dtype, dim, card)
    if tile is not None:
        width, floats = tile
        tiles = -(-rows // 64) * -(-dim // width) * floats
        launches += ((batch * heads * (-(-tiles // 4) * 4) * 4,),)
    return Scratch((delta, *launches), copied)


def _bshd_copy(grad_out: torch.Tensor) -> tuple[int, ...]:
    """The copy a fused attention backward makes of a gradient (B, H, S, D) whose memory is
    not laid out (B, S, H, D), as its kernels read it; () for none."""
    if grad_out.transpose(1, 2).is_contiguous():
        return ()
    return (grad_out.numel() * grad_out.element_size(),)


def _dq_tile(dtype: torch.dtype, dim: int, card: Card) -> tuple[int, int] | None:
    """The head-dim width of memory-efficient attention's dQ accumulator tiles (64 rows),
    and each tile's floats with its counters, as the H200 allocated them (``cutlassB.h``'s
    kernels: 64 wide up to head dim 64, 128 wide above; 16-bit heads above 128 are not
    modelled); None for none."""
    if dim <= 64:
        return (64, 64 * 64 + 4) if card.capability >= (7, 0) else None
    if card.capability < (8, 0):
        return None
    if dtype == torch.float32:
        return 128, 64 * 128 + 4
    return (128, 64 * 128 + 2) if dim <= 128 else None


def _flash_attention_forward(args: tuple, card: Card) -> Scratch | None:
    """``_scaled_dot_product_flash_attention(q, k, v, dropout_p, ...)``, q (B, H, S, D):
    without dropout, FA2 splits the keys when too few query blocks would fill the card,
    accumulating the output and logsumexp per split in fp32; with dropout it makes its
    RNG state once more."""
    query, key = args[0], args[1]
    dropout = args[3] if len(args) > 3 else 0.0
    if dropout > 0:
        return Scratch(((16,),))
    batch, heads, rows, dim = query.shape
    splits = _flash_splits(batch * heads * -(-rows // 64), 2 * card.sm_count,
                           -(-key.shape[2] // (256 if dim <= 64 else 128 if dim <= 128 else 64)))
    if splits == 1:
        return None
    lse = splits * batch * heads * rows * 4
    return Scratch(((lse, lse * _rounded_head(dim)),))


def _flash_splits(blocks: int, sm_slots: int, key_blocks: int, most: int = 128) -> int:
    """FA2's ``num_splits_heuristic``: the fewest key splits within 85% of the best wave
    efficiency, once the query blocks would fill less than 80% of the card."""
    if blocks >= 0.8 * sm_slots:
        return 1
    most = min(most, sm_slots, key_blocks)
    eligible = [n for n in range(1, most + 1)
                if n == 1 or -(-key_blocks // n) != -(-key_blocks // (n - 1))]
    efficiency = {n: blocks * n / sm_slots / math.ceil(blocks * n / sm_slots) for n in eligible}
    best = max(efficiency.values())
    return next(n for n in eligible if efficiency[n] >= 0.85 * best)


def _rounded_head(dim: int) -> int:
    step = 32 if dim <= 128 else 64
    return -(-dim // step) * step


def _flash_attention_backward(args: tuple) -> Scratch:
    """``_scaled_dot_product_flash_attention_backward(grad_out, q, ...)``, q (B, H, S, D):
    a copy of a gradient not laid out (B, S, H, D), ``softmax_d`` held, dQ's accumulator
    freed first."""
    grad_out = args[0]
    batch, heads, rows, dim = args[1].shape
    copied = _bshd_copy(grad_out)
    rows = -(-rows // 128) * 128
    return Scratch((batch * heads * rows * 4, (batch * rows * heads * _rounded_head(dim) * 4,)),
                   copied)


def _foreach_norm(args: tuple) -> Scratch | None:
    """``_foreach_norm(tensors, ord)`` (clip_grad_norm_'s): each chunk's partial norm, in
    the accumulation type, zeroed before the per-tensor results and freed after (1,404
    bytes for nanoGPT's 39 gradients, 9 chunks at most, on the H200)."""
    tensors = [t for t in args[0] if t is not None]
    if not tensors or tensors[0].dtype not in (torch.float32, torch.float64, *_HALF):
        return None
    acc = 8 if tensors[0].dtype == torch.float64 else 4
    chunks = max(-(-t.numel() // _FOREACH_CHUNK) for t in tensors)
    return Scratch(early=(len(tensors) * chunks * acc,))


def _cudnn_attention_backward(args: tuple) -> Scratch:
    """``_scaled_dot_product_cudnn_attention_backward(grad_out, q, k, v, ...)``, q (B, H,
    S_q, D_qk), k (B, H_kv, S_k, D_qk), v (B, H_kv, S_k, D_v): one workspace, freed at once."""
    query, key, value = args[1], args[2], args[3]
    batch, heads, rows, dim = query.shape
    workspace = batch * heads * rows * (dim + 1) * 4 + _CUDNN_PLAN
    if key.shape[1] != heads:  # grouped-query: dK and dV over every query head
        workspace += (batch * heads * key.shape[2] * (dim + value.shape[-1])
                      * query.element_size())
    return Scratch(((workspace,),))


def _accumulator_bytes(name: str, overload: str, args: tuple, kwargs: dict) -> int | None:
    t = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if t is None:
        return None
    if name in ("max", "min"):
        return 16 if overload == "dim" else t.element_size() if overload == "default" else None
    if name in _OPMATH:
        out = kwargs.get("dtype") or t.dtype
        return 4 if out in _HALF else torch.empty((), dtype=out, device="meta").element_size()
    if name in _INPUT_TYPE:
        return t.element_size()
    if name in _PAIRED:
        return 16
    if name in _WELFORD:
        return 32 if t.dtype == torch.float64 else 16
    if name in _BOOLEAN:
        return 1
    return None


def _reduced_dims(name: str, overload: str, args: tuple, kwargs: dict) -> tuple[int, ...]:
    """The dims an aten reduction reduces; () means all of them."""
    if overload == "default" and name in ("sum", "mean", "prod", "max", "min", "any", "all"):
        return ()
    at = 2 if name in ("linalg_vector_norm", "norm") else 1  # after ``ord``
    dim = kwargs.get("dim", args[at] if len(args) > at else None)
    if dim is None or isinstance(dim, bool):  # var.default(self, unbiased): every dim
        return ()
    return (dim,) if isinstance(dim, int) else tuple(dim)


def _staging(shape: torch.Size, strides: tuple[int, ...], dims: tuple[int, ...],
             dtype: torch.dtype, out_dtype: torch.dtype, acc: int, card: Card,
             offset: int = 0, can_accumulate: bool = True
             ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(held, launches) of one reduction kernel: its accumulation buffer, if any, and
    each launch's staging buffer and semaphores."""
    itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
    out_itemsize = torch.empty((), dtype=out_dtype, device="meta").element_size()
    staged = reduction_staging(
        list(shape), list(strides), dims, itemsize=itemsize, out_itemsize=out_itemsize,
        acc_itemsize=acc, sm_count=card.sm_count,
        threads_per_sm=max_threads_per_sm(card.capability), storage_offset=offset,
        can_accumulate_in_output=can_accumulate,
        max_block_threads=256 if dtype == torch.complex128 else 512)
    return ((staged.acc_buffer,) if staged.acc_buffer else ()), staged.launches


def _loss_reduction(args: tuple) -> int:
    return args[2] if len(args) > 2 else 1  # Reduction::Mean by default


def _elementwise_bytes(args: tuple) -> int:
    shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
    return shape.numel() * args[0].element_size()


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
