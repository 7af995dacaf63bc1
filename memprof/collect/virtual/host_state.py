"""Model state built on the host under the virtual GPU: real while small, storage-less when big.

A script may build its model on the CPU and then call ``.cuda()`` (the virtual GPU records
the move), or compute with it on the CPU. Parameters and buffers a module registers on
the host stay real tensors, initialised by ``nn.init`` as usual, until together they would
hold :data:`HOST_STATE_BUDGET` (256 MiB: 64M fp32 parameters, more than models trained on a
CPU have); beyond it they become storage-less host tensors (``HostVirtualTensor``) that
``nn.init`` leaves alone, and memprof says so, so a 3B-parameter model built on the host
before ``.cuda()`` never needs its 12 GB of weights, nor minutes of initialisation (256 MiB
of ``trunc_normal_`` takes 6 s on a CPU core). Every tensor that stays real is initialised,
however often: the script may compute with it on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils.hooks import RemovableHandle

from memprof.collect.notices import say
from memprof.collect.virtual.tensor import HostVirtualTensor, VirtualTensor, virtual_like
from memprof.report.units import format_bytes

HOST_STATE_BUDGET = 256 << 20

# nn.init's in-place initializers, which have nothing to fill in a virtual tensor
INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
                "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                "kaiming_normal_", "orthogonal_", "sparse_")


class HostState:
    """The registration hooks and ``nn.init`` patches of the module doc."""

    def __init__(self, budget: int = HOST_STATE_BUDGET) -> None:
        self.budget = budget
        self.kept = 0  # bytes of host parameters and buffers kept real
        self.passed = False  # the budget was passed (and memprof said so)
        # id() of the tensors kept real: no weak reference (Module._apply's swap of a
        # parameter refuses one), and a reused id only costs an initialisation
        self._real: set[int] = set()
        self._hooks: list[RemovableHandle] = []

    def patches(self) -> dict[tuple[Any, str], Callable[..., Any]]:
        """``nn.init``'s initializers, skipping virtual tensors, and real ones that would not
        fit the budget (scripts initialise a weight before they register it as a parameter,
        which then makes it storage-less): every tensor that stays real is initialised."""
        return {(torch.nn.init, name): self._within_budget(getattr(torch.nn.init, name))
                for name in INITIALIZERS}

    def install(self) -> None:
        self._hooks = [register_module_parameter_registration_hook(self._parameter),
                       register_module_buffer_registration_hook(self._buffer)]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _within_budget(self, init: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def initialise(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if isinstance(tensor, VirtualTensor) or (
                    id(tensor) not in self._real
                    and self.kept + tensor.numel() * tensor.element_size() > self.budget):
                return tensor
            return init(tensor, *args, **kwargs)
        return initialise

    def _keeps(self, t: torch.Tensor) -> bool:
        size = t.numel() * t.element_size()
        if self.kept + size > self.budget:
            if not self.passed:
                self.passed = True
                say(f"memprof: virtual GPU: the model state built on the host passed"
                    f" {format_bytes(self.budget)}; beyond it memprof keeps it without values"
                    " (for .cuda()); a script that trains on the CPU should run with --device"
                    " cpu")
            return False
        self.kept += size
        self._real.add(id(t))
        return True

    def _parameter(self, module: torch.nn.Module, name: str,
                   param: torch.nn.Parameter | None) -> torch.nn.Parameter | None:
        if type(param) is not torch.nn.Parameter or param.device.type != "cpu" \
                or self._keeps(param):
            return None
        return torch.nn.Parameter(virtual_like(param, kind=HostVirtualTensor),
                                  param.requires_grad)

    def _buffer(self, module: torch.nn.Module, name: str, buffer: torch.Tensor | None
                ) -> torch.Tensor | None:
        if type(buffer) is not torch.Tensor or buffer.device.type != "cpu" \
                or self._keeps(buffer):
            return None
        return virtual_like(buffer, kind=HostVirtualTensor)
