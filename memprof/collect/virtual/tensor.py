"""Virtual CUDA tensors: real shapes, dtypes and strides on ``meta`` storage, seen as CUDA.

A :class:`VirtualTensor` wraps a ``meta`` tensor. To C++ (autograd, dispatch) it is a
meta tensor, which every CPU-only build supports; to Python it says ``device cuda:0``
(``cuda:LOCAL_RANK`` in a rank of a virtual cluster: ``set_card_index``) and ``is_cuda``.
Every operator on it runs on the meta tensor inside and wraps the result, so outputs,
gradients and optimizer state are virtual CUDA tensors too.
A small one keeps real values beside it (``values.py``); a large one has none, and its
``.item()``, ``.tolist()``, printing and ``.numpy()`` give placeholders (zeros), announced
once on stderr with the script's line. A :class:`HostVirtualTensor` is the
same on the host side: a copy to the host, or a parameter of a model built on the CPU.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from memprof.collect.notices import say
from memprof.collect.virtual import values
from memprof.collect.virtual.autocast import AUTOCAST_CUDA
from memprof.collect.virtual.collectives import COLLECTIVES, collective
from memprof.collect.virtual.kernel_memory import output_storage_bytes
from memprof.collect.virtual.meta_cache import MetaCache
from memprof.collect.virtual.unsupported import strided_only
from memprof.collect.virtual.value_sizes import note_sized_by_values, unsupported_operator

CUDA = torch.device("cuda", 0)  # the card's device: set_card_index changes it
_CPU = torch.device("cpu")
_META = torch.device("meta")
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
# ``t.set_(source)`` (FSDP1's flat parameter, swapped between its shard and the full one)
_SETS = {torch.ops.aten.set_.source_Tensor, torch.ops.aten.set_.source_Storage,
         torch.ops.aten.set_.source_Storage_storage_offset}
_PYTHON_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
# its outputs 2 and 3, the dropout RNG's seed and offset, are host scalars on a card
# (attention.cu makes device ones only while a CUDA graph is captured)
_EFFICIENT_ATTENTION = torch.ops.aten._scaled_dot_product_efficient_attention.default
# its meta kernel makes a logsumexp even when none is asked for (compute_log_sumexp false,
# as in inference): the CUDA kernel then allocates none
CUDNN_ATTENTION = torch.ops.aten._scaled_dot_product_cudnn_attention.default
_run_meta = MetaCache()
_told = False
_PACKAGE = __file__.rsplit("memprof", 1)[0] + "memprof"


def set_card_index(index: int) -> None:
    """Make ``cuda:index`` the virtual card's device (a rank's ``LOCAL_RANK``)."""
    global CUDA
    CUDA = torch.device("cuda", index)


def elsewhere(device: object) -> None:
    """Say once that the script put a tensor on another card than this process's (model
    parallelism by hand, or a rank's tensors on ``cuda:0``): the prediction keeps them on
    this process's card, where a machine would have them on the other."""
    index = device if type(device) is int else getattr(
        torch.device(device), "index", None) if isinstance(device, (str, torch.device)) \
        else None
    if index is not None and index != CUDA.index:
        say(f"memprof: virtual GPU: the script puts CUDA tensors on cuda:{index}, and this"
            f" process's card is cuda:{CUDA.index}: they are predicted on cuda:{CUDA.index}"
            f" (one card a process); on a machine they would take cuda:{index}'s memory")


def card_device() -> torch.device:
    """The virtual card's device, ``cuda:0`` unless ``set_card_index`` said otherwise."""
    return CUDA


def placeholder_notice() -> None:
    """Say once that values read from virtual tensors are placeholders, and where."""
    global _told
    if not _told:
        _told = True
        where = _script_line()
        say(f"memprof: virtual GPU: {where + ' reads' if where else 'the script reads'} the"
            f" values of a CUDA tensor of more than {values.SMALL} elements, or one computed"
            " from one: large tensors hold no values, so .item(), .tolist(), printing and"
            " .numpy() give zeros there; sizes or branches that depend on them may differ"
            " from the card's")


def placeholders_read() -> bool:
    """Whether the script has read placeholder values (``placeholder_notice``)."""
    return _told


def _script_line() -> str | None:
    """``file:line`` of the innermost frame of the script's own code, if any."""
    from memprof.analysis.sites import is_library
    from memprof.trace.model import Frame

    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.startswith(_PACKAGE) and not is_library(
                Frame(code.co_filename, frame.f_lineno or 0, code.co_name)):
            return f"{code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _placeholder(dtype: torch.dtype) -> bool | int | float:
    placeholder_notice()
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point or dtype.is_complex else 0


