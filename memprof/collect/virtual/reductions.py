"""Staging buffers that a CUDA reduction requests from the caching allocator.

A port of PyTorch 2.11.0's ``aten/src/ATen/native/cuda/Reduce.cuh`` (the headers of
the 2.11.0+cu130 wheel, git 70d99e998b; ``setReduceConfig`` and ``ReduceConfig`` are
the same in 2.13 and, but for ``std::clamp`` in place of ``max(min())``, in 2.14.1)
and of the parts of ``TensorIterator.cpp`` that it reads (``compute_strides``,
``reorder_dimensions``, ``coalesce_dimensions``, ``num_reduce_dims``,
``can_use_32bit_indexing``, ``get_dim_to_split``/``split``). In ``gpu_reduce_kernel``:

- ``AccumulationBuffer``: when the iterator needs 64-bit indexing and ``arg_t`` is wider
  than the output type and the kernel cannot accumulate in its output (half/bf16 in
  and out, Welford, argmax), ``output extent x sizeof(arg_t)`` bytes first, held until
  every sub-kernel is queued.
- per 32-bit sub-iterator whose ``ReduceConfig::should_global_reduce()`` (each output
  split over ``ctas_per_output > 1`` blocks): ``global_memory_size()`` bytes (the CTA
  staging buffer) then ``semaphore_size()`` bytes, both freed (semaphores first) as
  soon as that kernel is queued.

``arg_t`` (``acc_itemsize``) per op, from ``SharedReduceOps.h`` and the kernels'
``.cu`` files (not in the wheel; ``ReduceSumProdKernel.cu`` read in a recent fork,
the others as they have long been): sum, nansum, prod, mean and norm
accumulate in the opmath type of the output (float for half/bf16/float, double,
complex<float> for complex32, the integer itself); amax, amin, max() and min() in the
input type; max.dim, min.dim, argmax and argmin in ``pair<acc, int64>`` (16 bytes);
var, std, var_mean and std_mean in ``WelfordData<acc, int32>`` (16 bytes for float,
32 for double); any and all in bool. All but Welford (``vt0 = 2``) use ``vt0 = 4``;
the input vector width (4, or 8 for 16-bit sums in newer sources) never changes the
staging sizes: it only narrows blocks whose threads see at most 2 x width values.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_INT32_MAX = 2**31 - 1
_MIN_VALUES_PER_THREAD = 16  # 128 on ROCm, not modelled
_MAX_VALUES_PER_THREAD = 256
_VECTORIZE_INPUT = 4  # vt0 = input_vec_size = 4 of the float sum/mean kernels


@dataclass(frozen=True)
class ReductionStaging:
    """What one reduction kernel call requests, in request order."""

    acc_buffer: int  # bytes; 0 for none. First, freed after the last launch
    launches: tuple[tuple[int, int], ...]  # (staging, semaphores) per global reduce

    def sizes(self) -> list[int]:
        """Every requested size in the order the allocator sees the requests."""
        head = [self.acc_buffer] if self.acc_buffer else []
        return head + [size for launch in self.launches for size in launch]


def max_threads_per_sm(capability: tuple[int, int]) -> int:
    """``cudaDeviceProp::maxThreadsPerMultiProcessor`` of a compute capability."""
    if capability in ((8, 6), (8, 7), (8, 9), (12, 0), (12, 1)):
        return 1536
    return 1024 if capability[0] == 7 and capability[1] >= 5 else 2048


class _Iter:
    """The reduction TensorIterator: one output (operand 0) and one input, byte strides."""

    def __init__(self, shape: list[int], out: list[int], inp: list[int], offset: int) -> None:
        self.shape, self.out, self.inp, self.offset = shape, out, inp, offset

    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    def num_output_elements(self) -> int:
        n = 1
        for size, stride in zip(self.shape, self.out, strict=True):
            if stride != 0 or size == 0:
                n *= size
        return n

    def num_reduce_dims(self) -> int:
        return sum(1 for stride in self.out if stride == 0)

    def can_use_32bit_indexing(self) -> bool:
        if self.numel() > _INT32_MAX:
            return False
        return all(1 + sum((s - 1) * st for s, st in zip(self.shape, strides, strict=True))
                   <= _INT32_MAX for strides in (self.out, self.inp))

    def split_until_32bit(self) -> list[_Iter]:
        """``SplitUntil32Bit``: halve the widest dim, first halves first."""
        if self.can_use_32bit_indexing():
            return [self]
        extents = [(max((size - 1) * abs(self.out[d]), (size - 1) * abs(self.inp[d])), d)
                   for d, size in enumerate(self.shape) if size]
        dim = max(extents)[1]  # ties: the highest dim, as it scans from the last
        first = self.shape[dim] // 2
        low = _Iter(self.shape.copy(), self.out, self.inp, self.offset)
        low.shape[dim] = first
        high = _Iter(self.shape.copy(), self.out, self.inp,
                     self.offset + self.inp[dim] * first)
        high.shape[dim] -= first
        return low.split_until_32bit() + high.split_until_32bit()


def _make_iter(shape: Sequence[int], strides: Sequence[int], reduced: set[int],
               itemsize: int, out_itemsize: int, storage_offset: int) -> _Iter:
    """``TensorIterator::reduce_op`` after ``review_reduce_result``: keepdim output."""
    ndim = len(shape)
    out_sizes = [1 if d in reduced else size for d, size in enumerate(shape)]
    contiguous, acc = [0] * ndim, 1
    for d in reversed(range(ndim)):
        contiguous[d] = acc
        acc *= max(out_sizes[d], 1)
    out = [0 if out_sizes[d] == 1 and shape[d] != 1 else contiguous[d] * out_itemsize
           for d in range(ndim)]
    inp = [stride * itemsize for stride in strides]
    # reorder_dimensions: innermost first, reduced (output stride 0) dims to the front
    perm = list(reversed(range(ndim)))

    def should_swap(d0: int, d1: int) -> int:
        for is_output, st in ((True, out), (False, inp)):
            s0, s1 = st[d0], st[d1]
            if is_output and (s0 == 0) != (s1 == 0):
                return 1 if s1 == 0 else -1
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    for i in range(1, ndim):
        j = i
        for k in range(i - 1, -1, -1):
            cmp = should_swap(perm[k], perm[j])
            if cmp > 0:
                perm[k], perm[j] = perm[j], perm[k]
                j = k
            elif cmp < 0:
                break
    it = _Iter([shape[d] for d in perm], [out[d] for d in perm], [inp[d] for d in perm],
               storage_offset * itemsize)
    # coalesce_dimensions
    if len(it.shape) > 1:
        prev = 0
        for d in range(1, len(it.shape)):
            s0, s1 = it.shape[prev], it.shape[d]
            if s0 == 1 or s1 == 1 or all(s0 * st[prev] == st[d] for st in (it.out, it.inp)):
                if s0 == 1:
                    it.out[prev], it.inp[prev] = it.out[d], it.inp[d]
                it.shape[prev] *= s1
            else:
                prev += 1
                it.out[prev], it.inp[prev], it.shape[prev] = it.out[d], it.inp[d], it.shape[d]
        del it.shape[prev + 1:], it.out[prev + 1:], it.inp[prev + 1:]
    return it


def _last_pow2(n: int) -> int:
    return max(1, 1 << (n.bit_length() - 1)) if n > 0 else 1


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _launch(it: _Iter, itemsize: int, acc_itemsize: int, sm_count: int,
            threads_per_sm: int, warp_size: int, max_threads: int) -> tuple[int, int] | None:
    """``setReduceConfig`` then ``global_memory_size``/``semaphore_size``; None: no global."""
    num_outputs = it.num_output_elements()
    num_inputs = it.numel() // num_outputs
    ndim, nred = len(it.shape), it.num_reduce_dims()
    if ndim > 0:
        fastest = nred == ndim or it.inp[0] < it.inp[nred]
        if fastest:
            dim0, dim1, stride = num_inputs, num_outputs, it.inp[0]
        else:
            dim0, dim1, stride = num_outputs, num_inputs, it.inp[nred]
    else:
        fastest, dim0, dim1, stride = True, 1, 1, itemsize
    vec_out = 1
    if stride == itemsize:
        if fastest and dim0 >= 128 and nred == 1:
            dim0 //= _VECTORIZE_INPUT
        elif not fastest:  # get_output_vec_size
            vec_out = 4
            for n in [it.offset // itemsize, it.shape[nred]] + [
                    s // itemsize for d, s in enumerate(it.inp) if d != nred]:
                while n % vec_out:
                    vec_out //= 2
            dim0 //= vec_out
    # set_block_dimension
    limit = max_threads // vec_out
    dim0_pow2 = _last_pow2(dim0) if dim0 < limit else limit
    dim1_pow2 = _last_pow2(dim1) if dim1 < limit else limit
    width = min(dim0_pow2, warp_size)
    height = min(dim1_pow2, limit // width)
    width = min(dim0_pow2, limit // height)
    step_in = step_out = 1
    if ndim == 0 or fastest:
        step_in *= width  # input_mult[BLOCK_X]: block_x_reduce
    else:
        step_out *= width
    if _div_up(num_inputs, step_in) >= min(height * 16, _MAX_VALUES_PER_THREAD):
        step_in *= height  # input_mult[BLOCK_Y] != 0
        split_warps = True
    else:
        step_out *= height
        split_warps = False
    target_grid = sm_count * (threads_per_sm // (width * height))
    grid_x = _div_up(num_outputs // vec_out, step_out)
    per_thread = _div_up(num_inputs, step_in)
    if not (split_warps and per_thread >= _MAX_VALUES_PER_THREAD and grid_x <= target_grid):
        return None
    ctas = max(min(_div_up(target_grid, grid_x), _div_up(per_thread, _MIN_VALUES_PER_THREAD)),
               _div_up(per_thread, _MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return None
    staging = acc_itemsize * num_outputs * ctas
    if not (ndim == 0 or fastest):  # no block_x_reduce: one slot per lane
        staging *= width * vec_out
    return staging, 4 * grid_x


def reduction_staging(shape: Sequence[int], strides: Sequence[int], reduced_dims: Iterable[int],
                      *, itemsize: int, out_itemsize: int, acc_itemsize: int, sm_count: int,
                      threads_per_sm: int, warp_size: int = 32, storage_offset: int = 0,
                      can_accumulate_in_output: bool = True,
                      max_block_threads: int = 512) -> ReductionStaging:
    """The allocator requests of one ``gpu_reduce_kernel`` call.

    ``shape``/``strides`` (elements) and ``storage_offset`` (elements from the start of
    a caching-allocator block, which is 512-byte aligned) describe the tensor the kernel
    reads, after any ``.to(dtype)`` that ``make_reduction`` does; ``itemsize`` is its
    element size (scalar_t), ``out_itemsize`` the output's, ``acc_itemsize`` sizeof
    ``arg_t``. ``reduced_dims`` may be negative; empty means every dim (``dim=None``
    or ``[]``). ``can_accumulate_in_output`` is False for half/bf16 in and out and for
    ops whose ``arg_t`` is not a number (Welford, argmax); ``max_block_threads`` is 256
    for complex128 inputs.
    """
    ndim = len(shape)
    reduced = {d % ndim for d in reduced_dims} if ndim else set()
    if not reduced:
        reduced = set(range(ndim))
    it = _make_iter(shape, strides, reduced, itemsize, out_itemsize, storage_offset)
    if it.numel() == 0:
        return ReductionStaging(0, ())
    acc_buffer = 0
    if (not can_accumulate_in_output and not it.can_use_32bit_indexing()
            and out_itemsize < acc_itemsize):
        extent = max([out_itemsize] + [s * st for s, st in zip(it.shape, it.out, strict=True)])
        acc_buffer = extent // out_itemsize * acc_itemsize
    launches = []
    for sub in it.split_until_32bit():
        launch = _launch(sub, itemsize, acc_itemsize, sm_count, threads_per_sm, warp_size,
                         max_block_threads)
        if launch is not None:
            launches.append(launch)
    return ReductionStaging(acc_buffer, tuple(launches))
