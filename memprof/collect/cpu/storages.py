"""Storage-level allocation tracking: a dispatch mode that emits snapshot trace events.

Every operator call reaches `StorageTracker.__torch_dispatch__` (forward, the autograd
engine's backward and optimizer steps alike). A storage that an operator returns and
that is neither tracked yet nor one of the operator's inputs is a new allocation; a weak
reference to the storage's Python object (which PyTorch keeps alive exactly as long as
the storage itself) reports the free.

    with StorageTracker() as tracker:
        train()
    tracker.events  # [("alloc", addr, size, stream, time_us, stack), ...]: TraceEvents
    tracker.take_trace()  # the trace, moved out of the tracker

Events are tuples (``memprof.trace.events``): a third of a dict's memory, and a long run
holds millions; they become a snapshot's dicts only as the trace is written.

With ``max_entries`` the trace is a ring buffer: when it grows past that many events, the
oldest are dropped, except the alloc events of storages still allocated at the new first
event, which stay (in order) at its head, so the state at every retained event, the
categories of every allocation still alive and the final snapshot are complete.
"""

from __future__ import annotations

import bisect
import itertools
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import torch
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import (
    _get_current_dispatch_mode,
    _pop_mode,
    _push_mode,
)

from memprof.analysis.categories import communication_call
from memprof.collect.cpu.op_facts import (
    FP32,
    FUSED,
    HALF,
    LOSS,
    MAY_ALIAS,
    SCORES,
    VIEW,
    op_facts,
)
from memprof.collect.cpu.plain_mode import PlainMode, dispatch_wrapper_codes
from memprof.collect.cpu.score_ops import is_square, is_vocabulary_wide, logits_rows
from memprof.collect.cpu.storage_resize import ResizeWatch
from memprof.collect.frames import StackCapture
from memprof.collect.recording import requested_peak
from memprof.collect.tensors import storages_behind, tensors_in
from memprof.trace.events import ACTION, ADDR, SIZE, STREAM, Stack, TraceEvent

# Addresses for storages without a usable data pointer (zero bytes, meta, fake, or a
# pointer another live storage already reports): above every user-space pointer.
SYNTHETIC_BASE = 1 << 48
_SYNTHETIC_STEP = 512
_LIFT_FRESH = torch.ops.aten.lift_fresh.default
# A ring buffer is trimmed when it has grown by this share since its last trim (and holds
# more than its limit): a trim is a pass over the buffer, live allocations included.
_TRIM_SLACK = 0.25
_MEMPROF = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))) + os.sep


_RECORDING: weakref.WeakSet[StorageTracker] = weakref.WeakSet()


def _stop_in_child() -> None:
    """A forked child (a DataLoader worker) records nothing: the parent's trace never sees
    its storages, and the dispatch mode it inherited would only slow it down."""
    for tracker in list(_RECORDING):
        tracker._forked = tracker._stopped = True
        if _get_current_dispatch_mode() is tracker:
            _pop_mode()


os.register_at_fork(after_in_child=_stop_in_child)


class _StorageRef(weakref.ref):
    """Weak reference to a tracked storage, carrying its key and alloc event."""

    __slots__ = ("event", "key")


