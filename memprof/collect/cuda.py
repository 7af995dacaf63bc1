"""The CUDA path: PyTorch's own allocator history, an OOM observer and NVML.

Kept thin: everything here needs a GPU; the analysis reads what it produces like any
other snapshot.
"""

from __future__ import annotations

import os
from typing import Any


def available() -> bool:
    """Whether a CUDA device can be profiled here."""
    import torch

    return torch.cuda.is_available()


class CudaHistory:
    """Record the caching allocator's history for the whole run (``_record_memory_history``)."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.oom_snapshot: dict[str, Any] | None = None

    def start(self) -> None:
        import torch

        torch.cuda.memory._record_memory_history(
            enabled="all", context="all", stacks="python", max_entries=self.max_entries)
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None:
            attach(self._on_oom)

    def _on_oom(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        import torch

        # called just before the OutOfMemoryError is raised: what filled the card is live now
        self.oom_snapshot = torch.cuda.memory._snapshot()

    def stop(self) -> dict[str, Any]:
        """Stop recording; the snapshot of the whole run."""
        import torch

        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        return snapshot


def device_facts() -> dict[str, Any]:
    """GPU name, driver, and the CUDA context: NVML process memory minus PyTorch's reserved."""
    import torch

    index = torch.cuda.current_device()
    facts: dict[str, Any] = {
        "name": torch.cuda.get_device_name(index),
        "total_bytes": torch.cuda.get_device_properties(index).total_memory,
        "max_memory_allocated": torch.cuda.max_memory_allocated(index),
        "max_memory_reserved": torch.cuda.max_memory_reserved(index),
        "memory_reserved": torch.cuda.memory_reserved(index),
    }
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        facts["driver"] = pynvml.nvmlSystemGetDriverVersion()
        used = next((p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                     if p.pid == os.getpid()), None)
        if used is not None:
            facts["nvml_process_bytes"] = used
            facts["context_bytes"] = used - facts["memory_reserved"]
    except Exception as exc:  # NVML is optional: no driver access in containers, old drivers
        facts["nvml_error"] = str(exc)
    return facts


def match_labels(trace: list[dict[str, Any]], recorded: list[dict[str, Any]],
                 labels: list[list[Any]], default: str | None = "other") -> list[list[Any]]:
    """Carry labels (or tags) from memprof's storage events to the allocator's alloc
    events; an event without one gets ``default`` (None: no entry).

    Both see the same storages in the same order; a storage's CUDA address is its
    data pointer, so the k-th alloc at an address in one is the k-th in the other.
    """
    by_event = dict((i, c) for i, c in labels)
    queues: dict[int, list[str | None]] = {}
    for i, event in enumerate(recorded):
        if event["action"] == "alloc":
            queues.setdefault(event["addr"], []).append(by_event.get(i, default))
    out = []
    for i, event in enumerate(trace):
        if event["action"] == "alloc" and queues.get(event["addr"]):
            label = queues[event["addr"]].pop(0)
            if label is not None:
                out.append([i, label])
    return out


def match_steps(trace: list[dict[str, Any]], recorded: list[dict[str, Any]],
                steps: list[int]) -> list[int]:
    """Step ends (exclusive event indices) carried to the allocator's trace by timestamp."""
    import bisect

    times = [e.get("time_us", 0) for e in trace]
    return [bisect.bisect_right(times, recorded[end - 1]["time_us"]) if end else 0
            for end in steps]
