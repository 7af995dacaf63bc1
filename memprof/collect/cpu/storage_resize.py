"""``UntypedStorage.resize_`` seen by the recorders: a shrink to 0 frees, a regrowth allocates.

FSDP2 frees its gathered parameters with ``untyped_storage().resize_(0)`` and gathers
them again with ``resize_(n)``, as offloading libraries do. No operator is dispatched
there, so the storage trackers would go on counting the bytes; on a card PyTorch frees
the block at ``resize_(0)`` and allocates a new one at ``resize_(n)``. While installed,
every resize is reported to ``on_resize`` with the frame that called it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

_ORIGINAL = torch.UntypedStorage.resize_


class ResizeWatch:
    """Patches ``torch.UntypedStorage.resize_`` while entered (not reentrant)."""

    def __init__(self, on_resize: Callable[[torch.UntypedStorage, FrameType | None], None]
                 ) -> None:
        self._on_resize = on_resize

    def __enter__(self) -> ResizeWatch:
        on_resize = self._on_resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = _ORIGINAL(storage, size)
            on_resize(storage, sys._getframe(1))
            return out

        resize_.__doc__ = _ORIGINAL.__doc__
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = _ORIGINAL  # type: ignore[method-assign]
