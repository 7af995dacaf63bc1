"""Libraries' parameter classes on the virtual GPU: a quantised weight made on ``.cuda()``.

bitsandbytes' ``Params4bit`` and ``Int8Params`` (``torch.nn.Parameter`` subclasses) are
built with ``torch.Tensor._make_subclass(cls, data)``, and quantise on ``.cuda()`` by
assigning the CUDA result in place: ``self.data = w_4bit``. Neither works as such with a
virtual tensor: ``_make_subclass`` cannot give a wrapper tensor another class, and
``set_data`` refuses a meta tensor for a host one. While the virtual GPU is on,
``_make_subclass`` of virtual data makes a *twin* of the class (a subclass of the virtual
kind and of the class: its ``isinstance`` checks and methods hold), and ``host.data =
virtual`` turns the host tensor into its twin in place (``torch.utils.swap_tensors``),
keeping its Python attributes (the quantisation state) and its identity (the module's
parameter), as ``set_data`` does on a card.

    w = bnb.nn.Params4bit(torch.randn(64, 64)).cuda()  # isinstance Params4bit, on cuda:0
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from memprof.collect.virtual import values
from memprof.collect.virtual.tensor import HostVirtualTensor, VirtualTensor
from memprof.collect.virtual.unsupported import VirtualGpuUnsupported

SET_DATA = torch._C.TensorBase.data.__set__  # what the routing mode sees for ``t.data = v``
_MAKE_SUBCLASS = torch._C.TensorBase._make_subclass
_DETACH = torch.ops.aten.detach.default
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # classes that need no twin
_twins: dict[tuple[type, type], type] = {}


def kind_of(t: torch.Tensor) -> type[VirtualTensor] | None:
    """The virtual kind of ``t`` (on the card, or on the host), or None for a real tensor."""
    if isinstance(t, HostVirtualTensor):
        return HostVirtualTensor
    return VirtualTensor if isinstance(t, VirtualTensor) else None


def twin(cls: type, kind: type[VirtualTensor]) -> type[VirtualTensor]:
    """``cls`` made virtual: ``kind`` itself for a plain tensor or parameter, else a class
    deriving from both (one per class and kind)."""
    cls = getattr(cls, "library_class", cls)
    if cls in _PLAIN or issubclass(cls, VirtualTensor):
        return kind
    made = _twins.get((cls, kind))
    if made is None:
        made = type(cls.__name__, (kind, cls), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__new__": cls.__new__,  # type(w)(...) builds as the library's class does
            "__torch_dispatch__": classmethod(_as_kind(kind)), "library_class": cls})
        _twins[(cls, kind)] = made
    return made


def _as_kind(kind: type[VirtualTensor]) -> Callable[..., Any]:
    """A twin's ``__torch_dispatch__``: the operator run as on ``kind``, the twins among its
    arguments seen as ``kind`` (whose checks go by exact class); ``detach`` (``.data``,
    ``Parameter(w)``) keeps the class and its attributes."""
    def dispatch(cls: type, func: Any, types: Any, args: tuple = (),
                 kwargs: dict[str, Any] | None = None) -> Any:
        if func is _DETACH and type(args[0]) is cls:
            return _with_attributes(_on(cls, args[0], False), args[0])
        kinds = tree_map_only(VirtualTensor, plain, (args, kwargs or {}))
        return kind.__torch_dispatch__(func, types, *kinds)
    return dispatch


def _with_attributes(made: VirtualTensor, source: torch.Tensor) -> VirtualTensor:
    """``made`` with ``source``'s Python attributes, but its own virtual ones (``elem``)."""
    own = vars(made)
    own.update({k: v for k, v in vars(source).items() if k not in own})
    return made


def plain(t: VirtualTensor) -> VirtualTensor:
    """``t`` as its virtual kind itself (a twin's storage, without its class)."""
    kind = kind_of(t)
    return t if type(t) is kind else kind(t.elem, requires_grad=False)  # type: ignore[misc]


def make_subclass(cls: type, data: torch.Tensor, requires_grad: bool = False,
                  **kwargs: Any) -> torch.Tensor:
    """``torch.Tensor._make_subclass`` (with its Dynamo polyfill's signature): of virtual
    data (or for a twin class), the class's twin on the data's storage."""
    kind = kind_of(data)
    if kind is None and not issubclass(cls, VirtualTensor):
        return _MAKE_SUBCLASS(cls, data, requires_grad, **kwargs)
    kind = kind or (HostVirtualTensor if issubclass(cls, HostVirtualTensor) else VirtualTensor)
    return _on(twin(cls, kind), data, requires_grad)


