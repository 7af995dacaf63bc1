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
    """Record the caching allocator's history for the whole run (``_record_memory_history``).

    Python stacks are kept for allocations only: memprof reads a free's stack only to
    infer categories of a snapshot without its labels, and on an H200 the frees' stacks
    cost nanoGPT's compiled iterations 5.5 ms of 8.2 (allocations' 1.2 ms;
    benchmarks/results/gpu-validation.md).
    """

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.oom_snapshot: dict[str, Any] | None = None

    def start(self) -> None:
        import torch

        torch.cuda.memory._record_memory_history(
            enabled="all", context="alloc", stacks="python", max_entries=self.max_entries)
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


def blas_workspaces(device: int) -> tuple[int, int]:
    """The cuBLAS and separate cuBLASLt workspace bytes PyTorch allocates on ``device``."""
    import torch

    from memprof.collect.virtual.workspaces import blas_workspace_sizes

    return blas_workspace_sizes(torch.cuda.get_device_capability(device), os.environ)


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
