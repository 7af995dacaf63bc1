"""Real values for small virtual tensors, where values decide shapes and control flow.

A batch loader that draws its offsets on the card (``i = torch.randint(n, (b,),
device="cuda")``, then ``data[i:i + ctx]``), a step counter read with ``.item()``, a
mask's ``nonzero()``: values decide sizes far more often through such small tensors than
through data. A virtual tensor of at most :data:`SMALL` elements keeps a host twin
(``value``), computed for real on the CPU beside its meta tensor, whenever every tensor
the operator reads has one; ``.item()``, ``int()``, ``__index__``, ``.tolist()`` and
printing read it. Large tensors stay storage-less. Random operators draw from the CPU's
generator with its state put back after, so the script's own host random stream is the one
Python alone would give.
"""

from __future__ import annotations

from typing import Any

import torch

SMALL = 4096  # elements: a twin costs at most 32 KiB (float64), and a CPU kernel's microseconds
_CUDA = "cuda"
_CPU = torch.device("cpu")
_SEEDED = getattr(torch.Tag, "nondeterministic_seeded", None)


class _NoValue(Exception):
    """An input without a host twin: the output's value is unknown."""


def small(out: Any) -> bool:
    """Whether every tensor in an operator's output has at most :data:`SMALL` elements."""
    if isinstance(out, torch.Tensor):
        return out.numel() <= SMALL
    if isinstance(out, (tuple, list)):
        return all(small(x) for x in out)
    return True


def twins(args: tuple, kwargs: dict[str, Any], virtual: type) -> tuple[tuple, dict] | None:
    """The operator's arguments with each virtual tensor replaced by its host twin and CUDA
    devices by the CPU; None when a virtual tensor has none."""
    try:
        return _host(args, virtual), {k: _CPU if k == "device" and _on_card(v) else
                                      _host(v, virtual) for k, v in kwargs.items()}
    except _NoValue:
        return None


def _on_card(device: Any) -> bool:
    """Whether a ``device=`` argument names the card: CUDA, or the meta device a virtual
    tensor's operator runs on (``.to(device=t.device, dtype=...)`` of a virtual ``t``)."""
    try:
        return device is not None and torch.device(device).type in (_CUDA, "meta")
    except (RuntimeError, TypeError):
        return False


def _host(x: Any, virtual: type) -> Any:
    if isinstance(x, virtual):
        value = x.value  # type: ignore[attr-defined]
        if value is None:
            raise _NoValue
        return value
    if type(x) is tuple or type(x) is list:
        return type(x)(_host(v, virtual) for v in x)
    if isinstance(x, torch.device) and _on_card(x):
        return _CPU
    if isinstance(x, torch.Tensor) and x.device.type != "cpu":  # a plain meta tensor
        raise _NoValue
    return x


def compute(func: Any, args: tuple, kwargs: dict[str, Any], seeded: bool | None = None) -> Any:
    """``func`` on host twins (``twins``), the CPU's random state kept; None if it fails (a
    kernel the CPU lacks for a dtype, say): the values are then unknown."""
    if seeded is None:
        seeded = _SEEDED is not None and _SEEDED in getattr(func, "tags", ())
    state = torch.random.get_rng_state() if seeded else None
    try:
        return func(*args, **kwargs)
    except Exception:
        return None
    finally:
        if state is not None:
            torch.random.set_rng_state(state)


def attach(wrapped: Any, real: Any) -> None:
    """Give each virtual tensor in ``wrapped`` its twin, the tensor at the same place in
    ``real`` (an operator's outputs, two ways)."""
    if isinstance(wrapped, torch.Tensor):
        if isinstance(real, torch.Tensor) and real.shape == wrapped.shape:
            wrapped.value = real  # type: ignore[attr-defined]
    elif isinstance(wrapped, (tuple, list)) and isinstance(real, (tuple, list)) \
            and len(wrapped) == len(real):
        for w, r in zip(wrapped, real, strict=True):
            attach(w, r)


def shapes(out: Any) -> Any:
    """The shapes of the tensors in an operator's output, in its structure."""
    if isinstance(out, torch.Tensor):
        return tuple(out.shape)
    if isinstance(out, (tuple, list)):
        return tuple(shapes(x) for x in out)
    return None


def meta_like(real: Any) -> Any:
    """Meta tensors shaped as ``real``'s (an operator whose output size its values set)."""
    if isinstance(real, torch.Tensor):
        return torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="meta")
    if isinstance(real, (tuple, list)):
        return type(real)(meta_like(x) for x in real)
    return real


def forget_written(func: Any, args: tuple, virtual: type) -> None:
    """An in-place operator ran without values: the twins of what it wrote are stale."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return
    for arg, value in zip(schema.arguments, args, strict=False):
        if arg.alias_info is not None and arg.alias_info.is_write:
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, virtual):
                    t.value = None  # type: ignore[attr-defined]