def _on(cls: type[VirtualTensor], data: torch.Tensor, requires_grad: bool) -> VirtualTensor:
    """A ``cls`` on ``data``'s storage (a real tensor's shape, where ``data`` is one)."""
    with torch._C.DisableTorchFunction():
        elem = data.elem.detach() if isinstance(data, VirtualTensor) else data.to("meta")
    return VirtualTensor.__new__(cls, elem, requires_grad)


def set_data(target: torch.Tensor, value: torch.Tensor) -> None:
    """``target.data = value``; a host tensor given a virtual one (or a virtual one given
    the other kind) becomes its class's twin in place, on ``value``'s storage; a virtual
    one given a real host tensor becomes a host one of its shape (and values, if small)."""
    if kind_of(target) is not None:
        value = host_twin(value)
    kind = kind_of(value)
    if kind is not None and kind_of(target) not in (None, kind):
        # virtual on both sides: the same C++ tensor, so the class alone moves it (between
        # the card and the host), views of it alive or not (FSDP1's offloaded flat parameter)
        target.__class__ = twin(type(target), kind)
    if kind is None or kind_of(target) is kind:
        SET_DATA(target, value)
        if kind is not None:  # the wrapper took value's shape and dtype: so does its inside
            with torch._C.DisableTorchFunction():
                target.elem = value.elem.detach()
            if hasattr(value, "value"):  # a small tensor's values (values.py)
                target.value = value.value
        return
    made = _with_attributes(_on(twin(type(target), kind), value, target.requires_grad), target)
    if isinstance(target, torch.nn.Parameter):
        made._is_param = True
    try:
        torch.utils.swap_tensors(target, made)
    except RuntimeError as exc:  # views of a real host tensor live
        raise VirtualGpuUnsupported(
            "moving a real host tensor to the card in place while views of it live",
            str(exc).split(" make sure")[0], "profile this script on a GPU") from None


def host_twin(value: Any) -> Any:
    """A real host tensor as a host tensor without storage, of its shape (and values, if
    small), for a virtual one to hold; anything else as it is."""
    if not isinstance(value, torch.Tensor) or kind_of(value) is not None \
            or value.device.type != "cpu":
        return value
    with torch._C.DisableTorchFunction():
        return HostVirtualTensor(value.detach().to("meta"), value=value.detach()
                                 if values.small(value) else None)


def swapping(swap_tensors: Callable[[torch.Tensor, torch.Tensor], None]
             ) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``torch.utils.swap_tensors`` that turns a host tensor into its virtual twin even
    where a library holds a weak reference to it (DeepSpeed names each parameter through
    ``weakref.finalize``): the swap keeps the object, so the reference still reaches it
    and what it now holds, as ``set_data`` keeps a card's parameter on ``.to("cuda")``.
    PyTorch refuses any weakly referenced tensor; ``Module._apply`` swaps a parameter
    for a virtual one. Between two virtual tensors (``Module._apply`` swaps them, as
    wrapper subclasses, where a card sets ``.data``) it is ``t1.data = t2``, as on a card:
    ``t1`` keeps its attributes (FSDP1's flat parameter moved by ``module.cpu()``) and
    any view of it."""
    @functools.wraps(swap_tensors)
    def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if kind_of(t1) is not None and kind_of(t2) is not None:
            return set_data(t1, t2)
        if (kind_of(t1) is None and kind_of(t2) is not None and weakref.getweakrefs(t1)
                and not weakref.getweakrefs(t2)):
            seen = torch.utils.weakref
            torch.utils.weakref = _Unseen(t1)  # type: ignore[attr-defined]
            try:
                return swap_tensors(t1, t2)
            finally:
                torch.utils.weakref = seen  # type: ignore[attr-defined]
        return swap_tensors(t1, t2)
    return swap


class _Unseen:
    """The ``weakref`` module, as ``swap_tensors`` reads it, without ``hidden``'s refs."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self._hidden = hidden

    def getweakrefs(self, obj: object) -> list[Any]:
        return [] if obj is self._hidden else weakref.getweakrefs(obj)