class StorageTracker(PlainMode):
    """Dispatch mode that records alloc/free trace events for tensor storages.

    Storages that exist before the mode is entered are never recorded; storages still
    alive when it exits get no free event (see `survivors`).
    """

    def __init__(self, max_entries: int | None = None) -> None:
        super().__init__()
        self.events: list[TraceEvent] = []
        self.max_entries = max_entries
        self.dropped = 0  # events the ring buffer dropped
        self.live_bytes = 0  # bytes of the tracked storages alive now, and at most
        self.max_live_bytes = 0
        self.steps: list[int] = []  # len(events) at each optimizer step's end, kept current
        self._trim_at = None if max_entries is None else int(max_entries * (1 + _TRIM_SLACK))
        self.survivors: list[TraceEvent] = []
        self.known: dict[int, str] = {}  # id(alloc event) -> category the tracker knows
        self.modules: dict[int, str] = {}  # id(alloc event) -> path of the module that made it
        self.scope: Callable[[], str | None] | None = None  # the module allocating now
        self.square_scores: set[int] = set()  # id(alloc event) of T x T outputs of SCORE_OPS
        # of vocabulary-wide outputs of LOSS_OPS: the rows of the logits their input is part
        # of (more than it has where the loss reads a slice of logits computed whole)
        self.log_probabilities: dict[int, int] = {}
        # of fp32 allocations CUDA autocast would make in half precision, and of those it
        # would cast to half copies for an op it runs in half (which saves the copies)
        self.halves: set[int] = set()
        self.half_copies: set[int] = set()
        # id(alloc event) -> what it gives up to communication, where a collective made it
        self.communication: dict[int, tuple[str, ...]] = {}
        self.fused_attention = False  # a scaled_dot_product_attention kernel ran
        # what is keyed by id(alloc event): purged when the ring buffer drops the event
        self.per_event: list[dict[int, Any] | set[int]] = [
            self.known, self.modules, self.square_scores, self.log_probabilities,
            self.halves, self.half_copies, self.communication]
        self._collective_code: dict[CodeType, tuple[str, ...] | None] = {}
        self._stacks = StackCapture()
        self._live: dict[int, _StorageRef] = {}
        self._empty: dict[int, weakref.ref] = {}  # 0-byte storages: no block, may grow
        self._addrs: set[int] = set()
        self._spare: list[int] = []
        self._synthetic = itertools.count(SYNTHETIC_BASE, _SYNTHETIC_STEP)
        self._wrappers: frozenset[int] = frozenset()
        self._epoch_us = 0
        self._origin_ns = 0
        self._forked = False
        self._stopped = False  # a thread the script started may outlive the recording
        # threads the script starts record too (``threads.py``): one at a time
        self._lock = threading.RLock()
        self._on_free_callback = self._on_free  # one bound method for every weak reference
        self._resizes = ResizeWatch(self.resized)

    def __enter__(self) -> StorageTracker:
        self._wrappers = dispatch_wrapper_codes()
        self._stacks.pin(sys._getframe(1))
        self._epoch_us = time.time_ns() // 1000
        self._origin_ns = time.perf_counter_ns()
        super().__enter__()
        self._resizes.__enter__()
        _RECORDING.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _RECORDING.discard(self)
        self._stacks.pin(None)
        if self._forked:
            return  # a forked child's copy: it stopped recording at the fork
        self._resizes.__exit__()
        if _get_current_dispatch_mode() is not self:
            raise RuntimeError("a dispatch mode entered during recording is still active")
        super().__exit__(*exc)
        with self._lock:
            self._stopped = True
            self.survivors = [ref.event for ref in list(self._live.values())]
            self._live.clear()  # dropping the weak references silences their callbacks

    # a higher-order operator (flex_attention run eagerly) reaches __torch_dispatch__ too
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            # its eager kernel, with this mode on again (pushed, not entered: leaving would
            # end the recording), so that its operators are recorded
            eager = func.py_kernels.get(DispatchKey.CompositeExplicitAutograd)
            if eager is None or self._stopped:
                return func(*args, **kwargs)
            _push_mode(self)
            try:
                return eager(*args, **kwargs)
            finally:
                _pop_mode()
        if self._stopped:
            return func(*args, **kwargs)
        if self._trim_at is not None and len(self.events) > self._trim_at:
            with self._lock:
                self._trim()
        out = func(*args, **kwargs)
        if not op_facts(func) & VIEW:  # a view's storage is its input's: nothing to record
            self._record(out, func, args, kwargs)
        return out

    def run_peak(self) -> dict[str, int | None]:
        """The most bytes the tracked storages held at once over the whole recording, the
        ring buffer's dropped events included."""
        return requested_peak(self.max_live_bytes)

    def take_trace(self) -> list[TraceEvent]:
        """The trace, moved out: the tracker holds no events after."""
        events, self.events = self.events, []
        return events

    def alloc_events(self, t: torch.Tensor) -> list[TraceEvent]:
        """Return the alloc events of the live tracked storages behind `t`."""
        live = self._live
        return [ref.event for st in storages_behind(t)
                if (ref := live.get(st._cdata)) is not None]

    def hold_frame(self, frame: FrameType) -> None:
        """``frame`` runs a module's call: stacks captured inside it stop walking there
        (``StackCapture.hold``), until ``release_frame``."""
        self._stacks.hold(frame)

    def release_frame(self, frame: FrameType) -> None:
        self._stacks.release(frame)

    def thread_starting(self, frame: FrameType) -> Stack:
        """The stack where the script starts a thread (``threads.py``), ``frame`` outwards."""
        return self._stacks.capture(frame)

    def thread_running(self, frame: FrameType, origin: Stack) -> None:
        """A thread the script started runs ``frame``: stacks inside it continue with
        ``origin`` (``thread_starting``'s), until ``release_frame``."""
        self._stacks.continue_with(frame, origin)

    def adopt_shared(self, st: torch.UntypedStorage, frame: FrameType | None) -> None:
        """Record ``st``, a storage mapped from another process (a DataLoader worker's
        batch, ``worker_batches.py``), as allocated now, where ``frame`` runs."""
        key = st._cdata
        with self._lock:
            if key not in self._live:
                self._alloc(st, key, frame)

    def resized(self, st: torch.UntypedStorage, frame: FrameType | None) -> None:
        """``st.resize_(n)`` ran where ``frame`` runs: a tracked block of another size is
        freed, and a new block of ``n`` bytes allocated unless ``n`` is 0, as on a card."""
        key = st._cdata
        with self._lock:
            if self._stopped:
                return
            ref = self._live.get(key)
            if ref is not None:
                if ref.event[SIZE] == st.nbytes():
                    return
                self._free(ref, frame)
            elif (empty := self._empty.pop(key, None)) is None or empty() is not st:
                return  # a storage made before the recording: not the trace's
            if st.nbytes():
                self._alloc(st, key, frame)
            else:
                self._empty[key] = weakref.ref(st, self._forget_empty(key))

    def _record(self, out: object, func: object, args: tuple, kwargs: dict) -> None:
        with self._lock:
            frame = None
            inputs = None
            facts = op_facts(func)
            new: list[int] = []  # the fp32 allocations it made
            for t in (out,) if type(out) is torch.Tensor else tensors_in(out):
                for st in storages_behind(t):
                    key = st._cdata
                    ref = self._live.get(key)
                    if ref is not None:
                        if ref.event[SIZE] == st.nbytes():
                            continue
                        frame = frame or self._op_frame()
                        self._free(ref, frame)  # resized in place: a new block, like realloc
                    elif (empty := self._empty.pop(key, None)) is not None and empty() is st:
                        pass  # an empty storage grown in place (an ``out=`` argument)
                    # lift_fresh returns torch.tensor()'s new data
                    elif facts & MAY_ALIAS and func is not _LIFT_FRESH:
                        if inputs is None:
                            inputs = self._input_keys(args, kwargs)
                        if key in inputs:
                            continue
                    if not st.nbytes():  # no block: neither allocator makes one for 0 bytes
                        self._empty[key] = weakref.ref(st, self._forget_empty(key))
                        continue
                    frame = frame or self._op_frame()
                    self._alloc(st, key, frame)
                    if facts & (SCORES | FUSED | LOSS):
                        self._classify(facts, t, args)
                    if t.dtype is torch.float32:
                        new.append(id(self.events[-1]))
            if (new or facts & HALF) and not facts & FP32 and torch.is_grad_enabled():
                self._note_half(facts & HALF, new, args, kwargs)

    def _trim(self) -> list[int]:
        """Drop the oldest events down to ``max_entries``, but for the alloc events of blocks
        not freed before the new first event; return the dropped indices, ascending."""
        cut = len(self.events) - self.max_entries  # type: ignore[operator]
        if self.events[cut - 1][ACTION] == "free_requested":
            cut -= 1  # a free's two events stay together
        head = self.events[:cut]
        pending: dict[int, int] = {}  # addr -> index of the alloc of a block not yet freed
        keep: set[int] = set()
        for i, event in enumerate(head):
            action = event[ACTION]
            if action == "alloc":
                pending[event[ADDR]] = i
            elif action == "free_completed":
                pending.pop(event[ADDR], None)
            elif action != "free_requested":
                keep.add(i)  # an out-of-memory record: rare, and the report's subject
        keep.update(pending.values())
        dropped = [i for i in range(cut) if i not in keep]
        for i in dropped:
            key = id(head[i])
            for table in self.per_event:
                if isinstance(table, set):
                    table.discard(key)
                else:
                    table.pop(key, None)
        self.events = [head[i] for i in sorted(keep)] + self.events[cut:]
        self.steps = [end - bisect.bisect_left(dropped, end) for end in self.steps]
        self.dropped += len(dropped)
        self._trim_at = int(max(len(self.events), self.max_entries) * (1 + _TRIM_SLACK))
        return dropped

    def _note_half(self, half: int, new: list[int], args: tuple, kwargs: dict) -> None:
        """What CUDA autocast would keep in half precision (``autocast_ops.py``): the outputs
        of an op it runs in half, and of another op whose floating inputs all are
        (``halves``); the fp32 inputs it casts for an op it runs in half, which saves the
        half copies (``half_copies``)."""
        refs = [self._live.get(st._cdata) for t in _input_tensors(args, kwargs)
                if t.dtype is torch.float32 and t.dim() for st in storages_behind(t)]
        inputs = [id(ref.event) for ref in refs if ref is not None]
        if half:
            self.half_copies.update(i for i in inputs if i not in self.halves)
            self.halves.update(new)
        elif inputs and all(i in self.halves for i in inputs):
            self.halves.update(new)

    def _classify(self, facts: int, t: torch.Tensor, args: tuple) -> None:
        """Note what the new allocation's op (``op_facts``) tells the savings models."""
        if facts & SCORES and is_square(t):
            self.square_scores.add(id(self.events[-1]))
        if facts & LOSS and is_vocabulary_wide(t):
            self.log_probabilities[id(self.events[-1])] = logits_rows(args[0], t)
        if facts & FUSED:
            self.fused_attention = True

    @staticmethod
    def _input_keys(args: tuple, kwargs: dict) -> set[int]:
        return {st._cdata for t in _input_tensors(args, kwargs) for st in storages_behind(t)}

    def _op_frame(self) -> FrameType | None:
        # 0: _op_frame, 1: _record, 2: __torch_dispatch__, then torch's wrappers, if any.
        frame = sys._getframe(2).f_back
        while frame is not None and id(frame.f_code) in self._wrappers:
            frame = frame.f_back
        return frame

    def _alloc(self, st: torch.UntypedStorage, key: int, frame: FrameType | None) -> None:
        size = st.nbytes()
        event = ("alloc", self._address(st), size, 0, self._now_us(), self._stacks.capture(frame))
        self.live_bytes += size
        if self.live_bytes > self.max_live_bytes:
            self.max_live_bytes = self.live_bytes
        scope = self.scope
        if scope is not None and (path := scope()) is not None:
            self.modules[id(event)] = path
        if gives_up := self._by_collective(frame):
            self.communication[id(event)] = gives_up
        ref = _StorageRef(st, self._on_free_callback)
        ref.event = event
        ref.key = key
        self._live[key] = ref
        self.events.append(event)

    def _by_collective(self, frame: FrameType | None) -> tuple[str, ...]:
        """What the allocation ``frame`` asked for gives up to communication
        (``communication_call``)."""
        while frame is not None:
            code = frame.f_code
            if code in self._collective_code:
                verdict = self._collective_code[code]
            else:  # memprof's own frames (the virtual GPU's) stand between, as decorators do
                verdict = self._collective_code[code] = None if code.co_filename.startswith(
                    _MEMPROF) else communication_call(code.co_filename, code.co_name)
            if verdict is not None:
                return verdict
            frame = frame.f_back
        return ()

    def _forget_empty(self, key: int) -> Callable[[weakref.ref], None]:
        """The callback that drops an empty storage's entry when it dies."""
        def forget(ref: weakref.ref) -> None:
            if self._empty.get(key) is ref:
                del self._empty[key]
        return forget

    def _on_free(self, ref: _StorageRef) -> None:
        with self._lock:
            if not self._stopped and self._live.get(ref.key) is ref:
                # f_back: None when a C++ thread (gloo's) drops the last reference
                self._free(ref, sys._getframe().f_back)

    def _free(self, ref: _StorageRef, frame: FrameType | None) -> None:
        del self._live[ref.key]
        alloc = ref.event
        addr, size, stream = alloc[ADDR], alloc[SIZE], alloc[STREAM]
        self.live_bytes -= size
        now, stack = self._now_us(), self._stacks.capture(frame)
        self.events.extend((("free_requested", addr, size, stream, now, stack),  # one call:
                            ("free_completed", addr, size, stream, now, stack)))  # adjacent
        self._addrs.discard(addr)
        if addr >= SYNTHETIC_BASE:
            self._spare.append(addr)

    def _address(self, st: torch.UntypedStorage) -> int:
        ptr = st.data_ptr()  # 0 for a meta storage (and a fake one)
        if ptr and ptr not in self._addrs:
            self._addrs.add(ptr)
            return ptr
        addr = self._spare.pop() if self._spare else next(self._synthetic)
        self._addrs.add(addr)
        return addr

    def _now_us(self) -> int:
        return self._epoch_us + (time.perf_counter_ns() - self._origin_ns) // 1000


def _input_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an operator's arguments."""
    return tensors_in(args) + (tensors_in(tuple(kwargs.values())) if kwargs else [])
