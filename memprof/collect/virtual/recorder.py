"""The virtual GPU's recorder: CUDA storages only, placed live by the allocator model.

A :class:`StorageTracker` that records the storages of virtual CUDA tensors (host
tensors are not device memory) and places every event in the caching-allocator
simulator as it happens, so the memory API answers live and an allocation that would
not fit on the card raises ``torch.OutOfMemoryError`` where the card would.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from types import FrameType

import torch

import memprof.collect
from memprof.analysis.allocator import CachingAllocator
from memprof.analysis.blocks import OutOfMemory
from memprof.analysis.layout import Placer
from memprof.collect.cpu.storages import StorageTracker, _StorageRef
from memprof.collect.frames import StackCapture
from memprof.collect.tensors import tensors_in
from memprof.collect.virtual import kernel_memory
from memprof.collect.virtual.accumulate import ADD, accumulates_in_place
from memprof.collect.virtual.cards import Card
from memprof.collect.virtual.dtensors import on_card
from memprof.collect.virtual.tensor import CUDNN_ATTENTION, VirtualTensor, card_device
from memprof.collect.virtual.workspaces import CublasWorkspaces, blas_workspace_sizes
from memprof.trace.events import ADDR, STACK, TIME_US, OomEvent, Stack, TraceEvent
from memprof.trace.model import WORKSPACE, AllocatorSettings

_COLLECT = str(Path(memprof.collect.__file__).resolve().parent)


class _UserStacks(StackCapture):
    """Stacks without memprof's own frames (the routing mode sits between user and torch)."""

    def _build(self, frame: FrameType | None) -> Stack:
        return tuple(f for f in super()._build(frame) if not f[1].startswith(_COLLECT))


class _BesideTheVirtualGpu(StorageTracker):
    """A storage tracker whose operators' callers and stacks skip memprof's frames (the
    routing mode, another recorder's dispatch mode) between the user's code and torch."""

    def __init__(self, max_entries: int | None = None) -> None:
        super().__init__(max_entries)
        self._stacks = _UserStacks()

    def _op_frame(self) -> FrameType | None:
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith(_COLLECT)
                                     or id(frame.f_code) in self._wrappers):
            frame = frame.f_back
        return frame


class HostStorages(_BesideTheVirtualGpu):
    """The host tensors' storages only, recorded beside the virtual GPU (for code that
    turns out to make no CUDA tensor): its storage-less tensors are its own recorder's."""

    def _record(self, out: object, func: object, args: tuple, kwargs: dict) -> None:
        host = [t for t in tensors_in(out)
                if not isinstance(t, VirtualTensor) and t.device.type == "cpu"]
        if host:
            super()._record(host, func, args, kwargs)


