"""Where tensors go under the virtual GPU: a torch-function mode that makes CUDA virtual.

Factories asked for a CUDA device (``device="cuda"``, ``set_default_device("cuda")``,
``nn.Linear(..., device="cuda")``), ``.cuda()`` and ``.to("cuda")`` give virtual CUDA
tensors, and a bare index (``torch.device(0)``, ``.to(0)``) names a CUDA device; host
tensors stay real; ``scaled_dot_product_attention`` runs the card's kernel
(``attention.py``), and dropout CUDA's fused one.
"""

from __future__ import annotations

import copy
import functools
import threading
import types as pytypes
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.overrides import (
    TorchFunctionMode,
    _get_current_function_mode_stack,
    redispatch_function,
)
from torch.utils._device import DeviceContext, _device_constructors

from memprof.collect.virtual import values
from memprof.collect.virtual.attention import sdpa
from memprof.collect.virtual.cards import Card
from memprof.collect.virtual.dtensors import is_dtensor, on_card, with_local
from memprof.collect.virtual.subclasses import SET_DATA, host_twin, kind_of, plain, set_data
from memprof.collect.virtual.tensor import (
    HostVirtualTensor,
    VirtualTensor,
    adopt,
    elsewhere,
    virtual_like,
)
from memprof.collect.virtual.unsupported import strided_only

_META = torch.device("meta")
_CPU = torch.device("cpu")
_SDPA = torch.nn.functional.scaled_dot_product_attention
_DROPOUT = {torch.nn.functional.dropout: ("input", "p", "training", "inplace"),
            torch.dropout: ("input", "p", "train")}
_FACTORIES = _device_constructors()
_FAKE = torch._C._TorchDispatchModeKey.FAKE
_PARSE_TO = torch._C._nn._parse_to
_WRAPPER = type(SET_DATA)


def is_cuda_device(device: object) -> bool:
    """Whether a ``device`` argument names CUDA (``"cuda"``, ``"cuda:0"``, a device, an int)."""
    if device is None or isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type == "cuda"
    return False


