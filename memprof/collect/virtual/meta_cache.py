"""The shapes of operator outputs on virtual tensors, computed once per input signature.

Many of PyTorch's meta kernels are Python (``torch._refs``, ``torch._prims``): a pointwise
operator's costs about 150 µs, 50 times its CPU kernel on a small tensor. A loop of small
operators (sampling a token at a time) then takes minutes on the virtual GPU. A meta
kernel's outputs depend only on its inputs' shapes, strides and dtypes and on its other
arguments, so a functional operator's outputs are remembered by that signature and made
fresh (``empty_strided`` on meta) when it comes again, as FakeTensor's dispatch cache
does. An in-place pointwise operator (``add_``, ``sigmoid_``) changes no metadata: once a
signature has passed its kernel's checks, it returns its first argument at once. Views,
other in-place and ``out=`` operators, and those whose output shape depends on values,
always run their kernels.
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
    """Runs meta kernels, reusing the outputs' metadata of functional operators and the
    checks of in-place pointwise ones."""

    def __init__(self) -> None:
        self._kinds: dict[Any, int] = {}
        # signature -> outputs' metadata, and whether the operator returns one tensor; or
        # _RETURNS_SELF: an in-place pointwise operator that passed its checks
        self._outputs: dict[tuple, tuple[_Outputs, bool] | object] = {}

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)`` on meta tensors."""
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _kind(func)
        key = _key(func, args, kwargs) if kind else None
        if key is None:
            return func(*args, **kwargs)
        hit = self._outputs.get(key)
        if hit is _RETURNS_SELF:
            return args[0]  # an in-place pointwise operator changes no metadata
        if hit is not None:
            outputs, single = hit  # type: ignore[misc]
            fresh = [torch.empty_strided(shape, stride, dtype=dtype, device=_META)
                     for shape, stride, dtype in outputs]
            return fresh[0] if single else tuple(fresh)
        out = func(*args, **kwargs)
        if kind == _IN_PLACE:
            remembered: object = _RETURNS_SELF if out is args[0] else None
        else:
            outputs = _outputs(out, args, kwargs)
            remembered = None if outputs is None else (outputs, isinstance(out, torch.Tensor))
        if remembered is not None:
            if len(self._outputs) >= _LIMIT:
                self._outputs.clear()
            self._outputs[key] = remembered
        return out


_FUNCTIONAL, _IN_PLACE = 1, 2
_RETURNS_SELF = object()


def _kind(func: Any) -> int:
    """_FUNCTIONAL, _IN_PLACE (a pointwise operator on its first argument: ``add_``,
    ``sigmoid_``), or 0: not cached."""
    schema = getattr(func, "_schema", None)
    if schema is None or func.is_view or _UNCACHED_TAGS.intersection(func.tags):
        return 0
    if not schema.is_mutable:
        return _FUNCTIONAL if all(r.alias_info is None for r in schema.returns) else 0
    first = schema.arguments[0].alias_info if schema.arguments else None
    returns = [r.alias_info for r in schema.returns]
    in_place = (torch.Tag.pointwise in func.tags and first is not None and first.is_write
                and len(returns) == 1 and returns[0] is not None and returns[0].is_write)
    return _IN_PLACE if in_place else 0


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
