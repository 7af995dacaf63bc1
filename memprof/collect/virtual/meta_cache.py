"""The shapes of operator outputs on virtual tensors, computed once per input signature.

Many of PyTorch's meta kernels are Python (``torch._refs``, ``torch._prims``): a pointwise
operator's costs about 150 µs, 50 times its CPU kernel on a small tensor. A loop of small
operators (sampling a token at a time) then takes minutes on the virtual GPU. A meta
kernel's outputs depend only on its inputs' shapes, strides and dtypes and on its other
arguments, so a functional operator's outputs are remembered by that signature and made
fresh (``empty_strided`` on meta) when it comes again, as FakeTensor's dispatch cache
does. Views, in-place and ``out=`` operators, and those whose output shape depends on
values, always run their kernels.
"""

from __future__ import annotations

from typing import Any

import torch

_UNCACHED_TAGS = {getattr(torch.Tag, name) for name in (
    "dynamic_output_shape", "data_dependent_output", "inplace_view", "nondeterministic_bitwise")
    if hasattr(torch.Tag, name)}
_META = torch.device("meta")
# Signatures kept, about 1 KiB each: a training loop has a few hundred, sampling a token at a
# time a few hundred per sequence length. Past it the cache starts over (bounded memory).
_LIMIT = 20_000

_Outputs = tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]


class MetaCache:
    """Runs meta kernels, reusing the outputs' metadata of functional operators."""

    def __init__(self) -> None:
        self._cacheable: dict[Any, bool] = {}
        self._outputs: dict[tuple, tuple[_Outputs, bool]] = {}

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)`` on meta tensors."""
        cacheable = self._cacheable.get(func)
        if cacheable is None:
            cacheable = self._cacheable[func] = _is_functional(func)
        key = _key(func, args, kwargs) if cacheable else None
        if key is None:
            return func(*args, **kwargs)
        hit = self._outputs.get(key)
        if hit is not None:
            outputs, single = hit
            fresh = [torch.empty_strided(shape, stride, dtype=dtype, device=_META)
                     for shape, stride, dtype in outputs]
            return fresh[0] if single else tuple(fresh)
        out = func(*args, **kwargs)
        remembered = _outputs(out, args, kwargs)
        if remembered is not None:
            if len(self._outputs) >= _LIMIT:
                self._outputs.clear()
            self._outputs[key] = (remembered, isinstance(out, torch.Tensor))
        return out


def _is_functional(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    return (schema is not None and not schema.is_mutable and not func.is_view
            and all(r.alias_info is None for r in schema.returns)
            and not _UNCACHED_TAGS.intersection(func.tags))


def _key(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """The signature of a call: tensors by metadata, everything else as it is; None when
    an argument cannot be part of a key (a generator, say)."""
    try:
        key = (func, _signature(args), _signature(tuple(sorted(kwargs.items()))),
               torch.get_default_dtype())  # what integer division, say, returns
        hash(key)
    except TypeError:
        return None
    return key


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if not value.is_meta or type(value) is not torch.Tensor:
            raise TypeError  # only plain meta tensors: their metadata is all there is
        return (torch.Tensor, tuple(value.shape), value.stride(), value.storage_offset(),
                value.dtype, value.layout)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_signature(v) for v in value))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device,
                                           torch.layout, torch.memory_format)):
        return (type(value), value)  # typed: 1, 1.0 and True are different arguments
    raise TypeError


def _outputs(out: Any, args: tuple, kwargs: dict) -> _Outputs | None:
    """The metadata of fresh outputs, each a dense meta tensor with a storage of its own
    of exactly its size, or None: anything else is not remembered."""
    tensors = (out,) if isinstance(out, torch.Tensor) else out
    if not isinstance(tensors, tuple) or not all(
            type(t) is torch.Tensor and t.is_meta and t.layout == torch.strided
            and t.storage_offset() == 0 for t in tensors):
        return None
    inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage()._cdata for t in inputs}
    for t in tensors:
        st = t.untyped_storage()
        if st._cdata in storages or st.nbytes() != _dense_bytes(t):
            return None
        storages.add(st._cdata)
    return tuple((tuple(t.shape), t.stride(), t.dtype) for t in tensors)


def _dense_bytes(t: torch.Tensor) -> int:
    """The storage ``empty_strided`` gives a tensor of ``t``'s shape and strides."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) \
        * t.element_size()
