"""Run a target on the virtual GPU and return its predicted recording."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from memprof.collect.cpu_recorder import CpuRecorder
from memprof.collect.launch import Target
from memprof.collect.session import Recording, predict_cuda_layout, run_profiled, settings_dict
from memprof.collect.virtual.cards import Card
from memprof.collect.virtual.gpu import VirtualGpu
from memprof.heap import frozen, trim
from memprof.trace.model import AllocatorSettings


def record_virtual(target: Target, card: Card, settings: AllocatorSettings,
                   profile_to: Path | None = None, announce: str | None = None,
                   steps: int | None = None, seconds: float | None = None,
                   max_entries: int | None = None, ended: Callable[[], None] | None = None
                   ) -> Recording:
    """Run ``target`` once on a virtual ``card``: its CUDA memory as that card would show it.

    ``announce`` is printed on stderr when the script first makes a CUDA tensor; the run
    stops after ``steps`` optimizer steps or ``seconds`` when given (``ended`` is called as
    soon as it has); the trace keeps the last ``max_entries`` events (a ring buffer) and
    every allocation still alive.
    """
    gpu = VirtualGpu(card, settings, settings_dict(settings), announce, max_entries)
    recorder = CpuRecorder(gpu.recorder)
    with recorder, gpu:
        outcome, took = run_profiled(target, profile_to, steps, seconds, ended)
    trim()  # what the script freed, before memprof's own work on the trace
    with frozen():
        snapshot, _ = predict_cuda_layout(recorder.snapshot(), settings,
                                          gpu.recorder.placer.layout())
    return Recording(snapshot, outcome, f"virtual {card.name}", True, took,
                     virtual_gpu=virtual_gpu_facts(card))


def virtual_gpu_facts(card: Card) -> dict[str, Any]:
    """``run.virtual_gpu`` in report.json: the card and the context assumption."""
    return {"spec": card.name, "device_name": card.device_name,
            "total_bytes": card.total_bytes, "capability": list(card.capability),
            "context_bytes": card.context_bytes, "context_measured": card.context_measured}
