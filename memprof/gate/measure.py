"""Measure the memory of a piece of code in this process: a test, for the pytest plugin.

The backend follows the machine: PyTorch's own allocator history where CUDA is
available, else memprof's CPU recorder with the caching allocator's predicted layout.
"""

from __future__ import annotations

import os
from typing import Any

from memprof.collect import cuda

CUDA_HISTORY_ENTRIES = 200_000


def backend() -> str:
    """``cuda`` (the allocator's own history) or ``cpu`` (recorded, layout predicted)."""
    return "cuda" if cuda.available() else "cpu"


class Measurement:
    """Start before the code, stop after it: the report (JSON-ready) of what it allocated."""

    def __init__(self, top: int = 5) -> None:
        self.backend = backend()
        self.top = top
        self._history: cuda.CudaHistory | None = None
        self._recorder: Any = None

    def start(self) -> None:
        if self.backend == "cuda":
            self._history = cuda.CudaHistory(CUDA_HISTORY_ENTRIES)
            self._history.start()
        else:
            from memprof.collect.cpu_recorder import CpuRecorder

            self._recorder = CpuRecorder()
            self._recorder.start()

    def stop(self) -> dict[str, Any]:
        """Stop measuring; the report of the code in between, in the report schema."""
        from memprof.analysis.explain import explain
        from memprof.analysis.settings import parse_alloc_conf
        from memprof.collect.session import predict_cuda_layout
        from memprof.report.json import report_dict
        from memprof.trace.normalize import normalize

        if self._history is not None:
            snapshot = self._history.stop()
        else:
            self._recorder.stop()
            settings = parse_alloc_conf(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
            snapshot = predict_cuda_layout(self._recorder.snapshot(), settings)
        return report_dict(explain(normalize(snapshot), "", top=self.top), "check")
