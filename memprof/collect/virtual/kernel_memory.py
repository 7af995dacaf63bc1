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
  once (27.7 MB for 8,192 tokens of GPT-2's 768 wide embedding). CUB's temporary storage
  for the sort and scans (150,015 and 1,279 bytes there) is not modelled.
- **Memory-efficient attention's backward** (``_efficient_attention_backward``) needs each
  row's ``delta``, an fp32 (B, H, M) tensor held through the kernel: 16-bit kernels fill
  an empty one; fp32 ones compute it in ATen from an fp32 product of the output and its
  gradient, summed over the head dim. Its workspace accumulates dQ over key splits in
  64 x 64 tiles for fp32 heads of up to 64 (``cutlassB.h``'s first fit): B x H x
  ceil(M / 64) x ceil(D / 64) x (64 x 64 + 4) floats, 24 MiB per GPT-2-small layer; other
  kernels' tiles are not modelled.
- **Flash attention's backward** (FA2's ``mha_bwd`` in ``flash_api.cpp``, read, not seen
  on a card: the H200's torch 2.11 ran cuDNN's attention, whose one block, dQ's
  accumulator and the softmax sums, is as large) holds ``softmax_d``, fp32 (B, H,
  round128(S)), and accumulates dQ in fp32 (B, round128(S), H, D rounded to 32, or to 64
  above 128), freed in reverse when it returns.
"""

from __future__ import annotations

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
                   "_scaled_dot_product_flash_attention_backward"})
_SORTED_BACKWARD = 3072  # more indices than this: embedding_dense_backward sorts them


@dataclass(frozen=True)
class Scratch:
    """What a kernel requests beyond its outputs, in request order."""

    held: tuple[int, ...] = ()  # requested first, freed after every launch
    launches: tuple[tuple[int, ...], ...] = ()  # each freed (last first) once queued


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
        return Scratch((_elementwise_bytes(args), *held), launches)
    if name == "embedding":
        return _embedding(args)
    if name == "embedding_dense_backward":
        return _embedding_backward(args)
    if name == "_scaled_dot_product_efficient_attention_backward":
        return _efficient_attention_backward(args, card)
    if name == "_scaled_dot_product_flash_attention_backward":
        return _flash_attention_backward(args)
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
    return Scratch(held, launches) if held or launches else None


def _embedding(args: tuple) -> Scratch | None:
    """``embedding(weight, indices)``: the flattened copy of indices that are not
    contiguous, freed once the rows are gathered."""
    indices = args[1]
    if indices.is_contiguous():
        return None
    return Scratch((), ((indices.numel() * indices.element_size(),),))


def _embedding_backward(args: tuple) -> Scratch | None:
    """``embedding_dense_backward(grad, indices, num_weights, padding_idx, by_freq)``
    on the sorting path: its index buffers, held to the end, and the range, the unique
    keys' copy and the per-segment gradient, each freed at once."""
    grad, indices, num_weights = args[0], args[1], args[2]
    n, index = indices.numel(), indices.element_size()
    by_freq = len(args) > 4 and bool(args[4])
    if n <= _SORTED_BACKWARD and not by_freq:
        return None
    rows = min(n, num_weights)
    partial = n // 10 + rows
    acc = 8 if grad.dtype == torch.float64 else 4
    copied = () if indices.is_contiguous() else (n * index,)
    held = (*copied, n * index, n * index,  # the sorted indices and their positions
            n * index, 8,  # segment offsets and their count
            rows * index, rows * index, 8,  # partials per segment, their offsets, count
            partial * index)  # partial segment offsets
    launches = ((n * index,), (n * index,), (partial * grad.shape[-1] * acc,))
    return Scratch(held, launches)


def _efficient_attention_backward(args: tuple, card: Card) -> Scratch:
    """``_scaled_dot_product_efficient_attention_backward(grad_out, q, k, v, ...)``, its
    tensors (B, H, M, D): ``delta`` and, for fp32, its product and sum and the dQ
    accumulator; the gradients are its outputs."""
    query, value = args[1], args[3]
    batch, heads, rows, dim = query.shape
    delta = batch * heads * rows * 4
    if query.dtype != torch.float32:
        return Scratch((delta,))
    product = batch * rows * heads * value.shape[-1] * 4
    launches: tuple[tuple[int, ...], ...] = ((product, delta),)  # freed: the sum, the product
    if dim <= 64 and card.capability >= (7, 0):  # keys split: dQ accumulates in tiles
        tiles = -(-rows // 64) * -(-dim // 64) * (64 * 64 + 4)
        launches += ((batch * heads * (-(-tiles // 4) * 4) * 4,),)
    return Scratch((delta,), launches)


def _flash_attention_backward(args: tuple) -> Scratch:
    """``_scaled_dot_product_flash_attention_backward(grad_out, q, ...)``, q (B, H, S, D):
    ``softmax_d`` held, dQ's accumulator freed first."""
    batch, heads, rows, dim = args[1].shape
    rows = -(-rows // 128) * 128
    step = 32 if dim <= 128 else 64
    dim = -(-dim // step) * step
    return Scratch((batch * heads * rows * 4,), ((batch * rows * heads * dim * 4,),))


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