class VirtualRecorder(_BesideTheVirtualGpu):
    """Records virtual CUDA storages and keeps the predicted allocator state current."""

    def __init__(self, card: Card, settings: AllocatorSettings, announce: str | None = None,
                 max_entries: int | None = None) -> None:
        super().__init__(max_entries)
        self._announce = announce  # said when the first CUDA tensor is made
        self.card = card
        self.placer = Placer(CachingAllocator(settings, limit=card.usable_bytes))
        self.allowed: int | None = None  # set_per_process_memory_fraction's cap
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.run_peak_allocated = 0  # as peak_*, but never reset by the script
        self.run_peak_reserved = 0
        self.ooms = 0
        # memory_stats' cumulative counters: [count, bytes] allocated and freed since the start
        self.allocated_total = [0, 0]
        self.freed_total = [0, 0]
        self.peak_blocks = 0  # blocks allocated at once, at most
        self._workspaces = CublasWorkspaces(*blas_workspace_sizes(card.capability, os.environ))
        self._held: list[VirtualTensor] = []  # cuBLAS workspaces: never freed

    @property
    def allocator(self) -> CachingAllocator:
        return self.placer.alloc

    def set_fraction(self, fraction: float) -> None:
        """``set_per_process_memory_fraction``: cap reserved memory at a share of the card."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.allowed = int(fraction * self.card.total_bytes)
        self.allocator.limit = min(self.card.usable_bytes, self.allowed)

    def run_peak(self) -> dict[str, int | None]:
        """The run's peaks as the allocator model counted them, dropped events included."""
        return {**super().run_peak(), "allocated_bytes": self.run_peak_allocated,
                "reserved_bytes": self.run_peak_reserved}

    def reset_peaks(self) -> None:
        """``reset_peak_memory_stats()``: peaks restart from what is held now."""
        self.peak_allocated = self.allocator.allocated
        self.peak_reserved = self.allocator.reserved
        self.peak_blocks = self.allocated_total[0] - self.freed_total[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is ADD and accumulates_in_place(args, kwargs or {}, self._caller()):
            return args[0]  # the engine's gradient sum, in place as on the card
        return super().__torch_dispatch__(func, types, args, kwargs)

    def adopt(self, t: VirtualTensor) -> None:
        """Record a virtual tensor made outside an operator (a factory, a host copy)."""
        if self._announce and type(t) is VirtualTensor:
            print(self._announce, file=sys.stderr)
            self._announce = None
        self._record(t, None, (), {})

    def adopt_shared(self, st: torch.UntypedStorage, frame: FrameType | None) -> None:
        """A worker's batch is host memory: not the card's."""

    def _record(self, out: object, func: object, args: tuple, kwargs: dict) -> None:
        virtual = [v for t in tensors_in(out) for v in _card_tensors(t)]  # not host ones
        if not virtual:
            return
        if func is CUDNN_ATTENTION:  # MHA.cpp makes the RNG seed and offset first
            virtual = virtual[-2:] + virtual[:-2]
        found = None  # what the kernel requests beyond its outputs (``kernel_memory.py``)
        if func is not None and getattr(func, "_opname", None) in kernel_memory.NAMES:
            found = kernel_memory.scratch(func, args, kwargs, self.card)
        early = self._requests(found.early) if found else []
        super()._record(virtual, func, args, kwargs)
        if func is not None:
            self._cublas_workspaces(str(func), args, kwargs)
            if found is not None:
                _release(self._requests(found.steps))
        _release(early)

    def _requests(self, steps: tuple[int | tuple[int, ...], ...]) -> list[VirtualTensor]:
        """Request a kernel's scratch ``steps`` (``kernel_memory.Scratch``): each launch's
        blocks freed (last first) once queued; the held blocks, for the caller to free."""
        kept = []
        for step in steps:
            if type(step) is tuple:
                _release([self._scratch_block(size) for size in step])
            else:
                kept.append(self._scratch_block(step))
        return kept

    def _scratch_block(self, size: int) -> VirtualTensor:
        """A recorded block of ``size`` bytes that no tensor of the script holds."""
        with torch._C.DisableTorchFunction():
            block = VirtualTensor(torch.empty(size, dtype=torch.uint8, device="meta"))
        self._record(block, None, (), {})
        return block

    def _cublas_workspaces(self, op: str, args: tuple, kwargs: dict) -> None:
        """A BLAS op's first call on a thread allocates that thread's cuBLAS workspace
        (and a cuBLASLt op's its Lt workspace), after the op's output (``workspaces.py``);
        autograd's backward runs on a thread of its own on a real card."""
        backward = torch._C._current_graph_task_id() != -1
        for size in self._workspaces.allocations_for(
                op, "backward" if backward else threading.get_ident(), 0, args, kwargs):
            workspace = self._scratch_block(size)
            self._held.append(workspace)
            for e in self.alloc_events(workspace):  # the library's, not the running module's
                self.known[id(e)] = WORKSPACE
                self.modules.pop(id(e), None)

    def _trim(self) -> list[int]:
        dropped = super()._trim()
        self.placer.forget(dropped)
        return dropped

    def _caller(self) -> FrameType | None:
        """The frame that called the operator now dispatched (C++ callers have none)."""
        frame = sys._getframe(2)
        while frame is not None and id(frame.f_code) in self._wrappers:
            frame = frame.f_back
        return frame

    def _alloc(self, st: torch.UntypedStorage, key: int, frame: FrameType | None) -> None:
        super()._alloc(st, key, frame)
        event = self.events[-1]
        alloc = self.allocator
        before = alloc.allocated
        try:
            self.placer.add(event)
        except OutOfMemory as oom:
            self.events.pop()
            self.modules.pop(id(event), None)
            del self._live[key]
            self._addrs.discard(event[ADDR])
            error = self._oom(oom, event)
        else:
            error = None
        if error is not None:
            raise error  # outside the handler: the script sees PyTorch's error alone
        self.allocated_total[0] += 1
        self.allocated_total[1] += alloc.allocated - before
        self.peak_blocks = max(self.peak_blocks, self.allocated_total[0] - self.freed_total[0])
        self.peak_allocated = max(self.peak_allocated, alloc.allocated)
        self.peak_reserved = max(self.peak_reserved, alloc.reserved)
        self.run_peak_allocated = max(self.run_peak_allocated, alloc.allocated)
        self.run_peak_reserved = max(self.run_peak_reserved, alloc.reserved)

    def _free(self, ref: _StorageRef, frame: FrameType | None) -> None:
        super()._free(ref, frame)
        before = self.allocator.allocated
        self.placer.add(self.events[-2])
        self.placer.add(self.events[-1])
        self.freed_total[0] += 1
        self.freed_total[1] += before - self.allocator.allocated

    def _oom(self, oom: OutOfMemory, event: TraceEvent) -> torch.OutOfMemoryError:
        self.ooms += 1
        free = max(0, self.card.usable_bytes - oom.reserved)  # cudaMemGetInfo's free
        record = OomEvent("oom", 0, oom.device_alloc, 0, free, event[TIME_US], event[STACK])
        self.events.append(record)  # type: ignore[arg-type]
        self.placer.add(record)
        return torch.OutOfMemoryError(oom_message(self.card, oom, free, self.allowed))


def _card_tensors(t: torch.Tensor) -> list[VirtualTensor]:
    """The virtual CUDA tensors ``t`` is: itself, or a DTensor's local tensor."""
    if type(t) is VirtualTensor:
        return [t]
    local = getattr(t, "_local_tensor", None) if on_card(t) else None
    return [local] if type(local) is VirtualTensor else []


def _release(blocks: list[VirtualTensor]) -> None:
    """Free ``blocks``, last first: each pop drops its last reference, recording the free."""
    while blocks:
        blocks.pop()


def format_size(size: int) -> str:
    """Bytes as c10's ``format_size`` writes them in an OOM message."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1 << 20:
        return f"{size / 1024:.2f} KiB"
    if size <= 1 << 30:
        return f"{size / (1 << 20):.2f} MiB"
    return f"{size / (1 << 30):.2f} GiB"


def oom_message(card: Card, oom: OutOfMemory, free: int, allowed: int | None = None) -> str:
    """The message ``CUDACachingAllocator.cpp`` raises, for the card's numbers."""
    in_use = card.total_bytes - free
    cap = "" if allowed is None else f"{format_size(allowed)} allowed; "
    gpu = card_device().index
    return (f"CUDA out of memory. Tried to allocate {format_size(oom.device_alloc)}. GPU {gpu}"
            f" has a total capacity of {format_size(card.total_bytes)} of which {format_size(free)}"
            f" is free. Including non-PyTorch memory, this process has {format_size(in_use)}"
            f" memory in use. {cap}Of the allocated memory {format_size(oom.allocated)} is"
            f" allocated by PyTorch, and {format_size(oom.reserved - oom.allocated)} is reserved by"
            " PyTorch but unallocated. If reserved but unallocated memory is large try setting"
            " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See"
            " documentation for Memory Management "
            " (https://docs.pytorch.org/docs/stable/notes/cuda.html"
            "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")
