"""The CPU allocator's own allocations and frees, from torch.profiler's memory reporting alone.

With memory profiling on and no CPU activity, the profiler registers no operator
callbacks: PyTorch's CPU allocator reports each allocation and free (address, bytes, a
nanosecond clock) and nothing else runs, at about 1 µs an event. This is the light
recorder's trace; the role hooks label it afterwards, as on a GPU (``labeller.py``).

    events = AllocatorEvents()
    events.start()
    train()
    trace, times_ns = events.stop()  # TraceEvents, and when each happened (time.time_ns)

The profiler's state is per thread: allocations made by threads the script starts are
not reported (DataLoader workers are processes, and their batches arrive as the main
thread's tensors).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from operator import itemgetter

from memprof.errors import MemprofError
from memprof.trace.events import TraceEvent

_NO_STACK = ()


class AllocatorEvents:
    """Record the CPU allocator's events from ``start`` to ``stop``; single use."""

    def __init__(self) -> None:
        self._on = False

    @property
    def recording(self) -> bool:
        """Whether ``start`` was called and ``stop`` not yet."""
        return self._on

    def start(self) -> None:
        """Turn the profiler's memory reporting on (and nothing else)."""
        import torch
        from torch.autograd import (
            ProfilerConfig,
            ProfilerState,
            _enable_profiler,
            _prepare_profiler,
        )

        if torch.autograd._profiler_enabled():
            raise MemprofError("--light: torch.profiler is already running in this process;"
                               " run without --light")
        # (state, shapes, memory, stacks, flops, modules): memory alone
        config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False,
                                torch._C._profiler._ExperimentalConfig())
        activities = {_no_device_activity()}
        # The allocator logs a warning at the first free of a block it saw no allocation
        # of, and at every thousandth after: this block's free spends that first warning
        # where the script cannot see it.
        before = torch.empty(1)
        with quiet_stderr():
            _prepare_profiler(config, activities)
            _enable_profiler(config, activities)
            del before
        self._on = True

    def stop(self) -> tuple[list[TraceEvent], list[int]]:
        """Turn the reporting off; the CPU allocations made since ``start`` and their frees,
        in order, and each event's time in ``time.time_ns`` nanoseconds. Frees of storages
        allocated before ``start`` are left out."""
        import torch
        from torch.autograd import _disable_profiler

        if not self._on:
            raise RuntimeError("stop() needs a started AllocatorEvents")
        self._on = False
        if not torch.autograd._profiler_enabled():
            raise MemprofError("--light: the script ran torch.profiler, which ended memprof's"
                               " recording (both need it); run without --light")
        with quiet_stderr():
            nodes = _disable_profiler().experimental_event_tree()
        # one pass, attributes read once: a long run reports millions of events
        reported = [(node.start_time_ns, (f := node.extra_fields).ptr, f.alloc_size, f.device)
                    for node in nodes]
        del nodes
        if torch.cuda.is_initialized():  # the CUDA allocator reports to the profiler too
            reported = [r for r in reported if r[3].type == "cpu"]
        reported.sort(key=itemgetter(0))  # threads' queues come one after another
        return _trace(reported)


def _trace(reported: list[tuple[int, int, int, object]]
           ) -> tuple[list[TraceEvent], list[int]]:
    trace: list[TraceEvent] = []
    times: list[int] = []
    live: dict[int, int] = {}
    for at, ptr, nbytes, _ in reported:
        if nbytes > 0:
            live[ptr] = nbytes
            trace.append(("alloc", ptr, nbytes, 0, at // 1000, _NO_STACK))
        elif live.pop(ptr, None) is not None:
            trace.append(("free_completed", ptr, -nbytes, 0, at // 1000, _NO_STACK))
        else:
            continue
        times.append(at)
    return trace, times


def _no_device_activity() -> object:
    """An activity the profiler must be given, of a device this process has none of: MTIA's
    (Meta's accelerator), so that no device tracer (CUPTI, a PrivateUse1 backend's) starts."""
    from torch._C._profiler import ProfilerActivity

    return ProfilerActivity.MTIA


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 for the block: Kineto logs its start and stop there, and
    a warning that there are no operator events to match, none of them the script's."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all: nothing to silence
        yield
        return
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
