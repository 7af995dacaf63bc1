"""DTensor on the virtual GPU: a DTensor whose local tensor is virtual is on the card.

``DTensor`` (FSDP2's sharded parameters, tensor parallel's) is a wrapper whose device C++
takes from its local tensor, where it sees a virtual tensor's ``meta``: FSDP2 would refuse
the parameters as "still on meta device". While the virtual GPU has a process group, a
DTensor answers ``device``, ``is_cuda``, ``is_meta`` and ``get_device()`` as its local
tensor does; its operators already run on the local tensors. A DTensor a factory makes
for CUDA from a meta one (``module.to_empty(device="cuda")`` after ``fully_shard`` on the
meta device) gets a virtual local tensor (``with_local``); sharding propagation sizes
outputs on meta tensors, and random operators (``reset_parameters()``) keep the RNG state
of the card as a virtual tensor of real values.

    patches = dtensor_patches()  # by (class, attribute), applied with the first group
"""

from __future__ import annotations

from typing import Any

import torch

from memprof.collect.virtual.tensor import VirtualTensor, virtual_like

_TENSOR = torch._C.TensorBase.__dict__


def on_card(t: object) -> bool:
    """Whether ``t`` is a DTensor whose local tensor is virtual."""
    return isinstance(getattr(t, "_local_tensor", None), VirtualTensor)


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (without importing DTensor: it is slow to import)."""
    return isinstance(t, torch.Tensor) and isinstance(getattr(t, "_local_tensor", None),
                                                       torch.Tensor)


def with_local(t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``t``, a DTensor made for the card from a meta one (``to_empty(device="cuda")``),
    holding ``local``, its local tensor made virtual."""
    t._local_tensor = local  # type: ignore[attr-defined]
    return t


def _local_or(name: str) -> property:
    """The attribute ``name`` of a DTensor: its virtual local tensor's, else its own."""
    own = _TENSOR[name]

    def get(self: torch.Tensor) -> Any:
        local = getattr(self, "_local_tensor", None)
        return getattr(local, name) if isinstance(local, VirtualTensor) else own.__get__(self)
    return property(get)


def _get_device(self: torch.Tensor) -> int:
    local = getattr(self, "_local_tensor", None)
    return local.get_device() if isinstance(local, VirtualTensor) else _GET_DEVICE(self)


_GET_DEVICE = torch.Tensor.get_device


def _fake_on_meta(spec: Any) -> torch.Tensor:
    """``_rebuild_tensor_from_dtensor_meta``: the tensor DTensor's sharding propagation runs
    an operator on to learn its output's shape, on the meta device for a CUDA mesh (a CPU
    build's fake CUDA tensors fail in random operators' decompositions: ``uniform_``)."""
    meta = spec.tensor_meta
    device = "meta" if spec.mesh.device_type == "cuda" else spec.mesh.device_type
    return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)


def _device_state(tracker: Any) -> torch.Tensor:
    """``OffsetBasedRNGTracker._get_device_state``: the card's RNG state (Philox's seed and
    offset) copied to the card, as a virtual tensor (its 16 bytes hold real values)."""
    return virtual_like(tracker._device_handle.get_rng_state())


def dtensor_patches() -> dict[tuple[Any, str], Any]:
    """The ``DTensor`` attributes that answer for a virtual local tensor, its sharding
    propagation on meta tensors, and its random operators' state on the card."""
    from torch.distributed.tensor import DTensor, _op_schema, _random

    return {**{(DTensor, name): _local_or(name) for name in ("device", "is_cuda", "is_meta")},
            (DTensor, "get_device"): _get_device,
            (_op_schema, "_rebuild_tensor_from_dtensor_meta"): _fake_on_meta,
            (_random.OffsetBasedRNGTracker, "_get_device_state"): _device_state}
