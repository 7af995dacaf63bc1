"""``torch.cuda`` answering as the virtual card, memory figures from the allocator model.

:func:`cuda_api` returns the replacements, by (module, attribute), that
:class:`~memprof.collect.virtual.gpu.VirtualGpu` installs for the run and restores after.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.cuda.memory
import torch.cuda.nvtx
from torch.cuda._utils import _get_device_index

from memprof.collect.virtual.cards import Card
from memprof.collect.virtual.recorder import VirtualRecorder
from memprof.collect.virtual.tensor import card_device, elsewhere, set_card_index
from memprof.trace.events import as_snapshot_events


@dataclass(frozen=True)
class DeviceProperties:
    """What ``torch.cuda.get_device_properties`` reports for the card."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    warp_size: int = 32

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major},"
                f" minor={self.minor}, total_memory={self.total_memory >> 20}MB,"
                f" multi_processor_count={self.multi_processor_count})")


class Stream:
    """A CUDA stream that orders nothing: there is no compute to order."""

    def __init__(self, device: object = None, priority: int = 0, **kwargs: object) -> None:
        self.device = card_device()
        self.priority = priority
        self.stream_id = 0
        self.cuda_stream = 0

    def synchronize(self) -> None: ...
    def wait_stream(self, stream: object) -> None: ...
    def wait_event(self, event: object) -> None: ...
    def is_capturing(self) -> bool:
        return False

    def query(self) -> bool:
        return True

    def record_event(self, event: Event | None = None) -> Event:
        return event or Event()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None: ...


class Event:
    """A CUDA event; ``elapsed_time`` is 0 (no kernels run)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, external: bool = False) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: object = None) -> None: ...
    def wait(self, stream: object = None) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True

    def elapsed_time(self, end: Event) -> float:
        return 0.0


_FIGURES = ("current", "peak", "allocated", "freed")


def _nothing(*args: object, **kwargs: object) -> None:
    return None


def _exchange_device(device: int) -> int:
    """The previous device: -1 (no change asked) stays -1, else the card's."""
    return -1 if device < 0 else card_device().index  # type: ignore[return-value]


@contextlib.contextmanager
def _nvtx_range(*args: object, **kwargs: object) -> Iterator[None]:
    yield