class VirtualTensor(torch.Tensor):
    """A CUDA tensor without storage or compute (a ``meta`` tensor inside)."""

    elem: torch.Tensor
    value: torch.Tensor | None  # a small tensor's real values, on the host (values.py)
    # called with every virtual tensor made outside an operator (factories, host copies)
    on_create: Callable[[VirtualTensor], None] | None = None

    @staticmethod
    def __new__(cls, elem: torch.Tensor, requires_grad: bool | None = None,
                value: torch.Tensor | None = None) -> VirtualTensor:
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, layout=elem.layout, device="meta",
            requires_grad=elem.requires_grad if requires_grad is None else requires_grad,
            _extra_dispatch_keys=AUTOCAST_CUDA)  # CUDA autocast applies (autocast.py)
        r.elem = elem
        r.value = value
        return r

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return CUDA

    @property  # type: ignore[override]
    def is_cuda(self) -> bool:
        return True

    @property  # type: ignore[override]
    def is_meta(self) -> bool:
        return False

    def get_device(self) -> int:
        return CUDA.index  # type: ignore[return-value]

    def untyped_storage(self) -> torch.UntypedStorage:  # type: ignore[override]
        """The inner meta tensor's storage: the one the recorder tracks, and the one a
        ``resize_`` (FSDP2's free and regather) must reach."""
        return self.elem.untyped_storage()

    def data_ptr(self) -> int:  # type: ignore[override]
        """Its storage's address (the virtual GPU's ``UntypedStorage.data_ptr``) plus its
        offset, as a card's tensor's."""
        base = self.elem.untyped_storage().data_ptr()
        return base + self.storage_offset() * self.element_size() if base else 0

    def __repr__(self, **kwargs: Any) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        if self.value is not None:  # as torch prints a CUDA tensor
            text = repr(self.value.detach())
            return f"{text[:-1]}, device='{CUDA}'{grad})"
        placeholder_notice()
        return (f"tensor(<virtual>, device='{CUDA}', size={tuple(self.shape)},"
                f" dtype={self.dtype}{grad})")

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return format(self.item(), spec)
        return repr(self)

    def item(self) -> bool | int | float:  # type: ignore[override]
        if self.value is not None:
            return self.value.item()
        return _placeholder(self.dtype)

    def tolist(self) -> Any:  # type: ignore[override]
        if self.value is not None:
            return self.value.tolist()
        value = _placeholder(self.dtype)
        out: Any = value
        for n in reversed(self.shape):
            out = [out if not isinstance(out, list) else list(out) for _ in range(n)]
        return out

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        if self.value is not None:
            return self.value.detach().numpy().copy()
        placeholder_notice()
        return torch.zeros(self.shape, dtype=self.dtype).numpy()

    def __bool__(self) -> bool:
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __reduce_ex__(self, protocol: object) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """Pickle as PyTorch pickles a storage-less tensor: a plain ``torch.Tensor`` wrapper
        on this device (``checkpoints.py`` reads it back as a virtual tensor)."""
        if getattr(self, "_is_param", False):
            return torch._utils._rebuild_parameter, (self.detach(), self.requires_grad, {})
        return torch._utils._rebuild_wrapper_subclass, (
            torch.Tensor, self.dtype, tuple(self.size()), self.stride(), self.storage_offset(),
            self.layout, self.device, self.requires_grad)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: object, sizes: object, strides: object
                             ) -> VirtualTensor:
        return VirtualTensor(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is _LOCAL_SCALAR:
            value = args[0].value
            return value.item() if value is not None else _placeholder(args[0].dtype)
        if func in COLLECTIVES:  # written in place, nothing exchanged (collectives.py)
            return collective(func, args, lambda meta: adopt(VirtualTensor(meta)))
        hosted = values.twins(args, kwargs, VirtualTensor)  # None: an input has no values
        # a copy to the host (or a host tensor made like one: zeros_like(t, device="cpu")),
        # still without storage
        to_host = _is_host(kwargs.get("device"))
        if to_host:
            kwargs = {**kwargs, "device": _META}
        real = None
        try:
            out = _run_meta(func, _map(_unwrap, args),
                            {k: _map(_unwrap, v) for k, v in kwargs.items()})
        except NotImplementedError:  # no meta kernel: the values may size it, else one line
            real = values.compute(func, *hosted) if hosted is not None else None
            if real is None:
                raise unsupported_operator(func) from None
            out = values.meta_like(real)
        else:
            if hosted is not None and values.small(out):
                real = values.compute(func, *hosted)
                if real is not None and not getattr(func, "is_view", False) \
                        and values.shapes(real) != values.shapes(out):
                    out = values.meta_like(real)  # sized by its values: nonzero, a mask
        if func in _SETS and isinstance(args[0], VirtualTensor):
            return _set(args[0], out)
        if real is None:
            note_sized_by_values(func, args)
            values.forget_written(func, args, VirtualTensor)
        if getattr(func, "_opname", None) == "mse_loss":  # the scalar keeps the loss's storage
            out = _on_storage_of(out, output_storage_bytes(func, args))
        if func is CUDNN_ATTENTION and not args[4]:
            out = (out[0], out[1].new_empty((*out[1].shape[:2], 0, 1)), *out[2:])
        on_device = not to_host and (_any_virtual(args) or _any_virtual(kwargs.values()))
        wrap = VirtualTensor if on_device else HostVirtualTensor
        if func is _EFFICIENT_ATTENTION:
            return tuple(HostVirtualTensor(x) if i in (2, 3) else wrap(x)
                         for i, x in enumerate(out))
        if getattr(func, "is_view", False) and _viewing_normal_tensor(args):
            # as a view of a normal tensor is, in inference mode too (autograd then gives it
            # its base's version counter, which an inference tensor cannot hold)
            with torch.inference_mode(False):
                result = _map(lambda x: wrap(x) if _is_plain_meta(x) else x, out)
        else:
            result = _map(lambda x: wrap(x) if _is_plain_meta(x) else x, out)
        if real is not None:
            values.attach(result, real)
        return result


class HostVirtualTensor(VirtualTensor):
    """A host tensor without storage: the parameters of a model built on the CPU under the
    virtual GPU, and copies of virtual CUDA tensors to the host. Not device memory."""

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return _CPU

    @property  # type: ignore[override]
    def is_cuda(self) -> bool:
        return False

    def get_device(self) -> int:
        return -1

    def __repr__(self, **kwargs: Any) -> str:
        placeholder_notice()
        return f"tensor(<virtual>, size={tuple(self.shape)}, dtype={self.dtype})"

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: object, sizes: object, strides: object
                             ) -> VirtualTensor:
        return HostVirtualTensor(inner["elem"])


