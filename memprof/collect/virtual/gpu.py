"""The virtual GPU for one run: CUDA made virtual, ``torch.cuda`` answering as the card.

    gpu = VirtualGpu(parse_spec("A100 40GB"), settings, settings_dict)
    with CpuRecorder(gpu.recorder), gpu:
        runpy.run_path("train.py", run_name="__main__")
    gpu.recorder.placer.layout()  # the predicted CUDA trace and segments

While entered: the routing mode makes the script's CUDA tensors virtual, the
``torch.cuda`` functions answer as the card (memory figures from the allocator model),
the optimizers take their CUDA paths (foreach by default), model state built on the host
is real while small and storage-less when big (``host_state.py``), checkpoints save and
load (``checkpoints.py``), ``torch.Generator(device="cuda")`` is a host generator that says
it is on CUDA (``generators.py``), sizes that depend on values are taken at their largest
(``value_sizes.py``), CUDA graphs capture into private pools and replay without allocating
(``cuda_graphs.py``), process groups get a backend whose collectives move no data
(``distributed.py``, ``collectives.py``; DDP's reducer allocates on the card: ``ddp.py``),
and ``torch.compile`` returns the function unchanged, with a notice: compiled code runs
eagerly. In a rank of a virtual cluster the card is ``cuda:LOCAL_RANK``.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch.optim.optimizer import _foreach_supported_types
from torch.overrides import _get_current_function_mode_stack
from torch.utils import _foreach_utils

from memprof.analysis.blocks import MIN_BLOCK
from memprof.collect.launch.eager_compile import EagerCompile
from memprof.collect.launch.threads import inherited
from memprof.collect.notices import say
from memprof.collect.virtual import autocast
from memprof.collect.virtual.cards import Card
from memprof.collect.virtual.checkpoints import Checkpoints
from memprof.collect.virtual.cuda_api import HistoryWindow, cuda_api
from memprof.collect.virtual.cuda_graphs import CudaGraphs
from memprof.collect.virtual.data_parallel import data_parallel_patches
from memprof.collect.virtual.ddp import ddp_patches
from memprof.collect.virtual.distributed import ProcessGroups
from memprof.collect.virtual.extensions import Extensions
from memprof.collect.virtual.generators import VirtualGenerator
from memprof.collect.virtual.host_state import HostState
from memprof.collect.virtual.recorder import VirtualRecorder
from memprof.collect.virtual.routing import CudaRouting, module_to
from memprof.collect.virtual.subclasses import swapping
from memprof.collect.virtual.tensor import VirtualTensor, card_device, set_card_index
from memprof.collect.virtual.value_sizes import LargestSizes
from memprof.trace.model import AllocatorSettings


class VirtualGpu:
    """Installs the virtual card for the duration of a ``with`` block (single use)."""

    def __init__(self, card: Card, settings: AllocatorSettings,
                 settings_dict: dict[str, Any] | None = None, announce: str | None = None,
                 max_entries: int | None = None, index: int = 0, count: int = 1) -> None:
        self.card = card
        self.index, self.count = index, count  # cuda:index, one of count cards of the node
        self.world: tuple[int, int] | None = None  # its first process group's rank, size
        self.recorder = VirtualRecorder(card, settings, announce, max_entries)
        self.history = HistoryWindow(self.recorder, settings_dict or {})
        self._routing = CudaRouting(card)
        self._saved: dict[tuple[Any, str], Any] = {}
        self._autocast: torch.library.Library | None = None
        self._host_state = HostState()
        self._checkpoints = Checkpoints()
        self._sizes = LargestSizes()
        self._graphs = CudaGraphs(self.recorder.placer)
        self._extensions = Extensions()  # bitsandbytes, and libraries' parameter classes
        self._groups = ProcessGroups(self._install)  # DTensor's patches: with the first group

    def __enter__(self) -> VirtualGpu:
        set_card_index(self.index)
        patches = cuda_api(self.card, self.recorder, self.history, self.count)
        patches[(torch, "compile")] = EagerCompile("virtual GPU")
        patches[(torch, "clear_autocast_cache")] = _clear_autocast_cache
        patches[(torch, "Generator")] = VirtualGenerator
        # a CUDA build's: libraries gate CUDA features on it (transformers' tf32=True)
        patches[(torch.version, "cuda")] = CUDA_VERSION
        # no NCCL library behind the virtual card, but c10d's error logging asks for its
        # version whenever a call on an "nccl" group raises: 0.0.0, not an error of its own
        patches[(torch.cuda.nccl, "version")] = lambda: (0, 0, 0)
        patches[(torch.backends.cudnn, "is_acceptable")] = _no_cudnn
        patches.update(self._host_state.patches())
        patches.update(self._checkpoints.patches())
        patches.update(self._graphs.patches())
        patches.update(self._groups.patches())
        patches.update(data_parallel_patches())
        patches.update(ddp_patches())
        # on the tensor, not in the routing mode: DataLoader pins batches on a thread of its
        # own, where the (thread-local) mode does not reach
        patches[(torch.Tensor, "pin_memory")] = _pinned
        patches[(torch.UntypedStorage, "data_ptr")] = _storage_address
        patches[(torch.nn.Module, "to")] = module_to(torch.nn.Module.to)
        patches[(torch.utils, "swap_tensors")] = swapping(torch.utils.swap_tensors)
        patches[(torch.autograd, "_engine_run_backward")] = self._backward
        patches[(torch._C, "_group_tensors_by_device_and_dtype")] = _grouped_on_card(
            torch._C._group_tensors_by_device_and_dtype)
        self._install(patches)
        for foreach_types in _FOREACH_TYPES:  # the optimizers' list, and clip_grad's
            foreach_types.append(VirtualTensor)
        VirtualTensor.on_create = self.recorder.adopt
        self._host_state.install()
        self._autocast = autocast.install()
        self._checkpoints.install()
        self._extensions.install()
        self._sizes.__enter__()
        inherited(self._routing)  # threads the script starts make CUDA tensors virtual too
        self._routing.__enter__()
        return self

    def _install(self, patches: dict[tuple[Any, str], Any]) -> None:
        """Set each (owner, name) to its value until ``__exit__`` puts back what was there."""
        seen: set[int] = set()
        for (owner, name), value in patches.items():
            self._saved.setdefault((owner, name), getattr(owner, name, _ABSENT))
            setattr(owner, name, _copy(value) if id(value) in seen else value)
            seen.add(id(value))

    def _backward(self, *args: Any, **kwargs: Any) -> Any:
        """The autograd engine, run with the routing mode on its stack.

        ``backward()`` reaches the engine through the mode's handler, where the mode is
        off; the engine hands its threads the modes active when it starts, and code that
        runs in backward (checkpointing's recomputation) must make CUDA tensors virtual
        and pick the card's attention kernel as the forward did.
        """
        engine = self._saved[(torch.autograd, "_engine_run_backward")]
        if any(m is self._routing for m in _get_current_function_mode_stack()):
            return engine(*args, **kwargs)
        with self._routing:
            return engine(*args, **kwargs)

    def __exit__(self, *exc: object) -> None:
        self._routing.__exit__(None, None, None)
        self._sizes.__exit__()
        self._checkpoints.remove()
        self._extensions.remove()
        if self._autocast is not None:
            self._autocast._destroy()
        autocast.clear_cache()
        VirtualTensor.on_create = None
        self._host_state.remove()
        for foreach_types in _FOREACH_TYPES:
            foreach_types.remove(VirtualTensor)
        for (owner, name), value in self._saved.items():
            if value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved.clear()
        self.index = card_device().index  # the card the script chose (set_device)
        self.world = self._groups.world
        set_card_index(0)


def _no_cudnn(tensor: torch.Tensor) -> bool:
    """``torch.backends.cudnn.is_acceptable``: no cuDNN behind the card (said once, as the
    recurrent layers ask it), rather than PyTorch's warning that its build has none."""
    say("memprof: virtual GPU: no cuDNN behind the card: recurrent layers (nn.LSTM, nn.GRU,"
        " nn.RNN) run PyTorch's own kernels, whose memory differs from cuDNN's (its flattened"
        " weights, workspace and reserve space are not modelled)")
    return False


def _grouped_on_card(group: Any) -> Any:
    """``_group_tensors_by_device_and_dtype`` keyed by the devices Python sees: C++ sees
    virtual tensors as meta, and ``clip_grad_norm_`` would take its per-tensor path where a
    CUDA script takes ``_foreach_norm``."""
    def grouped(tensorlistlist: Any, with_indices: bool = False) -> Any:
        found = group(tensorlistlist, with_indices)
        return {(next(t.device for lists in value[0] for t in lists if t is not None), dtype):
                value for (_, dtype), value in found.items()}
    return grouped


_ABSENT = object()  # a patched name the module did not have
# the types torch takes foreach kernels for: the optimizers', and clip_grad's (torch.utils)
_FOREACH_TYPES = (_foreach_supported_types, _foreach_utils._foreach_supported_types)
CUDA_VERSION = "12.8"  # torch.version.cuda on the virtual GPU: the CUDA of PyTorch's wheels


def _copy(value: Any) -> Any:
    """A function of its own for a name patched with a function already used: Dynamo's
    rule table (torch 2.6) refuses one function object found under two torch names with
    different rules."""
    if not isinstance(value, types.FunctionType):
        return value
    copy = types.FunctionType(value.__code__, value.__globals__, value.__name__,
                              value.__defaults__, value.__closure__)
    copy.__kwdefaults__ = value.__kwdefaults__
    copy.__dict__.update(value.__dict__)
    return copy


def _pinned(tensor: torch.Tensor, device: object = None) -> torch.Tensor:
    """``pin_memory()``: the host tensor itself (a CPU build cannot pin)."""
    return tensor


_data_ptr = torch.UntypedStorage.data_ptr


def _storage_address(storage: torch.UntypedStorage) -> int:
    """``data_ptr()``: a virtual tensor's (meta) storage has an address while it holds bytes,
    as a card's has (FSDP checks a storage is allocated by it, libraries tell storages apart
    by it), and 0 once freed: unique while it lives, and 512-byte aligned as the caching
    allocator's blocks are (kernels check alignment by it)."""
    if storage.device.type != "meta":
        return _data_ptr(storage)
    return storage._cdata * MIN_BLOCK if storage.nbytes() else 0


_clear_cpp_autocast_cache = torch.clear_autocast_cache


def _clear_autocast_cache() -> None:
    _clear_cpp_autocast_cache()
    autocast.clear_cache()
