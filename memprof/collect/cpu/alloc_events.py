"""The CPU allocator's own allocations and frees, from torch.profiler's memory reporting alone.

With memory profiling on and no CPU activity, the profiler registers no operator
callbacks: PyTorch's CPU allocator reports each allocation and free (address, bytes, a
nanosecond clock) and nothing else runs. Taking the events costs about 3 µs each, half of
it the profiler's own. This is the light recorder's trace; the role hooks label it
afterwards, as on a GPU (``labeller.py``). The Python numbers operators wrap as CPU tensors
(``x * 0.5``), which a GPU never holds, are left out: a third of the events of a model
written with scalar arithmetic.

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
import time
from collections.abc import Iterator
from operator import attrgetter

import numpy as np
import torch
from torch._C._profiler import ProfilerActivity
from torch.autograd import (
    ProfilerConfig,
    ProfilerState,
    _disable_profiler,
    _enable_profiler,
    _prepare_profiler,
)
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from memprof.collect.hooks.warning_filters import PROFILER_WITHOUT_OPERATORS, ignore, restore
from memprof.errors import MemprofError
from memprof.trace.events import ACTION, ADDR, TraceEvent

_NO_STACK = ()
_NUMBER_BYTES = (1, 8, 16)  # a wrapped Python bool, int or float, complex
_OP = 3  # events within which an operator frees the cast: its result's, the cast's own
_START = attrgetter("start_time_ns")
_FIELDS = attrgetter("extra_fields")
_PTR = attrgetter("ptr")
_SIZE = attrgetter("alloc_size")
_SLACK = 0.1  # the ring buffer trims when it holds this much more than max_entries


class AllocatorEvents:
    """Record the CPU allocator's events from ``start`` to ``stop``; single use.

    At each optimizer step, and at a module's forward once ``DRAIN_S`` have passed, it
    moves what the profiler holds into its own trace (``drain``): at stop the profiler
    turns each event into a Kineto activity of about a kilobyte, which a long run's
    millions of events would otherwise all need at once. With ``max_entries`` the trace is
    a ring buffer, as the exact recorder's: the oldest events go, but for the allocations
    of blocks still live at the new first event; ``dropped`` counts them and
    ``max_live_bytes`` is the peak over all events.
    """

    DRAIN_S = 0.5

    def __init__(self, max_entries: int | None = None) -> None:
        self.max_entries = max_entries
        self.dropped = 0
        self.max_live_bytes = 0
        self._live_bytes = 0
        self._on = False
        self._hooks: list[RemovableHandle] = []
        self._due = 0.0  # time.monotonic() of the next drain at a module's forward
        self._filter: object = None
        self._trace: list[TraceEvent] = []
        self._times: list[int] = []
        self._live: set[int] = set()  # addresses of the allocations not yet freed

    @property
    def recording(self) -> bool:
        """Whether ``start`` was called and ``stop`` not yet."""
        return self._on

    def start(self) -> None:
        """Turn the profiler's memory reporting on (and nothing else)."""
        if torch.autograd._profiler_enabled():
            raise MemprofError("--light: torch.profiler is already running in this process;"
                               " run without --light")
        # The allocator logs a warning at the first free of a block it saw no allocation
        # of, and at every thousandth after: this block's free spends that first warning
        # where the script cannot see it.
        before = torch.empty(1)
        with quiet_stderr():
            _enable()
            del before
        self._on = True
        self._filter = ignore(PROFILER_WITHOUT_OPERATORS)
        self._due = time.monotonic() + self.DRAIN_S
        self._hooks = [register_optimizer_step_post_hook(lambda *_: self.drain()),
                       register_module_forward_pre_hook(self._on_forward)]

    def drain(self) -> None:
        """Take the events reported so far, and go on recording; nothing while the script
        runs torch.profiler itself (``stop`` then says so)."""
        if self._on and self._ours():
            with quiet_stderr():
                self._take()
                _enable()
        self._due = time.monotonic() + self.DRAIN_S

    def _on_forward(self, module: object, args: object) -> None:
        # compiling first: Dynamo traces this hook into the graph, and a clock breaks it
        if not torch.compiler.is_compiling() and time.monotonic() >= self._due:
            self.drain()

    def stop(self) -> tuple[list[TraceEvent], list[int]]:
        """Turn the reporting off; the CPU allocations made since ``start`` and their frees,
        in order, and each event's time in ``time.time_ns`` nanoseconds. Frees of storages
        allocated before ``start`` are left out."""
        if not self._on:
            raise RuntimeError("stop() needs a started AllocatorEvents")
        self._on = False
        for hook in self._hooks:
            hook.remove()
        restore(self._filter)
        if not self._ours():
            raise MemprofError("--light: the script ran torch.profiler, which ended memprof's"
                               " recording (both need it); run without --light")
        with quiet_stderr():
            self._take()
        trace, times = self._trace, self._times
        self._trace, self._times, self._live = [], [], set()
        return trace, times

    @staticmethod
    def _ours() -> bool:
        """Whether the profiler running is this recording's: the script's own (torch.profiler
        and autograd.profiler alike set this flag) ends it."""
        return (torch.autograd._profiler_enabled()
                and not torch.autograd.profiler._is_profiler_enabled)

    def _take(self) -> None:
        """Disable the profiler and append its events to the trace, but for Python numbers
        wrapped as tensors (``_wrapped_numbers``)."""
        nodes = _disable_profiler().experimental_event_tree()
        # attributes read a column at a time: a long run reports millions of events
        fields = list(map(_FIELDS, nodes))
        n = len(nodes)
        starts = np.fromiter(map(_START, nodes), np.int64, n)
        ptrs = np.fromiter(map(_PTR, fields), np.uint64, n)
        sizes = np.fromiter(map(_SIZE, fields), np.int64, n)
        if torch.cuda.is_initialized():  # the CUDA allocator reports to the profiler too
            cpu = np.fromiter((f.device.type == "cpu" for f in fields), bool, n)
            starts, ptrs, sizes = starts[cpu], ptrs[cpu], sizes[cpu]
        del nodes, fields
        if np.any(starts[1:] < starts[:-1]):  # threads' queues come one after another
            order = np.argsort(starts, kind="stable")
            starts, ptrs, sizes = starts[order], ptrs[order], sizes[order]
        kept = ~_wrapped_numbers(ptrs, sizes)  # their frees find them not live, and go too
        trace, times, live = self._trace, self._times, self._live
        held, most = self._live_bytes, self.max_live_bytes
        for at, ptr, nbytes in zip(starts[kept].tolist(), ptrs[kept].tolist(),
                                   sizes[kept].tolist(), strict=True):
            if nbytes > 0:
                live.add(ptr)
                trace.append(("alloc", ptr, nbytes, 0, at // 1000, _NO_STACK))
                held += nbytes
                if held > most:
                    most = held
            elif ptr in live:
                live.remove(ptr)
                trace.append(("free_completed", ptr, -nbytes, 0, at // 1000, _NO_STACK))
                held += nbytes
            else:
                continue
            times.append(at)
        self._live_bytes, self.max_live_bytes = held, most
        if self.max_entries is not None and len(trace) > self.max_entries * (1 + _SLACK):
            self._trim()

    def _trim(self) -> None:
        """Drop the oldest events down to ``max_entries``, but for the allocations of blocks
        not freed before the new first event."""
        cut = len(self._trace) - self.max_entries  # type: ignore[operator]
        pending: dict[int, int] = {}  # address -> index of an allocation not yet freed
        for i, event in enumerate(self._trace[:cut]):
            if event[ACTION] == "alloc":
                pending[event[ADDR]] = i
            else:
                pending.pop(event[ADDR], None)
        keep = sorted(pending.values())
        self.dropped += cut - len(keep)
        self._trace = [self._trace[i] for i in keep] + self._trace[cut:]
        self._times = [self._times[i] for i in keep] + self._times[cut:]


def _wrapped_numbers(ptrs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Which of these events (addresses, and bytes: negative for a free) allocate a Python
    number an operator wrapped as a CPU tensor, or its cast to the other operand's dtype:
    ``x * 0.5`` on a float tensor allocates 8 bytes (a double), then 4 (a float), then its
    result, and frees the cast as it ends (the double may be saved for backward). On a GPU
    neither reaches the device (a CPU scalar is a kernel argument), and no dispatch mode
    sees them: the exact recorder's trace has no such pair. A number with no cast
    (``i + 1`` on integers) is kept."""
    n = len(sizes)
    dropped = np.zeros(n, bool)
    if n < 3:
        return dropped
    number = np.isin(sizes[:-2], _NUMBER_BYTES)  # at i, the cast at i + 1
    cast, cast_ptr = sizes[1:-1], ptrs[1:-1]
    freed = np.zeros(n - 2, bool)
    for k in range(2, 2 + _OP):
        freed[:n - k] |= (ptrs[k:] == cast_ptr[:n - k]) & (sizes[k:] < 0)
    pair = number & (cast > 0) & (cast <= 8) & freed
    # a tensor of a number's size just before a pair is not one (an Adam moment of 16
    # bytes before ``step += 1``'s number and cast)
    pair[:-1] &= ~pair[1:]
    first = np.flatnonzero(pair)
    dropped[first] = dropped[first + 1] = True
    return dropped


def _enable() -> None:
    """Turn on the profiler's memory reporting, with no operator events."""
    # (state, shapes, memory, stacks, flops, modules): memory alone
    config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False,
                            torch._C._profiler._ExperimentalConfig())
    # a device this process has none of (Meta's accelerator): no device tracer (CUPTI, a
    # PrivateUse1 backend's) starts
    activities = {ProfilerActivity.MTIA}
    _prepare_profiler(config, activities)
    _enable_profiler(config, activities)


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 for the block: Kineto logs its start and stop there, and
    a warning that there are no operator events to match, none of them the script's (what
    another of the script's threads writes there in those microseconds is lost too)."""
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
