"""``torch.Generator(device="cuda")`` under the virtual GPU: a host generator that says it
is on CUDA.

A CPU build of PyTorch cannot make a CUDA generator. Random operators on virtual tensors
draw no values (their meta kernels take any generator), so a host generator stands in:
seeding and states work as on the host, and ``device`` answers the card's, ``cuda:0``. While the
virtual GPU is installed, ``torch.Generator`` is `VirtualGenerator`; every generator,
those made before included, is still an instance of it.
"""

from __future__ import annotations

from typing import Any

import torch

from memprof.collect.virtual.routing import is_cuda_device
from memprof.collect.virtual.tensor import card_device

_Generator = torch._C.Generator


class _AnyGenerator(type(_Generator)):  # type: ignore[misc]
    """``isinstance(g, torch.Generator)`` holds for every generator, not only ours."""

    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, _Generator)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _Generator)


class VirtualGenerator(_Generator, metaclass=_AnyGenerator):
    """``torch.Generator``: on CUDA, a host generator that reports ``device`` cuda:0."""

    _on_cuda = False

    def __new__(cls, device: Any = "cpu") -> VirtualGenerator:
        on_cuda = is_cuda_device(device)
        generator = super().__new__(cls, "cpu" if on_cuda else device)
        generator._on_cuda = on_cuda
        return generator

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return card_device() if self._on_cuda else _Generator.device.__get__(self)
