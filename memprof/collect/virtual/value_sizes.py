"""Operators whose output's size depends on values, which virtual tensors do not hold.

``nonzero``, and what PyTorch builds on it (``torch.where(mask)``, ``argwhere``, indexing
with a boolean mask), gets its largest size, every element selected (PyTorch's own
``meta_nonzero_assume_all_nonzero``): the prediction is an upper bound there, as said
once on stderr. An operator PyTorch cannot size without values (``unique``,
``masked_select``, ``bincount``, ...) stops the script with `unsupported_operator`'s
error, which says so and what to do instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx.experimental._config as fx_config

from memprof.collect.notices import say
from memprof.collect.virtual.unsupported import VirtualGpuUnsupported

_ASSUME_ALL = "meta_nonzero_assume_all_nonzero"
_NONZERO = torch.ops.aten.nonzero.default
_INDEX = torch.ops.aten.index.Tensor
_BY_VALUES = ("unique", "masked_select", "bincount", "repeat_interleave", "nonzero", "histc")
_told = False


def unsupported_operator(func: Any) -> VirtualGpuUnsupported:
    """The error for an operator the virtual GPU cannot run on CUDA tensors."""
    name = str(func)
    why = ("its output's size depends on the values, which virtual CUDA tensors do not hold"
           if any(word in name for word in _BY_VALUES) else "PyTorch has no meta kernel for it")
    return VirtualGpuUnsupported(f"{name} on CUDA tensors", why,
                                 "profile this script on a GPU, or its host tensors with"
                                 " --device cpu")


class LargestSizes:
    """While entered, ``nonzero`` on virtual tensors selects every element (where this
    torch has the setting; without it, ``nonzero`` is refused as ``unique`` is)."""

    def __init__(self) -> None:
        self._saved: bool | None = None

    def __enter__(self) -> LargestSizes:
        if hasattr(fx_config, _ASSUME_ALL):
            self._saved = getattr(fx_config, _ASSUME_ALL)
            setattr(fx_config, _ASSUME_ALL, True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            setattr(fx_config, _ASSUME_ALL, self._saved)
            self._saved = None


def note_sized_by_values(func: Any, args: tuple) -> None:
    """Say once that sizes set by values are taken at their largest, when ``func`` (an
    operator on virtual tensors) is one of those."""
    global _told
    if _told or not (func is _NONZERO or (func is _INDEX and _has_mask(args))):
        return
    _told = True
    say("memprof: virtual GPU: sizes that depend on values (nonzero, torch.where(mask),"
        " boolean-mask indexing) are taken at their largest, every element selected")


def _has_mask(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in indices)