def signed_like(real: object, stub: Callable[..., Any]) -> Callable[..., Any]:
    """``stub`` called as ``real`` is: the script's arguments bound to ``real``'s signature
    (so ``stream(stream=s)`` works and a wrong call raises PyTorch's ``TypeError``), then
    handed to ``stub`` positionally, defaults filled in."""
    try:
        signature = inspect.signature(real)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a C function: no signature to match
        return stub
    if isinstance(real, type) or not callable(real):
        return stub

    @functools.wraps(real)  # type: ignore[arg-type]
    def called_as_torch_does(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return stub(*bound.args, **bound.kwargs)
    return called_as_torch_does


def cuda_api(card: Card, recorder: VirtualRecorder, history: HistoryWindow, count: int = 1
             ) -> dict[tuple[Any, str], Callable[..., Any] | type]:
    """The ``torch.cuda`` replacements for a run on ``card``, one of ``count`` cards of the
    node (a rank of a virtual cluster: its own is ``card_device()``, the others idle)."""
    alloc = recorder.allocator
    props = DeviceProperties(card.device_name, *card.capability, card.total_bytes, card.sm_count)
    stream = Stream()

    def stats(device: object = None) -> dict[str, int]:
        """``memory_stats()``: every key ``memory_summary`` reads. The model keeps no
        per-pool figures, split blocks or oversize counts: those read 0."""
        made, freed = recorder.allocated_total, recorder.freed_total
        live, peak_live = made[0] - freed[0], recorder.peak_blocks
        rows = {  # metric: (current, peak, allocated, freed)
            "allocated_bytes": (alloc.allocated, recorder.peak_allocated, made[1], freed[1]),
            "active_bytes": (alloc.allocated, recorder.peak_allocated, made[1], freed[1]),
            "requested_bytes": (alloc.requested, alloc.requested, 0, 0),
            "reserved_bytes": (alloc.reserved, recorder.peak_reserved, 0, 0),
            "allocation": (live, peak_live, made[0], freed[0]),
            "active": (live, peak_live, made[0], freed[0]),
            "segment": (len(alloc.segments), len(alloc.segments), 0, 0),
            "inactive_split": (0, 0, 0, 0), "inactive_split_bytes": (0, 0, 0, 0)}
        out: dict[str, int] = OrderedDict()
        for key in sorted(rows):
            for pool in ("all", "large_pool", "small_pool"):
                figures = rows[key] if pool == "all" else (0, 0, 0, 0)
                for name, value in zip(_FIGURES, figures, strict=True):
                    out[f"{key}.{pool}.{name}"] = value
        for key in ("oversize_allocations", "oversize_segments"):
            out.update((f"{key}.{name}", 0) for name in _FIGURES)
        out["num_ooms"] = recorder.ooms
        out["num_alloc_retries"] = 0
        return out

    def empty_cache() -> None:
        recorder.placer.release_cached(recorder._now_us())

    def mem_get_info(device: object = None) -> tuple[int, int]:
        return card.usable_bytes - alloc.reserved, card.total_bytes

    def reset_peaks(device: object = None) -> None:
        recorder.reset_peaks()

    def set_device(device: object) -> None:
        """``torch.cuda.set_device``: a card past the node's raises as CUDA does; before the
        card holds anything, a process no launcher numbered (one ``mp.spawn`` started per
        card) takes the card it names."""
        index = _get_device_index(device)
        if index >= count:
            raise torch.AcceleratorError(
                "CUDA error: invalid device ordinal\nGPU device may be out of range, do you"
                f" have enough GPUs?\n(memprof: the virtual node has {count} card"
                f"{'s' * (count > 1)}; memprof run --cards N gives it N)")
        if index >= 0 and not recorder.allocated_total[0] and "LOCAL_RANK" not in os.environ:
            set_card_index(index)
        elif index >= 0:
            elsewhere(index)  # after its first tensors: they, and the rest, stay on its card

    cuda, memory, nvtx = torch.cuda, torch.cuda.memory, torch.cuda.nvtx
    answers: dict[str, Callable[..., Any] | type] = {
        "is_available": lambda: True,
        "device_count": lambda: count,
        "current_device": lambda: card_device().index,
        "set_device": set_device,
        # torch.cuda.device(i) and device_of(t) swap the current device through these
        "_exchange_device": _exchange_device, "_maybe_exchange_device": _exchange_device,
        "is_initialized": lambda: True,
        "_lazy_init": _nothing,
        "init": _nothing,
        "get_device_name": lambda device=None: card.device_name,
        "get_device_properties": lambda device=None: props,
        "get_device_capability": lambda device=None: card.capability,
        "get_arch_list": lambda: [f"sm_{card.capability[0]}{card.capability[1]}"],
        # before compute capability 8.0, bf16 is emulated, which the default allows
        "is_bf16_supported": lambda including_emulation=True: (including_emulation
                                                               or card.capability >= (8, 0)),
        "synchronize": _nothing,
        # the card's generator is never used (no values): seeding is accepted, its state
        # is Philox's 16 bytes (seed, offset) as a CPU byte tensor, as CUDA returns it
        "manual_seed": _nothing, "manual_seed_all": _nothing, "seed": _nothing,
        "seed_all": _nothing, "initial_seed": lambda: 0,
        "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
        "get_rng_state_all": lambda: [torch.zeros(16, dtype=torch.uint8)],
        "set_rng_state": _nothing, "set_rng_state_all": _nothing,
        "utilization": lambda device=None: 0,
        "Event": Event,
        "Stream": Stream,
        "current_stream": lambda device=None: stream,
        "default_stream": lambda device=None: stream,
        "set_stream": _nothing,
        "stream": lambda s=None: contextlib.nullcontext(),
        "memory_allocated": lambda device=None: alloc.allocated,
        "max_memory_allocated": lambda device=None: recorder.peak_allocated,
        "memory_reserved": lambda device=None: alloc.reserved,
        "max_memory_reserved": lambda device=None: recorder.peak_reserved,
        "memory_cached": lambda device=None: alloc.reserved,
        "max_memory_cached": lambda device=None: recorder.peak_reserved,
        "reset_peak_memory_stats": reset_peaks,
        "reset_max_memory_allocated": reset_peaks,
        "reset_max_memory_cached": reset_peaks,
        "reset_accumulated_memory_stats": _nothing,
        "memory_stats": stats,
        "empty_cache": empty_cache,
        "mem_get_info": mem_get_info,
        "set_per_process_memory_fraction": lambda f, device=None: recorder.set_fraction(f),
        "memory_snapshot": lambda *a, **k: history.snapshot()["segments"],
    }
    patches: dict[tuple[Any, str], Callable[..., Any] | type] = {}
    for name, value in answers.items():
        for module in (cuda, memory, cuda.random, cuda.graphs):
            if hasattr(module, name):
                patches[(module, name)] = value
    patches[(memory, "_record_memory_history")] = history.record
    patches[(memory, "_snapshot")] = lambda *a, **k: history.snapshot()
    patches[(memory, "_dump_snapshot")] = history.dump
    patches[(nvtx, "range_push")] = _nothing
    patches[(nvtx, "range_pop")] = _nothing
    patches[(nvtx, "mark")] = _nothing
    patches[(nvtx, "range")] = _nvtx_range
    # torch.accelerator, the device-generic API newer scripts use: CUDA is the accelerator
    accelerator = {**{name: answers[name] for name in (
        "is_available", "device_count", "synchronize", "memory_allocated",
        "max_memory_allocated", "memory_reserved", "max_memory_reserved",
        "reset_peak_memory_stats", "reset_accumulated_memory_stats", "memory_stats",
        "empty_cache", "current_stream", "set_stream")},
        "current_accelerator": lambda check_available=False: torch.device("cuda"),
        "current_device_index": answers["current_device"],
        "current_device_idx": answers["current_device"],
        "set_device_index": set_device, "set_device_idx": set_device,
        "device_index": lambda device=None: contextlib.nullcontext(),
        "get_memory_info": mem_get_info}
    for name, value in accelerator.items():
        for module in _accelerator_modules():
            if hasattr(module, name):
                patches[(module, name)] = value
    # what torch itself asks (FSDP2's default mesh, c10d's default device, FSDP1's device)
    patches[(torch._C, "_get_accelerator")] = lambda check=False: torch.device("cuda")
    return {(module, name): signed_like(getattr(module, name, None), stub)
            for (module, name), stub in patches.items()}


def _accelerator_modules() -> list[object]:
    """``torch.accelerator`` and its ``memory`` module, where this torch has them."""
    accelerator = getattr(torch, "accelerator", None)
    return [m for m in (accelerator, getattr(accelerator, "memory", None)) if m is not None]


class HistoryWindow:
    """``_record_memory_history``: which part of the predicted trace a snapshot shows."""

    def __init__(self, recorder: VirtualRecorder, settings: dict[str, Any]) -> None:
        self._recorder = recorder
        self._settings = settings
        self._start: int | None = None
        self._end: int | None = None
        # the trace's events as snapshots hold them, converted once (a script may take a
        # snapshot per step): the events converted, and their stacks, by the stack's id
        self._converted: list[dict[str, Any]] = []
        self._stacks: dict[int, list[dict[str, Any]]] = {}
        self._ends: tuple[object, object] = (None, None)  # the first and last converted

    def record(self, enabled: object = "all", *args: object, **kwargs: object) -> None:
        trace = self._recorder.placer.trace
        if enabled in (None, False):
            self._end = len(trace) if self._start is not None else None
        else:
            self._start, self._end = len(trace), None

    def snapshot(self) -> dict[str, Any]:
        """The predicted snapshot as ``torch.cuda.memory._snapshot()`` returns it."""
        layout = self._recorder.placer.layout()
        events = [] if self._start is None else self._events(layout.trace)[self._start:self._end]
        return {"segments": layout.segments, "device_traces": [events],
                "allocator_settings": self._settings, "external_annotations": []}

    def _events(self, trace: list[Any]) -> list[dict[str, Any]]:
        """``trace`` as a snapshot holds it, converting only the events new since the last
        snapshot (all of them once the ring buffer has dropped some)."""
        done = len(self._converted)
        first, last = self._ends
        if done and (len(trace) < done or trace[0] is not first or trace[done - 1] is not last):
            self._converted, self._stacks, done = [], {}, 0
        self._converted += as_snapshot_events(trace[done:], self._stacks)
        self._ends = (trace[0], trace[-1]) if trace else (None, None)
        return list(self._converted)

    def dump(self, filename: str = "dump_snapshot.pickle", *args: object) -> None:
        with open(filename, "wb") as f:
            pickle.dump(self.snapshot(), f)
