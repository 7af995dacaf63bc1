"""Libraries with CUDA kernels of their own on the virtual GPU: bitsandbytes runs, the rest
are named when they fail.

bitsandbytes (8-bit optimizers, LLM.int8, QLoRA) probes ``torch.cuda`` when imported, to
load its CUDA library and register its CUDA kernels: on the virtual GPU that import would
reach for ``torch._C._cuda_getCurrentRawStream``, which a CPU build lacks. So its first
import sees the machine as it is (:data:`_MACHINE_HAS_CUDA`): it loads its CPU library and
registers no CUDA kernel, as on a machine without a GPU. Its operators
(``bitsandbytes::*``) all have fake kernels, which size their outputs: on virtual CUDA
tensors they run those, so quantised weights (``subclasses.py``) and 8-bit optimizer state
are virtual tensors of the card's dtypes and shapes. While the virtual GPU is on:

- paged optimizer state (``PagedAdamW8bit``, tensors of 100k elements or more) lives in
  CUDA managed memory on a card, outside PyTorch's caching allocator: storage-less host
  tensors here, left out of the prediction as ``memory_allocated`` leaves them out (said
  once);
- LLM.int8's outlier columns (``threshold > 0``), whose number depends on the values, are
  taken at their largest, every column (said once), as ``value_sizes.py`` takes sizes.

Other libraries of CUDA kernels (flash-attn, xformers, apex, liger-kernel,
transformer-engine, triton, ...) run where their operators have meta kernels; when the
script dies inside one, or on a ``torch._C._cuda*`` binding only a CUDA build has,
:func:`extension_failure` is memprof's one line naming the library.
"""

from __future__ import annotations

import contextlib
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memprof.collect.launch.script import Outcome
from memprof.collect.notices import say
from memprof.collect.virtual import subclasses
from memprof.collect.virtual.deepspeed_ops import DeepSpeedOps
from memprof.collect.virtual.first_import import FirstImport, forget, when_imported
from memprof.collect.virtual.tensor import HostVirtualTensor, VirtualTensor

# top-level modules of libraries with CUDA kernels of their own, and the names users know
CUDA_EXTENSIONS = {
    "bitsandbytes": "bitsandbytes", "flash_attn": "flash-attn", "flash_attn_2_cuda":
    "flash-attn", "flash_attn_interface": "flash-attn 3", "xformers": "xformers",
    "apex": "apex", "amp_C": "apex", "liger_kernel": "liger-kernel",
    "transformer_engine": "transformer-engine", "transformer_engine_torch":
    "transformer-engine", "triton": "triton", "deepspeed": "DeepSpeed", "mamba_ssm":
    "mamba-ssm", "causal_conv1d": "causal-conv1d", "flashinfer": "flashinfer",
    "unsloth": "unsloth", "vllm": "vLLM", "torchao": "torchao"}
# torch.cuda.is_available as the machine answers it, before any virtual GPU patches it
_MACHINE_HAS_CUDA = torch.cuda.is_available
_BNB = "bitsandbytes"
# bitsandbytes' operators whose output size is the number of outlier columns (LLM.int8)
_OUTLIER_OPS = ("int8_vectorwise_quant", "int8_double_quant", "int8_mixed_scaled_mm")
_MISSING_BINDING = re.compile(r"AttributeError: module 'torch\._C' has no attribute '(_cuda\w*)'")
_ELSEWHERE = ("torch", "importlib", "memprof", "__main__", "runpy", "")  # not the library
_INSTEAD = "profile this script on a GPU, or its host tensors with --device cpu"
_told: set[str] = set()


class Extensions:
    """While installed: bitsandbytes imports and runs (module doc), DeepSpeed's fused
    optimizers run (``deepspeed_ops.py``), and libraries' parameter classes become virtual
    on the card (``subclasses.py``)."""

    def __init__(self) -> None:
        self._finder: FirstImport | None = None
        self._saved: list[tuple[Any, str, Any]] = []  # (owner, name, value or _ABSENT)
        self._kernels: torch.library.Library | None = None
        self._deepspeed = DeepSpeedOps()

    def install(self) -> None:
        self._patch(torch.Tensor, "_make_subclass", staticmethod(subclasses.make_subclass))
        self._deepspeed.install()
        self._finder = when_imported(_BNB, self._as_on_this_machine, self._bitsandbytes)

    def remove(self) -> None:
        self._deepspeed.remove()
        forget(self._finder)
        self._finder = None
        if self._kernels is not None:
            self._kernels._destroy()
            self._kernels = None
        for owner, name, value in reversed(self._saved):
            if value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved.clear()

    @contextlib.contextmanager
    def _as_on_this_machine(self) -> Iterator[None]:
        """``torch.cuda.is_available`` as the machine answers it; ``torch.Tensor`` as torch
        made it (the import brings in Dynamo, whose polyfills key on ``_make_subclass``);
        ``torch.compile`` of bitsandbytes' own CPU kernels eager without the virtual GPU's
        notice, which would say the script compiled something."""
        virtual = torch.cuda.is_available, torch.compile
        torch.cuda.is_available, torch.compile = _MACHINE_HAS_CUDA, _eager  # type: ignore
        del torch.Tensor._make_subclass
        try:
            yield
        finally:
            torch.cuda.is_available, torch.compile = virtual  # type: ignore[assignment]
            torch.Tensor._make_subclass = staticmethod(subclasses.make_subclass)

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, vars(owner).get(name, _ABSENT)))
        setattr(owner, name, value)

    def _bitsandbytes(self) -> None:
        """Paged state on the host, and outlier columns at their largest (module doc)."""
        functional = sys.modules.get(f"{_BNB}.functional")
        if functional is None:  # an import that failed part way
            return
        if hasattr(functional, "get_paged"):
            self._patch(functional, "get_paged", _paged)
        for name in ("prefetch_tensor", "elementwise_func"):  # native calls on values
            if hasattr(functional, name):
                self._patch(functional, name, _valueless(getattr(functional, name)))
        self._kernels = _largest_outliers()


