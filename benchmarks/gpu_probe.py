"""Run a script as ``__main__`` and write what PyTorch and NVML measured to a JSON file.

Usage: python benchmarks/gpu_probe.py OUT.json SCRIPT [ARGS...]
(also as the script of ``memprof run``). It records the caching allocator's own
counters (``max_memory_allocated``, ``max_memory_reserved``), NVML's memory for this
process and for the whole device (before CUDA starts and at the end: the difference less
``memory_reserved`` is the CUDA context), the time of every optimizer step, and
``torch.compile``'s graph count. Used by ``gpu_validation.py`` on a GPU machine.

To tell apart what ``memprof run``'s GPU path costs, it can run one part of it alone:
``PROBE_HISTORY=all`` (or ``alloc``) records the allocator's history as memprof does
(``_record_memory_history`` with Python stacks at allocations and frees, or at
allocations only), ``PROBE_HOOKS=1`` installs memprof's hooks-only labeller.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import runpy
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def nvml_used() -> tuple[int | None, int | None, str | None]:
    """(this process's bytes, the device's used bytes, the driver version), None unknown."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        mine = next((p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                     if p.pid == os.getpid()), None)
        used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
        return mine, used, pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # no NVML: the counters below still tell
        return None, None, None


def counters(device_used_before: int | None) -> dict[str, Any]:
    """The allocator's counters and NVML's, read now."""
    import torch

    facts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        return facts
    torch.cuda.synchronize()
    mine, device_used, driver = nvml_used()
    facts.update(
        name=torch.cuda.get_device_name(0),
        total_memory=torch.cuda.get_device_properties(0).total_memory,
        max_memory_allocated=torch.cuda.max_memory_allocated(),
        max_memory_reserved=torch.cuda.max_memory_reserved(),
        memory_allocated=torch.cuda.memory_allocated(),
        memory_reserved=torch.cuda.memory_reserved(),
        nvml_process_bytes=mine, nvml_device_used=device_used,
        nvml_device_used_before=device_used_before, driver=driver)
    if mine is not None:
        facts["context_bytes"] = mine - facts["memory_reserved"]
    if device_used is not None and device_used_before is not None:
        facts["context_bytes_by_device"] = (
            device_used - device_used_before - facts["memory_reserved"])
    return facts


@contextlib.contextmanager
def part_of_memprof() -> Iterator[None]:
    """The part of memprof's GPU path that ``PROBE_HISTORY`` / ``PROBE_HOOKS`` ask for."""
    import torch

    context = os.environ.get("PROBE_HISTORY")
    if context:
        torch.cuda.memory._record_memory_history(
            enabled="all", context=context, stacks="python", max_entries=1_000_000)
    if os.environ.get("PROBE_HOOKS"):
        from memprof.collect.hooks.labeller import HookLabeller

        with HookLabeller():
            yield
    else:
        yield


def main() -> None:
    out, script, *args = sys.argv[1:]
    _, device_used_before, _ = nvml_used()
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps: list[float] = []
    register_optimizer_step_post_hook(lambda *_: steps.append(time.perf_counter()))
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    start, code = time.perf_counter(), 0
    try:
        with part_of_memprof():
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        raise
    except BaseException:
        code = 1
        raise
    finally:
        facts = counters(device_used_before)
        facts.update(script_seconds=time.perf_counter() - start, exit_code=code,
                     step_times=[b - a for a, b in itertools.pairwise(steps)])
        try:
            from torch._dynamo.utils import counters as dynamo

            facts["compiled_graphs"] = dynamo["stats"]["unique_graphs"]
        except Exception:
            facts["compiled_graphs"] = None
        Path(out).write_text(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main()
