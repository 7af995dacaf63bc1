"""Which nn.Module allocated: the innermost module running (``module_stack.py``), asked by
the storage tracker at each allocation.

Global forward pre/post hooks keep the stack; in backward, the module whose forward made
the autograd node being run is the one that allocates. A module's own parameters and
buffers are attributed to it when it first runs with them. The same hooks tell the
tracker which frame runs each module's call, so that its stack captures stop there.

    scope = ModuleScope(tracker)
    scope.install()   # tracker.modules: id(alloc event) -> module path
    ...
    scope.remove()
"""

from __future__ import annotations

import sys
import threading
from types import FrameType

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from memprof.collect.cpu.storages import StorageTracker
from memprof.collect.hooks.module_stack import ModuleStack

# the frame of a module's call: while its forward runs, it and the frames outside it stay
_CALL_IMPL = torch.nn.Module._call_impl.__code__


class ModuleScope:
    """Attributes the alloc events of ``tracker`` to the module path that made them."""

    def __init__(self, tracker: StorageTracker) -> None:
        self._tracker = tracker
        self._stack = ModuleStack()
        self._handles: list[RemovableHandle] = []
        self._local = threading.local()  # .held: [(module, its _call_impl frame)] running

    @property
    def files(self) -> set[str]:
        """The files defining the seen modules' forward, outside torch."""
        return self._stack.files

    def install(self) -> None:
        """Register the global hooks and make ``tracker`` ask for the current module."""
        self._handles = [
            register_module_forward_pre_hook(self._enter),
            register_module_forward_hook(self._exit, always_call=True),
            register_optimizer_step_post_hook(self._forget),
        ]
        self._tracker.scope = self._stack.current

    def remove(self) -> None:
        """Remove the hooks."""
        self._local = threading.local()  # no frame outlives the recording here
        self._tracker.scope = None
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter(self, module: torch.nn.Module, args: object) -> None:
        held = self._held()
        if held and not self._stack.depth():  # no module runs: an interrupted call's
            self._release(held, 0)
        path = self._stack.enter(module)
        for t in (*module._parameters.values(), *module._buffers.values()):
            if t is not None:
                for event in self._tracker.alloc_events(t):
                    self._tracker.modules.setdefault(id(event), path)
        frame = sys._getframe(1).f_back  # the hook's caller (inner) is called by _call_impl
        if frame is not None and frame.f_code is _CALL_IMPL:
            self._tracker.hold_frame(frame)
            held.append((module, frame))

    def _exit(self, module: torch.nn.Module, args: object, output: object) -> None:
        self._stack.exit(module)
        held = self._held()
        for i in range(len(held) - 1, -1, -1):  # an exception may have skipped inner exits
            if held[i][0] is module:
                self._release(held, i)
                break

    def _held(self) -> list[tuple[torch.nn.Module, FrameType]]:
        held = getattr(self._local, "held", None)
        if held is None:
            held = self._local.held = []
        return held

    def _release(self, held: list[tuple[torch.nn.Module, FrameType]], start: int) -> None:
        for _, frame in held[start:]:
            self._tracker.release_frame(frame)
        del held[start:]

    def _forget(self, optimizer: object, args: object, kwargs: object) -> None:
        self._stack.forget()
