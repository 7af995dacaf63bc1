"""Finding the tensors in an operator's arguments and the storages behind a tensor."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type


def tensors_in(obj: object) -> list[torch.Tensor]:
    """Return the tensors in `obj`, a tensor or nested lists/tuples of them."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    found: list[torch.Tensor] = []
    if isinstance(obj, (list, tuple)):
        for item in obj:
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, (list, tuple)):
                found += tensors_in(item)
    return found


_WRAPPER_TYPES: dict[type, bool] = {torch.Tensor: False}  # type -> a traceable wrapper subclass


def storages_behind(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages `t` holds: its own, or those of a wrapper subclass's inner tensors."""
    kind = type(t)
    wrapper = _WRAPPER_TYPES.get(kind)
    if wrapper is None:
        wrapper = _WRAPPER_TYPES[kind] = is_traceable_wrapper_subclass_type(kind)
    if wrapper:
        inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
        return [st for x in inner if isinstance(x, torch.Tensor) for st in storages_behind(x)]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # sparse, nested, ...: no single storage
        return []