class CudaRouting(TorchFunctionMode):
    """Turns the script's CUDA requests into virtual CUDA tensors for ``card``."""

    def __init__(self, card: Card) -> None:
        super().__init__()
        self.card = card
        self._inside = threading.local()  # the Python functions running with the mode on

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if torch._C._get_dispatch_mode(_FAKE) is not None:
            # PyTorch's own fake tensors (a higher-order operator tracing its function, run
            # eagerly): the fake mode's to make, on the meta device where they would be on
            # the card (a CPU build has no CUDA device for autograd to guard)
            if is_cuda_device(kwargs.get("device")):
                kwargs = {**kwargs, "device": _META}
            return func(*args, **kwargs)
        if func is torch.device and len(args) == 1 and type(args[0]) is int and not kwargs:
            return torch.device("cuda", args[0])  # the current accelerator's: a CPU build has none
        if type(func) is _WRAPPER and func == SET_DATA:  # t.data = v (a method-wrapper)
            return set_data(*args)  # a host t given a virtual v becomes virtual
        if type(func) is _WRAPPER and func == _SET_GRAD and kind_of(args[0]) is HostVirtualTensor:
            # a real host gradient for a host tensor without storage (DeepSpeed's offloaded
            # fp32 partitions): a host one without storage too, as C++ sees the meta device
            return func(args[0], host_twin(args[1]))
        if func is _DEEPCOPY and kind_of(args[0]) is not None:
            return _deepcopy(*args)
        if type(func) is _WRAPPER and func == _DATA and type(args[0]) not in _KINDS \
                and kind_of(args[0]) is not None:
            # .data of a library's parameter class (bitsandbytes' Params4bit) is a plain
            # tensor, as on a card: its methods (quantise on .to()) are the class's alone
            return plain(func(*args, **kwargs))
        if func in _LEGACY_NEW and kind_of(args[0]) is not None and kwargs.get("device") is None:
            return _new(func, args, kwargs)
        if func in _MADE_LIKE and _is_meta(kwargs.get("device")):
            # zeros_like(t, device="meta") of a card's t: a meta tensor, as on a card (DeepSpeed
            # sizes its partitions so), not one on the card
            return func(*[_inside(a) for a in args], **kwargs)
        if func is torch.Tensor.cuda:
            return _to_cuda(args[0], None)
        if func is torch.Tensor.to:
            return _to(args[0], args[1:], kwargs, func)
        if func is _PARSE_TO:  # Module.to's parser: its device= is read, not made
            return _parse_to(args, kwargs)
        if func is _SDPA:
            return sdpa(self.card, *args, **kwargs)
        if func in _DROPOUT:
            return _dropout(func, args, kwargs)
        if kwargs.get("pin_memory"):  # pinning needs a driver: plain host memory, as
            kwargs = {**kwargs, "pin_memory": False}  # the patched pin_memory() gives
        device = kwargs.get("device")
        if device is None and func in _FACTORIES:
            device = _default_device()  # set_default_device("cuda") adds it below this mode
        if is_cuda_device(device):
            elsewhere(device)
            out = func(*args, **{**kwargs, "device": _META})
            if not isinstance(out, torch.Tensor):
                return out
            if is_dtensor(out):  # a DTensor made like another (to_empty): its local tensor
                return with_local(out, _on_device(out._local_tensor))
            made = _on_device(out)
            if made.value is None and values.small(out):  # a small one gets its values
                hosted = values.twins(args, {**kwargs, "device": _CPU}, VirtualTensor)
                real = values.compute(func, *hosted, seeded=True) if hosted else None
                if isinstance(real, torch.Tensor) and real.shape == made.shape:
                    made.value = real.detach()
            return made
        if isinstance(func, HigherOrderOperator):
            # a higher-order operator run eagerly (flex_attention): PyTorch runs it with this
            # mode off, so its kernels' factories would escape the card; with the mode on,
            # one dispatch hop skipped (it calls itself again inside, legitimately)
            with self:
                return redispatch_function(func, types, args, kwargs)
        inside = self._inside.__dict__.setdefault("functions", set())
        if type(func) is pytypes.FunctionType and func not in inside \
                and not func.__qualname__.startswith("Tensor."):
            # a Python function (F.multi_head_attention_forward): PyTorch runs it with this
            # mode off, so its own torch calls (its SDPA, its factories) would escape the
            # card; run it with the mode on, one dispatch hop skipped. Tensor's Python
            # methods call their C twin, which would dispatch here again; and a function
            # that reaches itself again (a library's wrapper around torch.nn.init.normal_,
            # which dispatches under the wrapper's name) runs as PyTorch runs it.
            inside.add(func)
            try:
                with self:
                    return redispatch_function(func, types, args, kwargs)
            finally:
                inside.discard(func)
        return func(*args, **kwargs)


_LEGACY_NEW = (torch.Tensor.new, torch.Tensor.new_tensor)
_DEEPCOPY = torch.Tensor.__deepcopy__
_DATA = torch._C.TensorBase.data.__get__  # a new method-wrapper each time: compared by ==
_SET_GRAD = torch._C.TensorBase.grad.__set__
_KINDS = (VirtualTensor, HostVirtualTensor)
_OWN = ("elem", "value")  # a virtual tensor's own attributes, not copied