_ABSENT = object()


def _eager(model: Any = None, **options: Any) -> Any:
    """``torch.compile`` as a call or a decorator factory: the function itself."""
    return (lambda fn: fn) if model is None else model


def _paged(*shape: int, dtype: torch.dtype = torch.float32, device: Any = None
           ) -> torch.Tensor:
    """``bitsandbytes.functional.get_paged``: CUDA managed memory, not the caching
    allocator's, so a storage-less host tensor (``is_paged``, as bitsandbytes marks it)."""
    _say_once("paged", "memprof: virtual GPU: bitsandbytes' paged optimizer state lives in"
              " CUDA managed memory, outside PyTorch's allocator: as memory_allocated() on a"
              " card, the prediction leaves it out")
    with torch._C.DisableTorchFunction():
        elem = torch.empty(shape, dtype=dtype, device="meta")
    out = HostVirtualTensor(elem, requires_grad=False)
    out.is_paged = True
    out.page_deviceid = torch.device(device).index if device is not None else 0
    return out


def _valueless(original: Callable[..., Any]) -> Callable[..., Any]:
    """A bitsandbytes function that writes a tensor's values through its native library:
    nothing to do for a virtual tensor."""
    def call(*args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, VirtualTensor) for a in (*args, *kwargs.values())):
            return None
        return original(*args, **kwargs)
    return call


class _AllColumns:
    """A fake kernel's context whose data-dependent size is every column of its input."""

    def __init__(self, columns: int) -> None:
        self.columns = columns

    def new_dynamic_size(self, **bounds: int | None) -> int:  # min=, max=
        _say_once("outliers", "memprof: virtual GPU: bitsandbytes' LLM.int8 outlier columns"
                  " (threshold > 0) depend on the values: taken at their largest, every"
                  " column")
        most = bounds.get("max")
        return self.columns if most is None else min(self.columns, most)


def _largest_outliers() -> torch.library.Library | None:
    """Meta kernels for :data:`_OUTLIER_OPS`: bitsandbytes' fake kernels, their outlier
    count every column of ``A``; None where this torch cannot override a kernel."""
    try:
        from torch._library.fake_impl import set_ctx_getter
        from torch._library.simple_registry import singleton
    except ImportError:
        return None
    kernels = torch.library.Library(_BNB, "IMPL")
    for name in _OUTLIER_OPS:
        fake = singleton.find(f"{_BNB}::{name}").fake_impl.kernel
        if fake is None:
            continue

        def meta(a: torch.Tensor, *args: Any, _fake: Any = fake, **kwargs: Any) -> Any:
            with set_ctx_getter(lambda: _AllColumns(a.shape[-1])):
                return _fake(a, *args, **kwargs)

        try:
            with warnings.catch_warnings():  # "overriding a previously registered kernel"
                warnings.simplefilter("ignore")
                kernels.impl(name, meta, "Meta", allow_override=True)
        except (TypeError, RuntimeError):  # torch before allow_override: bitsandbytes' own
            kernels._destroy()
            return None
    return kernels


def _say_once(key: str, text: str) -> None:
    if key not in _told:
        _told.add(key)
        say(text)


def extension_failure(outcome: Outcome) -> str | None:
    """memprof's line for a script that died inside a library of CUDA kernels, or on a
    ``torch._C._cuda*`` binding of PyTorch's CUDA build; None otherwise."""
    error = outcome.error or ""
    if outcome.status != "raised" or error.startswith("VirtualGpuUnsupported"):
        return None  # the script's last line, memprof's own, already says what and why
    tops = [m.split(".")[0] for m in outcome.raised_in]
    binding = _MISSING_BINDING.match(error)
    if binding is not None:
        caller = next((m for m, top in zip(reversed(outcome.raised_in), reversed(tops),
                                            strict=True) if top not in _ELSEWHERE), None)
        who = CUDA_EXTENSIONS.get(caller.split(".")[0], caller) if caller else "the script"
        return (f"memprof: {who} needs torch._C.{binding[1]}, which only a CUDA build of"
                f" PyTorch has: the virtual GPU runs PyTorch's operators, not {who}'s own"
                f" CUDA code; {_INSTEAD}")
    inside = next((m for m, top in zip(reversed(outcome.raised_in), reversed(tops),
                                       strict=True) if top in CUDA_EXTENSIONS), None)
    if inside is None:
        return None
    library = CUDA_EXTENSIONS[inside.split(".")[0]]
    return (f"memprof: the script failed inside {library} ({inside}), a library with CUDA"
            f" kernels of its own: the virtual GPU runs PyTorch's operators, not those"
            f" kernels; {_INSTEAD}")
