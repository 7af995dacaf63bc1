"""``torch.save`` and ``torch.load`` on the virtual GPU.

A checkpoint of virtual tensors pickles each as PyTorch pickles a storage-less wrapper
tensor (``torch._utils._rebuild_wrapper_subclass`` of a plain ``torch.Tensor``: a global
the weights-only unpickler allows), so the script's own ``torch.load`` reads it back, as
virtual tensors again, on the device ``map_location`` names. A real checkpoint (saved on
a GPU) loads its storages on the host, where this machine can, and its CUDA tensors
become virtual CUDA tensors: allocated on the card, as the load would. Scalars stay real
host tensors, so values that steer the script (an optimizer's step count) are kept.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch._weights_only_unpickler as weights_only
from torch.serialization import _package_registry
from torch.utils._pytree import tree_map

from memprof.collect.virtual.tensor import HostVirtualTensor, VirtualTensor, adopt, virtual_like

_REBUILD = torch._utils._rebuild_wrapper_subclass
_PRIORITY = 15  # before CUDA's own deserializer (20), which needs a CUDA build


def _rebuild(cls: type, dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...],
             storage_offset: int, layout: torch.layout, device: torch.device,
             requires_grad: bool) -> torch.Tensor:
    """``_rebuild_wrapper_subclass`` while the virtual GPU runs: a virtual tensor where
    ``map_location`` puts it (on the host, a storage-less host tensor)."""
    if cls is not torch.Tensor:
        return _REBUILD(cls, dtype, size, stride, storage_offset, layout, device, requires_grad)
    where = torch.device(torch._utils._get_restore_location(device))
    kind = HostVirtualTensor if where.type == "cpu" else VirtualTensor
    with torch._C.DisableTorchFunction():
        elem = torch.empty_strided(size, stride, dtype=dtype, device="meta")
    return adopt(kind(elem, requires_grad=requires_grad))


# pickle names a function by where it lives; while patched in, this is PyTorch's own name
_rebuild.__module__, _rebuild.__name__ = "torch._utils", "_rebuild_wrapper_subclass"
_rebuild.__qualname__ = _rebuild.__name__


class Checkpoints:
    """The patches that make checkpoints work on the virtual GPU (see the module doc)."""

    def __init__(self) -> None:
        self._mapped: set[int] = set()  # data pointers of real storages mapped to CUDA
        self._entry = (_PRIORITY, lambda storage: None, self._to_host)
        self._load, self._save = torch.load, torch.save
        self._told = False

    def patches(self) -> dict[tuple[Any, str], Any]:
        """The attributes to replace while the virtual GPU runs."""
        return {(torch._utils, "_rebuild_wrapper_subclass"): _rebuild, (torch, "load"): self.load,
                (torch, "save"): self.save}

    def install(self) -> None:
        _package_registry.append(self._entry)
        _package_registry.sort(key=lambda entry: entry[0])
        weights_only._get_allowed_globals.cache_clear()  # it caches the rebuild functions

    def remove(self) -> None:
        _package_registry.remove(self._entry)
        weights_only._get_allowed_globals.cache_clear()

    def load(self, *args: Any, **kwargs: Any) -> Any:
        """``torch.load``: real tensors the checkpoint puts on CUDA become virtual ones."""
        self._mapped.clear()
        weights_only._get_allowed_globals.cache_clear()
        loaded = self._load(*args, **kwargs)
        return tree_map(self._virtual, loaded) if self._mapped else loaded

    def save(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        """``torch.save``, saying once that a checkpoint of virtual tensors holds no weights."""
        if not self._told:
            self._told = True
            print(f"memprof: virtual GPU: torch.save wrote {getattr(f, 'name', f)} with"
                  " placeholder tensors (no"
                  " weights): memprof runs read it back, plain PyTorch cannot", file=sys.stderr)
        self._save(obj, f, *args, **kwargs)

    def _to_host(self, storage: Any, location: str) -> Any:
        if not location.startswith("cuda"):
            return None
        self._mapped.add(storage.data_ptr())
        return storage

    def _virtual(self, x: Any) -> Any:
        # scalars keep their real values on the host (an optimizer's `step` must count, not
        # read a placeholder zero and divide by it); a scalar is one 512-byte block on a card
        if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.dim() == 0 \
                or x.untyped_storage().data_ptr() not in self._mapped:
            return x
        t = virtual_like(x)
        return torch.nn.Parameter(t, x.requires_grad) if type(x) is torch.nn.Parameter else t
