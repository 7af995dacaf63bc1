"""Threads the script starts while memprof records get memprof's modes too.

PyTorch keeps dispatch and torch-function modes per thread: autograd hands its workers
the modes of the thread that ran ``backward()``, but a Python thread starts with none.
What a thread the script starts allocates was then never recorded: transformers'
``from_pretrained`` loads its weights on a thread pool, and a CPU run of a fine-tuning
script reported no parameters at all.

    inherited(tracker)  # a mode of memprof's that new threads get
    with ThreadModes():
        train()  # threads started here run with the modes of ``inherited`` that the
                 # starting thread has active, entered around their ``run``; a mode with
                 # ``thread_starting`` (the tracker) gets the stack where each started, and
                 # the thread's stacks continue with it

The modes must tolerate several threads (``StorageTracker`` takes a lock), and must do
nothing once their recording has ended: a thread may outlive it.
"""

from __future__ import annotations

import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch.overrides
import torch.utils._python_dispatch as dispatch
from torch.overrides import _get_current_function_mode_stack

_INHERITED: weakref.WeakSet[Any] = weakref.WeakSet()


def inherited(mode: Any) -> None:
    """Make ``mode`` (a dispatch or torch-function mode of memprof's) one that threads
    started while it is active get."""
    _INHERITED.add(mode)


class ThreadModes:
    """While entered, ``threading.Thread.start`` gives the new thread the starting thread's
    inherited modes (single use)."""

    def __init__(self) -> None:
        self._start: Callable[..., None] | None = None
        self._hook: Callable[[Any], object] | None = None

    def __enter__(self) -> ThreadModes:
        original = self._start = threading.Thread.start
        hook = self._hook = threading.excepthook

        def excepthook(args: Any) -> object:  # the script's traceback, without our frame
            tb = _without_frames_of(__file__, args.exc_traceback)
            return hook(threading.ExceptHookArgs((args.exc_type, args.exc_value, tb,
                                                   args.thread)))

        threading.excepthook = excepthook

        def start(thread: threading.Thread, *args: Any, **kwargs: Any) -> None:
            functions = [m for m in _get_current_function_mode_stack() if m in _INHERITED]
            dispatches = [m for m in dispatch._get_current_dispatch_mode_stack()
                          if m in _INHERITED]
            if functions or dispatches:
                caller = sys._getframe(1)
                origins = [(m, m.thread_starting(caller)) for m in dispatches
                           if hasattr(m, "thread_starting")]
                thread.run = _with_modes(thread.run, functions, dispatches, origins)  # type: ignore[method-assign]
            original(thread, *args, **kwargs)

        start.__doc__ = original.__doc__
        threading.Thread.start = start  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._start is not None:
            threading.Thread.start = self._start  # type: ignore[method-assign]
            self._start = None
        if self._hook is not None:
            threading.excepthook = self._hook
            self._hook = None


def _without_frames_of(filename: str, tb: types.TracebackType | None
                       ) -> types.TracebackType | None:
    """``tb`` with the entries of code in ``filename`` unlinked."""
    kept = []
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != filename:
            kept.append(tb)
        tb = tb.tb_next
    for entry, after in zip(kept, [*kept[1:], None], strict=True):
        entry.tb_next = after
    return kept[0] if kept else None


def _with_modes(run: Callable[[], None], functions: list[Any], dispatches: list[Any],
                origins: list[tuple[Any, Any]]) -> Callable[[], None]:
    def run_with_modes() -> None:
        frame = sys._getframe()
        for mode, origin in origins:  # stacks in the thread go on where it was started
            mode.thread_running(frame, origin)
        for mode in functions:  # bottom of the stack first, as the starting thread has them
            torch.overrides._push_mode(mode)
        for mode in dispatches:
            dispatch._push_mode(mode)
        try:
            run()
        finally:
            for _ in dispatches:
                dispatch._pop_mode()
            for _ in functions:
                torch.overrides._pop_mode()
            for mode, _ in origins:
                mode.release_frame(frame)

    return run_with_modes
