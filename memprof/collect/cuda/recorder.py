"""The GPU path (``memprof run`` where CUDA is available): the caching allocator's own
history is the trace, labelled by the role hooks alone (no dispatch mode: the program runs
as it would without memprof)."""

from __future__ import annotations

import gc

from memprof.collect.cuda.history import CudaHistory, blas_workspaces, device_facts
from memprof.collect.hooks.labeller import HookLabeller
from memprof.collect.launch.script import Target
from memprof.collect.recording import Recording, RunOptions, run_profiled


def record(target: Target, options: RunOptions) -> Recording:
    """Run ``target`` on the GPU under the allocator history and the labeller; with the
    whole run's snapshot, the one taken when an out-of-memory was raised, if one was."""
    import torch

    history = CudaHistory(options.max_entries)
    labeller = HookLabeller()
    history.start()
    with labeller:
        outcome, seconds = run_profiled(target, options)
        gc.collect()  # what the script left in reference cycles is freed while recording,
        # as the CPU recorder does: what the trace leaves alive is what is still held
    device = torch.cuda.current_device()
    snapshots = [s for s in (history.stop(), history.oom_snapshot) if s is not None]
    workspaces = blas_workspaces(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    capped = {} if fraction >= 1 else {  # as the caching allocator computes its cap
        "allowed_bytes": int(fraction * torch.cuda.mem_get_info(device)[1])}
    for snapshot in snapshots:
        snapshot["memprof"] = {**labeller.labels(snapshot["device_traces"][device],
                                                 workspaces=workspaces), "device": device,
                               **capped}
    facts = device_facts()
    return Recording(snapshots[0], outcome, f"cuda ({facts['name']})", False, seconds, facts,
                     history.oom_snapshot)