def _set(target: VirtualTensor, elem: torch.Tensor) -> VirtualTensor:
    """``target.set_(...)`` done on its meta tensor (``elem``, now on the new storage): the
    wrapper takes its sizes, strides and offset too (C++'s ``set_`` on the wrapper itself,
    past this dispatch), and it becomes ``target``'s inside."""
    with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEY):
        torch.ops.aten.set_.source_Tensor(target, elem)
    target.elem, target.value = elem, None
    return target


def _map(fn: Callable[[Any], Any], x: Any) -> Any:
    """``fn`` over an operator's arguments or outputs, through the tuples and lists that hold
    them: torch's pytree, for any container, costs ten times as much a call."""
    if type(x) is tuple or type(x) is list:
        return type(x)(_map(fn, v) for v in x)
    if isinstance(x, (tuple, list, dict)):  # a named tuple, say: rare
        return tree_map(fn, x)
    return fn(x)


def _on_storage_of(t: torch.Tensor, nbytes: int | None) -> torch.Tensor:
    """``t`` on a storage of ``nbytes`` (a larger one than its shape needs), or ``t``."""
    if nbytes is None:
        return t
    storage = torch.UntypedStorage(nbytes, device="meta")
    return torch.empty(0, dtype=t.dtype, device="meta").set_(storage, 0, t.shape, t.stride())


def _any_virtual(values: Any) -> bool:
    for v in values:
        if type(v) is VirtualTensor or (isinstance(v, (tuple, list)) and _any_virtual(v)):
            return True
    return False


def _viewing_normal_tensor(args: tuple) -> bool:
    """Whether a view op, in inference mode, views a tensor made outside it."""
    return (torch.is_inference_mode_enabled() and bool(args)
            and isinstance(args[0], torch.Tensor) and not args[0].is_inference())


def _is_host(device: object) -> bool:
    return device is not None and torch.device(device).type == "cpu"  # type: ignore[arg-type]


def _unwrap(x: object) -> object:
    if isinstance(x, VirtualTensor):
        return x.elem
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        # CPU scalar tensors mix with CUDA tensors, as on a GPU; host tensors with the
        # storage-less parameters of a model built on the host
        return x.to("meta")
    if isinstance(x, torch.device) and x.type == "cuda":
        return torch.device("meta")
    return x


def _is_plain_meta(x: object) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, VirtualTensor) and x.is_meta


def virtual_like(t: torch.Tensor, dtype: torch.dtype | None = None,
                 kind: type[VirtualTensor] = VirtualTensor) -> VirtualTensor:
    """A new virtual tensor (CUDA, or ``HostVirtualTensor``) with ``t``'s shape and strides:
    a host-to-device copy."""
    strided_only(t)
    dense = t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)
    stride = t.stride() if dense else None
    with torch._C.DisableTorchFunction():
        if stride is None:
            elem = torch.empty(t.shape, dtype=dtype or t.dtype, device="meta")
        else:
            elem = torch.empty_strided(t.shape, stride, dtype=dtype or t.dtype, device="meta")
        source = t.value if isinstance(t, VirtualTensor) else t
        value = None
        if source is not None and source.device.type == "cpu" and t.numel() <= values.SMALL:
            value = source.detach().to(dtype or t.dtype, copy=True)
    return adopt(kind(elem, requires_grad=False, value=value))


def adopt(t: VirtualTensor) -> VirtualTensor:
    """Report a virtual tensor made outside an operator to the recorder."""
    if VirtualTensor.on_create is not None:
        VirtualTensor.on_create(t)
    return t
