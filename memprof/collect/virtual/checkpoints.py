"""``torch.save`` and ``torch.load`` on the virtual GPU.

A checkpoint of virtual tensors pickles each as PyTorch pickles a storage-less wrapper
tensor (``torch._utils._rebuild_wrapper_subclass`` of a plain ``torch.Tensor``: a global
the weights-only unpickler allows), so the script's own ``torch.load`` reads it back, as
virtual tensors again, on the device ``map_location`` names. A real checkpoint (saved on
a GPU) loads its storages on the host, where this machine can, and its CUDA tensors
become virtual CUDA tensors: allocated on the card, as the load would. Scalars stay real
host tensors, so values that steer the script (an optimizer's step count) are kept.

A checkpoint of virtual tensors saved to a path goes to a scratch file instead, read back
by the run's own ``torch.load`` of that path: a file of placeholders must not replace the
user's real checkpoint (``out/ckpt.pt`` from a GPU run, say). The script's own moves,
copies and removals of that path (``os.replace(tmp, last)``, as an atomic save does;
``shutil.copyfile``, ``os.remove``) and its ``os.path.exists`` follow the scratch file.
Folders the script made during the run on the way to such a path are removed at its end
where they stayed empty: a run that resumes from the newest checkpoint folder (an example's
``checkpoints/<time>/``) would otherwise find an empty one and fail to load it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch._weights_only_unpickler as weights_only
from torch.serialization import _package_registry
from torch.utils._pytree import tree_leaves, tree_map

from memprof.collect.notices import say
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
        self._scratch: str | None = None  # the folder of the scratch files, made at need
        self._redirects: dict[str, str] = {}  # real path -> its scratch file
        self._made = 0  # scratch files named so far
        self._saved_to: set[str] = set()  # every real path a scratch file stood for
        self._created: list[str] = []  # the folders the script made, in order
        self._mkdir = os.mkdir
        # the originals, for the scratch files themselves
        self._copyfile, self._unlink = shutil.copyfile, os.unlink

    def patches(self) -> dict[tuple[Any, str], Any]:
        """The attributes to replace while the virtual GPU runs."""
        return {(torch._utils, "_rebuild_wrapper_subclass"): _rebuild, (torch, "load"): self.load,
                (torch, "save"): self.save,
                **{(os, name): self._following(getattr(os, name), self._move)
                   for name in ("replace", "rename")},
                **{(os, name): self._following(getattr(os, name), self._remove)
                   for name in ("remove", "unlink")},
                (shutil, "copyfile"): self._following(shutil.copyfile, self._copy),
                (os, "mkdir"): self._made_folder,  # os.makedirs and Path.mkdir call it
                (os, "link"): self._following(os.link, self._copy),
                **{(os.path, name): self._found(getattr(os.path, name))
                   for name in ("exists", "isfile")}}

    def _redirected(self, path: Any) -> str | None:
        """The real path of ``path`` where this run saved virtual tensors to it, else None."""
        if not self._redirects or not isinstance(path, (str, os.PathLike)):
            return None
        real = os.path.realpath(path)
        return real if real in self._redirects else None

    def _following(self, original: Callable[..., Any], instead: Callable[..., Any]
                   ) -> Callable[..., Any]:
        """``original(path, ...)``, or ``instead(real path, ...)`` where the run redirected
        ``path`` (a file operation on it follows its scratch file)."""
        @functools.wraps(original)
        def follow(path: Any, *args: Any, **kwargs: Any) -> Any:
            real = self._redirected(path)
            return original(path, *args, **kwargs) if real is None else instead(real, *args)
        return follow

    def _move(self, real: str, dst: Any, *_: Any) -> None:
        """``os.replace``/``os.rename``: the scratch file stands for ``dst`` now."""
        self._redirects[os.path.realpath(dst)] = self._redirects.pop(real)
        self._saved_to.add(os.path.realpath(dst))

    def _copy(self, real: str, dst: Any, *_: Any) -> Any:
        """``shutil.copyfile``/``os.link``: ``dst`` gets a copy of the scratch file."""
        self._copyfile(self._redirects[real], self._scratch_of(dst))
        return dst

    def _remove(self, real: str, *_: Any) -> None:
        """``os.remove``/``os.unlink``: the scratch file goes."""
        self._unlink(self._redirects.pop(real))

    def _found(self, original: Callable[..., bool]) -> Callable[..., bool]:
        @functools.wraps(original)
        def found(path: Any) -> bool:
            return self._redirected(path) is not None or original(path)
        return found

    def _made_folder(self, path: Any, *args: Any, **kwargs: Any) -> None:
        """``os.mkdir``, remembering the folder it made."""
        self._mkdir(path, *args, **kwargs)
        if isinstance(path, (str, os.PathLike)) and "dir_fd" not in kwargs:
            self._created.append(os.path.realpath(path))

    def _scratch_of(self, path: Any) -> str:
        """The scratch file that stands for ``path`` (made at need)."""
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix="memprof-checkpoints-")
        real = os.path.realpath(path)
        if real not in self._redirects:
            self._made += 1
            self._redirects[real] = os.path.join(self._scratch, f"{self._made}.pt")
            self._saved_to.add(real)
        return self._redirects[real]

    def install(self) -> None:
        _package_registry.append(self._entry)
        _package_registry.sort(key=lambda entry: entry[0])
        weights_only._get_allowed_globals.cache_clear()  # it caches the rebuild functions

    def remove(self) -> None:
        _package_registry.remove(self._entry)
        weights_only._get_allowed_globals.cache_clear()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        self._redirects.clear()
        self._remove_empty_folders()

    def _remove_empty_folders(self) -> None:
        """The folders the script made on the way to a path saved to a scratch file, where
        they stayed empty (the deepest first)."""
        ways = {os.path.dirname(p) for p in self._saved_to}
        for folder in reversed(self._created):
            if any(way == folder or way.startswith(folder + os.sep) for way in ways):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)  # only an empty one
        self._created.clear()
        self._saved_to.clear()

    def load(self, f: Any, *args: Any, **kwargs: Any) -> Any:
        """``torch.load``: real tensors the checkpoint puts on CUDA become virtual ones; a
        path this run saved virtual tensors to reads its scratch file."""
        if isinstance(f, (str, os.PathLike)):
            f = self._redirects.get(os.path.realpath(f), f)
        self._mapped.clear()
        weights_only._get_allowed_globals.cache_clear()
        loaded = self._load(f, *args, **kwargs)
        return tree_map(self._virtual, loaded) if self._mapped else loaded

    def save(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        """``torch.save``: a checkpoint of virtual tensors saved to a path goes to a scratch
        file (see the module doc), and memprof says so once."""
        if not isinstance(f, (str, os.PathLike)) or not _holds_virtual(obj):
            self._save(obj, f, *args, **kwargs)
            return
        scratch = self._scratch_of(f)
        if not self._told:
            self._told = True
            say(f"memprof: virtual GPU: torch.save({os.fspath(f)}) holds virtual tensors (no"
                " weights): it went to a scratch file, the path is left as it was (folders"
                " made for it are removed if they stay empty), and torch.load in this run"
                " reads it back")
        self._save(obj, scratch, *args, **kwargs)

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


def _holds_virtual(obj: Any) -> bool:
    """Whether ``obj`` (a state dict, a module, nested containers) holds a virtual tensor."""
    tensors = [*obj.parameters(), *obj.buffers()] if isinstance(obj, torch.nn.Module) \
        else tree_leaves(obj)
    return any(isinstance(t, VirtualTensor) for t in tensors)
