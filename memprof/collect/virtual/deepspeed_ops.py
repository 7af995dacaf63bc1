"""DeepSpeed's fused optimizers on the virtual GPU.

A DeepSpeed config's ``"optimizer": {"type": "AdamW"}`` (or Adam, Lion) builds
``FusedAdam``, whose ``FusedAdamBuilder().load()`` compiles DeepSpeed's CUDA kernels with
nvcc: on a machine without CUDA it dies (``CUDA_HOME environment variable is not set``).
Its kernels (``multi_tensor_adam``, ``multi_tensor_lion``) update the parameters and
moments in place and allocate nothing; the optimizer makes its state with PyTorch's own
``zeros_like``. So the virtual GPU hands DeepSpeed, for those ops alone, modules whose
kernels do nothing (values are not modelled), through the cache ``OpBuilder.load`` reads
first: the state and the peaks stay what a card would show. Other DeepSpeed ops build as
they would, and fail as they would where they need CUDA (``extensions.extension_failure``
names DeepSpeed then).
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

from memprof.collect.virtual.first_import import FirstImport, forget, when_imported

_BUILDER = "deepspeed.ops.op_builder.builder"
# DeepSpeed's op names, and the kernel each one's module gives its optimizer
IN_PLACE_KERNELS = {"fused_adam": "multi_tensor_adam", "fused_lion": "multi_tensor_lion"}


def _in_place(chunk_size: int, noop_flag: Any, tensor_lists: Any, *args: Any) -> None:
    """A multi-tensor kernel that updates its tensors in place: no memory, no values."""


class DeepSpeedOps:
    """While installed: ``load()`` of DeepSpeed's in-place fused optimizers gives the
    do-nothing kernels (module doc), installed when DeepSpeed's op builders are imported."""

    def __init__(self) -> None:
        self._added: list[str] = []
        self._finder: FirstImport | None = None

    def install(self) -> None:
        self._finder = when_imported(_BUILDER, contextlib.nullcontext, self._fill)

    def _fill(self) -> None:
        cache = getattr(getattr(sys.modules.get(_BUILDER), "OpBuilder", None), "_loaded_ops",
                        None)
        if not isinstance(cache, dict):  # a DeepSpeed without the cache: its own load
            return
        for name, kernel in IN_PLACE_KERNELS.items():
            if name not in cache:
                module = types.ModuleType(f"memprof_virtual_{name}_op")
                setattr(module, kernel, _in_place)
                cache[name] = module
                self._added.append(name)

    def remove(self) -> None:
        forget(self._finder)
        self._finder = None
        cache = getattr(getattr(sys.modules.get(_BUILDER), "OpBuilder", None), "_loaded_ops",
                        None)
        for name in self._added:
            if isinstance(cache, dict):
                cache.pop(name, None)
        self._added.clear()
