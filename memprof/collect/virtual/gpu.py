"""The virtual GPU for one run: CUDA made virtual, ``torch.cuda`` answering as the card.

    gpu = VirtualGpu(parse_spec("A100 40GB"), settings, settings_dict)
    with CpuRecorder(gpu.recorder), gpu:
        runpy.run_path("train.py", run_name="__main__")
    gpu.recorder.placer.layout()  # the predicted CUDA trace and segments

While entered: the routing mode makes the script's CUDA tensors virtual, the
``torch.cuda`` functions answer as the card (memory figures from the allocator model),
the optimizers take their CUDA paths (foreach by default), parameters and buffers a
module registers on the host lose their storage (``HostVirtualTensor``), ``nn.init``
fills nothing, and ``torch.compile``
returns the function unchanged, with a notice: compiled code runs eagerly.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.optimizer import _foreach_supported_types
from torch.utils.hooks import RemovableHandle

from memprof.collect.virtual import autocast
from memprof.collect.virtual.cards import Card
from memprof.collect.virtual.checkpoints import Checkpoints
from memprof.collect.virtual.cuda_api import HistoryWindow, cuda_api
from memprof.collect.virtual.recorder import VirtualRecorder
from memprof.collect.virtual.routing import CudaRouting
from memprof.collect.virtual.tensor import HostVirtualTensor, VirtualTensor, virtual_like
from memprof.trace.model import AllocatorSettings


class VirtualGpu:
    """Installs the virtual card for the duration of a ``with`` block (single use)."""

    def __init__(self, card: Card, settings: AllocatorSettings,
                 settings_dict: dict[str, Any] | None = None, announce: str | None = None
                 ) -> None:
        self.card = card
        self.recorder = VirtualRecorder(card, settings, announce)
        self.history = HistoryWindow(self.recorder, settings_dict or {})
        self._routing = CudaRouting(card)
        self._saved: dict[tuple[Any, str], Any] = {}
        self._autocast: torch.library.Library | None = None
        self._hooks: list[RemovableHandle] = []
        self._checkpoints = Checkpoints()

    def __enter__(self) -> VirtualGpu:
        patches = cuda_api(self.card, self.recorder, self.history)
        patches[(torch, "compile")] = _eager_compile
        patches[(torch, "clear_autocast_cache")] = _clear_autocast_cache
        for name in _INITIALIZERS:
            patches[(torch.nn.init, name)] = _no_init
        patches.update(self._checkpoints.patches())
        # on the tensor, not in the routing mode: DataLoader pins batches on a thread of its
        # own, where the (thread-local) mode does not reach
        patches[(torch.Tensor, "pin_memory")] = _pinned
        for (owner, name), value in patches.items():
            self._saved[(owner, name)] = getattr(owner, name)
            setattr(owner, name, value)
        _foreach_supported_types.append(VirtualTensor)
        VirtualTensor.on_create = self.recorder.adopt
        self._hooks = [register_module_parameter_registration_hook(_host_parameter),
                       register_module_buffer_registration_hook(_host_buffer)]
        self._autocast = autocast.install()
        self._checkpoints.install()
        self._routing.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._routing.__exit__(None, None, None)
        self._checkpoints.remove()
        if self._autocast is not None:
            self._autocast._destroy()
        autocast.clear_cache()
        VirtualTensor.on_create = None
        for hook in self._hooks:
            hook.remove()
        _foreach_supported_types.remove(VirtualTensor)
        for (owner, name), value in self._saved.items():
            setattr(owner, name, value)
        self._saved.clear()


# nn.init's in-place initializers: values do not exist, and filling a model built on the
# host would cost the time and RAM the virtual GPU saves (a 3B model: minutes, GBs)
_INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
                 "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                 "kaiming_normal_", "orthogonal_", "sparse_")


def _pinned(tensor: torch.Tensor, device: object = None) -> torch.Tensor:
    """``pin_memory()``: the host tensor itself (a CPU build cannot pin)."""
    return tensor


def _no_init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


def _host_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None
                    ) -> torch.nn.Parameter | None:
    """A parameter made on the host becomes storage-less: a model built on the CPU and then
    moved to the GPU never holds its weights in host memory."""
    if type(param) is not torch.nn.Parameter or param.device.type != "cpu":
        return None
    return torch.nn.Parameter(virtual_like(param, kind=HostVirtualTensor), param.requires_grad)


def _host_buffer(module: torch.nn.Module, name: str, buffer: torch.Tensor | None
                 ) -> torch.Tensor | None:
    if type(buffer) is not torch.Tensor or buffer.device.type != "cpu":
        return None
    return virtual_like(buffer, kind=HostVirtualTensor)


_clear_cpp_autocast_cache = torch.clear_autocast_cache


def _clear_autocast_cache() -> None:
    _clear_cpp_autocast_cache()
    autocast.clear_cache()


def _eager_compile(model: Any = None, **kwargs: Any) -> Any:
    """``torch.compile`` under the virtual GPU: the function itself, run eagerly."""
    print("memprof: virtual GPU: torch.compile ran the model eagerly; compiled kernels'"
          " memory (fusion, the partitioner's saved activations) is not predicted",
          file=sys.stderr)
    if model is None:
        return lambda fn: fn
    return model