def _deepcopy(t: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
    """``copy.deepcopy`` of a virtual tensor (a model's weights copied for an EMA): a clone,
    allocated on the card as a card's copy is (PyTorch's own copies its storage, which a
    virtual tensor has none of), with its class, attributes and gradient."""
    if id(t) in memo:
        return memo[id(t)]
    with torch.no_grad():
        made = t.clone()
    if type(made) is not type(t):  # a library's parameter class (subclasses.py)
        made.__class__ = type(t)
    made.requires_grad_(t.requires_grad)
    memo[id(t)] = made
    for name, value in vars(t).items():
        if name not in _OWN:
            setattr(made, name, copy.deepcopy(value, memo))
    if t.grad is not None:
        made.grad = copy.deepcopy(t.grad, memo)
    return made
# the script's tensors made like another, which a device= may put elsewhere
_MADE_LIKE = frozenset((
    *(getattr(torch, f"{kind}_like") for kind in ("empty", "zeros", "ones", "full", "rand",
                                                  "randn", "randint")),
    *(getattr(torch.Tensor, f"new_{kind}") for kind in ("empty", "zeros", "ones", "full"))))


def _new(func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    """``t.new(data)``, ``t.new(*sizes)`` and ``t.new_tensor(data)`` of a virtual ``t``: on
    its device (C++ would make them on its meta inside), data with its values."""
    t, rest = args[0], args[1:]
    data = func is torch.Tensor.new_tensor or (
        bool(rest) and isinstance(rest[0], (list, tuple)) and not isinstance(rest[0], torch.Size))
    with torch._C.DisableTorchFunction():
        made = func(torch.empty(0, dtype=t.dtype, device=_CPU if data else _META), *rest,
                    **kwargs)
    kind = kind_of(t)
    if kind is VirtualTensor:
        return virtual_like(made) if data else _on_device(made)
    return made if data else virtual_like(made, kind=kind)  # a host one's: on the host


def _is_meta(device: object) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "meta"


def _inside(x: Any) -> Any:
    """A virtual tensor's meta tensor (anything else as it is)."""
    return x.elem if isinstance(x, VirtualTensor) else x


def _on_device(out: torch.Tensor) -> torch.Tensor:
    """A factory's meta result (or the virtual tensor an operator already made) on CUDA."""
    if type(out) is VirtualTensor:
        return out
    if isinstance(out, VirtualTensor):  # made from host-side virtual tensors
        return adopt(VirtualTensor(out.elem, requires_grad=out.requires_grad, value=out.value))
    strided_only(out)
    return adopt(VirtualTensor(out))


def _dropout(func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """Dropout as CUDA runs it: ATen takes its fused kernel (``native_dropout``, whose mask
    is bool) for CUDA tensors; on the meta tensors inside it would take the unfused one,
    whose mask has the input's dtype."""
    given = dict(zip(_DROPOUT[func], args, strict=False)) | kwargs
    x, p = given["input"], given.get("p", 0.5)
    if (type(x) is VirtualTensor and given.get("training", given.get("train", True))
            and not given.get("inplace", False) and 0 < p < 1 and x.numel() > 0):
        return torch.ops.aten.native_dropout(x, p, True)[0]
    return func(*args, **kwargs)


def _default_device() -> torch.device | None:
    """``torch.set_default_device``'s device (``get_default_device`` would make a tensor)."""
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode.device
    context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    return context.device if context is not None else None


def _to_cuda(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if kind_of(t) is VirtualTensor or on_card(t):  # a library's parameter class, a DTensor
        return t if dtype is None or dtype == t.dtype else t.to(dtype)
    return virtual_like(t, dtype)


def index_as_cuda(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``to``'s arguments with a bare device index (``.to(0)``, ``device=1``) as a CUDA
    device: PyTorch reads it as the current accelerator's, which a CPU build has none of."""
    if args and type(args[0]) is int:
        args = (torch.device("cuda", args[0]), *args[1:])
    if type(kwargs.get("device")) is int:
        kwargs = {**kwargs, "device": torch.device("cuda", kwargs["device"])}
    return args, kwargs


def module_to(original: Callable[..., Any]) -> Callable[..., Any]:
    """``nn.Module.to`` taking a bare device index as CUDA's (``index_as_cuda``)."""
    @functools.wraps(original)
    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = index_as_cuda(args, kwargs)
        return original(self, *args, **kwargs)
    return to


def _parse_to(args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``to``'s (device, dtype, non_blocking, memory_format), a CUDA device as the script
    sees it: ``to(other)`` takes ``other.device`` (C++ would read a virtual tensor's meta)."""
    args, kwargs = index_as_cuda(args, kwargs)
    other = args[0] if args else kwargs.get("other")
    if isinstance(other, torch.Tensor):  # to(other): other's device and dtype
        args = (other.device, other.dtype, *args[1:])
        kwargs = {k: v for k, v in kwargs.items() if k != "other"}
    return _PARSE_TO(*args, **kwargs)


def _to(t: torch.Tensor, args: tuple, kwargs: dict[str, Any], func: Any) -> torch.Tensor:
    args, kwargs = index_as_cuda(args, kwargs)
    device, dtype, non_blocking, memory_format = _parse_to(
        args, {k: v for k, v in kwargs.items() if k != "copy"})
    if device is not None and device.type == "meta":  # a card's tensor to meta: no card's
        return func(_inside(t), *args, **kwargs)
    if device is None or device.type != "cuda":
        return func(t, *args, **kwargs)
    elsewhere(device)
    if kind_of(t) is not VirtualTensor and not on_card(t):
        return virtual_like(t, dtype)
    return func(t, device=_META, dtype=dtype or t.dtype, non_blocking=non_blocking,
                copy=kwargs.get("copy", False),
                memory_format=memory_format or torch.preserve_format)
