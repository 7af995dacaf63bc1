"""Run a target on the virtual GPU and return its predicted recording."""

from __future__ import annotations

import contextlib
from typing import Any

from memprof.collect.cpu.recorder import CpuRecorder
from memprof.collect.launch.children import FollowedChildren
from memprof.collect.launch.script import Target, torchrun_local
from memprof.collect.recording import (
    Recording,
    RunOptions,
    predict_cuda_layout,
    run_profiled,
    settings_dict,
)
from memprof.collect.virtual.cards import Card, card_args
from memprof.collect.virtual.gpu import VirtualGpu
from memprof.collect.virtual.tensor import placeholders_read
from memprof.heap import frozen, trim


def record(target: Target, options: RunOptions, card: Card, announce: str | None = None
           ) -> Recording:
    """Run ``target`` once on a virtual ``card``: its CUDA memory as that card would show it.

    ``announce`` is printed on stderr when the script first makes a CUDA tensor; the trace
    keeps the last ``options.max_entries`` events (a ring buffer) and every allocation
    still alive. The script's spawn and forkserver children run on a virtual ``card`` of
    their own, each recorded into ``options.folder`` (``children.py``).
    """
    settings = options.settings
    # a rank of a cluster: its card is cuda:LOCAL_RANK; else the one torch.cuda.set_device
    # names before the first CUDA tensor (a process mp.spawn started per card)
    index, count = torchrun_local(options.cards)
    gpu = VirtualGpu(card, settings, settings_dict(settings), announce, options.max_entries,
                     index, count)
    recorder = CpuRecorder(gpu.recorder)
    children = None if options.folder is None else FollowedChildren(options.folder, [
        *card_args(card), "--alloc-conf", settings.conf,
        "--max-entries", str(options.max_entries),
        # each child stops as the run was asked to (its own steps, its own seconds)
        *(["--steps", str(options.steps)] if options.steps is not None else []),
        *(["--seconds", repr(options.seconds)] if options.seconds is not None else []),
        *(["--cards", str(count)] if options.cards > 1 else [])],
        count if options.cards == 1 else 1)
    with recorder, gpu, children or contextlib.nullcontext():
        outcome, took = run_profiled(target, options)
        if children is not None:
            children.finish(outcome.status == "interrupted"
                            or outcome.stopped_by not in (None, "steps", "seconds"))
    trim()  # what the script freed, before memprof's own work on the trace
    with frozen():
        # on the rank's own card, cuda:LOCAL_RANK, as its snapshot on a node says
        snapshot, _ = predict_cuda_layout(recorder.snapshot(), settings,
                                          gpu.recorder.placer.layout(gpu.index))
    if placeholders_read():  # zeros read from large tensors: what the script computed
        snapshot["memprof"]["placeholders_read"] = True
    if gpu.world is not None:  # the rank its process group gave it (mp.spawn's)
        snapshot["memprof"]["world"] = {"rank": gpu.world[0], "size": gpu.world[1]}
    if gpu.recorder.allowed is not None:  # set_per_process_memory_fraction's cap
        snapshot["memprof"]["allowed_bytes"] = gpu.recorder.allowed
    return Recording(snapshot, outcome, f"virtual {card.name}", True, took,
                     virtual_gpu=virtual_gpu_facts(card),
                     children=children.folders if children is not None else [],
                     children_exits=children.exits if children is not None else {})


def virtual_gpu_facts(card: Card) -> dict[str, Any]:
    """``run.virtual_gpu`` in report.json: the card and the context assumption."""
    return {"spec": card.name, "device_name": card.device_name,
            "total_bytes": card.total_bytes, "capability": list(card.capability),
            "context_bytes": card.context_bytes, "context_measured": card.context_measured}
