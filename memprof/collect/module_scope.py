"""Which nn.Module allocated: the innermost module running (``module_stack.py``), asked by
the storage tracker at each allocation.

Global forward pre/post hooks keep the stack; in backward, the module whose forward made
the autograd node being run is the one that allocates. A module's own parameters and
buffers are attributed to it when it first runs with them.

    scope = ModuleScope(tracker)
    scope.install()   # tracker.modules: id(alloc event) -> module path
    ...
    scope.remove()
"""

from __future__ import annotations

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from memprof.collect.module_stack import ModuleStack
from memprof.collect.storages import StorageTracker


class ModuleScope:
    """Attributes the alloc events of ``tracker`` to the module path that made them."""

    def __init__(self, tracker: StorageTracker) -> None:
        self._tracker = tracker
        self._stack = ModuleStack()
        self._handles: list[RemovableHandle] = []

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
        self._tracker.scope = None
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter(self, module: torch.nn.Module, args: object) -> None:
        path = self._stack.enter(module)
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            for event in self._tracker.alloc_events(t):
                self._tracker.modules.setdefault(id(event), path)

    def _exit(self, module: torch.nn.Module, args: object, output: object) -> None:
        self._stack.exit(module)

    def _forget(self, optimizer: object, args: object, kwargs: object) -> None:
        self._stack.forget()
