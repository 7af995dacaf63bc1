"""Batches that DataLoader worker processes send: storages no operator made in this process.

A worker builds its batch in shared memory and sends it through a queue; this process
maps it when it unpickles the batch (``torch.multiprocessing.reductions``), and the
tensor is wrapped around the mapped storage with ``set_``, so the dispatcher never sees
an allocation. On the CPU path that memory is the process's own, as a batch made with
``num_workers=0`` is: :class:`WorkerBatches` reports each mapped storage to the tracker
(``StorageTracker.adopt_shared``), which records it as allocated where the script took
the batch.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.multiprocessing.reductions as reductions

from memprof.collect.cpu.storages import StorageTracker

_REBUILDERS = ("rebuild_storage_fd", "rebuild_storage_filename")
_ORIGINAL = {name: getattr(reductions, name) for name in _REBUILDERS}
_tracker: StorageTracker | None = None


def rebuild_storage_fd(*args: Any) -> Any:
    """``reductions.rebuild_storage_fd``, reporting the storage it maps."""
    return _adopted(_ORIGINAL["rebuild_storage_fd"](*args))


def rebuild_storage_filename(*args: Any) -> Any:
    """``reductions.rebuild_storage_filename``, reporting the storage it maps."""
    return _adopted(_ORIGINAL["rebuild_storage_filename"](*args))


def _adopted(storage: Any) -> Any:
    tracker = _tracker
    if tracker is not None:
        untyped = storage if isinstance(storage, torch.UntypedStorage) else storage.untyped()
        tracker.adopt_shared(untyped, sys._getframe(2))
    return storage


class WorkerBatches:
    """Reports the storages of batches from worker processes to ``tracker`` while
    installed (module-level functions: the queue pickles them by name)."""

    def __init__(self, tracker: StorageTracker) -> None:
        self._tracker = tracker

    def install(self) -> None:
        global _tracker
        _tracker = self._tracker
        for name in _REBUILDERS:
            setattr(reductions, name, globals()[name])

    def remove(self) -> None:
        global _tracker
        _tracker = None
        for name, original in _ORIGINAL.items():
            setattr(reductions, name, original)
