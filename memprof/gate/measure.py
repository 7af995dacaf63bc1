"""Measure the memory of a piece of code in this process: a test, for the pytest plugin.

The backend follows the machine: PyTorch's own allocator history where CUDA is
available; else the virtual GPU, which runs CUDA code on storage-less tensors and predicts
its memory; and memprof's CPU recorder with the caching allocator's predicted layout for
code that makes no CUDA tensor (recorded beside the virtual GPU, so that the code runs
once either way).
"""

from __future__ import annotations

import os
from typing import Any

from memprof.collect.cuda import history as cuda

CUDA_HISTORY_ENTRIES = 200_000


def backend() -> str:
    """``cuda`` (the allocator's own history) or ``virtual`` (CUDA code on a virtual GPU)."""
    return "cuda" if cuda.available() else "virtual"


class Measurement:
    """Start before the code, stop after it: the report (JSON-ready) of what it allocated."""

    def __init__(self, top: int = 5, using: str | None = None, card: str | None = None
                 ) -> None:
        from memprof.analysis.settings import parse_alloc_conf

        self.backend = using or backend()
        self.top = top
        self.card = card
        self._settings = parse_alloc_conf(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
        self._history: cuda.CudaHistory | None = None
        self._recorder: Any = None
        self._host: Any = None  # beside the virtual GPU: the code's host tensors
        self._gpu: Any = None

    def start(self) -> None:
        from memprof.collect.cpu.recorder import CpuRecorder

        if self.backend == "cuda":
            self._history = cuda.CudaHistory(CUDA_HISTORY_ENTRIES)
            self._history.start()
        elif self.backend == "virtual":
            from memprof.collect.recording import settings_dict
            from memprof.collect.virtual.cards import DEFAULT_CARD, parse_spec
            from memprof.collect.virtual.gpu import VirtualGpu
            from memprof.collect.virtual.recorder import HostStorages

            card = parse_spec(self.card) if self.card else DEFAULT_CARD
            self._host = CpuRecorder(HostStorages())
            self._host.start()
            self._gpu = VirtualGpu(card, self._settings, settings_dict(self._settings))
            self._recorder = CpuRecorder(self._gpu.recorder)
            self._recorder.start()
            self._gpu.__enter__()
        else:
            self._recorder = CpuRecorder()
            self._recorder.start()

    @property
    def made_cuda_tensors(self) -> bool:
        """Whether the code made a CUDA tensor (always true on a real GPU)."""
        return self._gpu is None or bool(self._gpu.recorder.placer.trace)

    def stop(self) -> dict[str, Any]:
        """Stop measuring; the report of the code in between, in the report schema."""
        from memprof.analysis.explain import explain
        from memprof.collect.recording import predict_cuda_layout
        from memprof.report.json import report_dict
        from memprof.trace.normalize import normalize

        if self._history is not None:
            snapshot = self._history.stop()
        else:
            layout = None
            recorder = self._recorder
            if self._gpu is not None:
                self._gpu.__exit__(None, None, None)
                recorder.stop()
                self._host.stop()
                if self.made_cuda_tensors:
                    layout = self._gpu.recorder.placer.layout()
                else:  # host-only code: its host tensors, as the CPU recorder sees them
                    self.backend, recorder = "cpu", self._host
            else:
                recorder.stop()
            snapshot, _ = predict_cuda_layout(recorder.snapshot(), self._settings, layout)
        return report_dict(explain(normalize(snapshot), "", top=self.top), "check")
