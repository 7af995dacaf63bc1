"""Which nn.Module allocated: the innermost module running, named by its path from the root.

Global forward pre/post hooks keep a per-thread stack of the modules running; a module's
path is its name in the outermost one's ``named_modules()`` (``transformer.h.3.attn``;
the outermost itself goes by its class name). In backward, the autograd node being run
carries the sequence number autograd gave the forward op it differentiates; the module
that was innermost when that number was handed out is the one whose backward allocates.
A module's own parameters and buffers are attributed to it when it first runs with them.

    scope = ModuleScope(tracker)
    scope.install()   # tracker.modules: id(alloc event) -> module path
    ...
    scope.remove()
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from pathlib import Path

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from memprof.collect.storages import StorageTracker

_TORCH = str(Path(torch.__file__).resolve().parent)
_Running = tuple[torch.nn.Module, str]


def _next_sequence_nr() -> int:
    """The sequence number autograd gives the next node this thread creates."""
    return torch._C._autograd._get_sequence_nr()


class ModuleScope:
    """Attributes the alloc events of ``tracker`` to the module path that made them."""

    def __init__(self, tracker: StorageTracker) -> None:
        self.files: set[str] = set()  # files defining the seen modules' forward, outside torch
        self._tracker = tracker
        self._local = threading.local()
        self._paths = WeakIdKeyDictionary()  # module -> path
        # where the innermost module changed in forward: sequence numbers, and the path from
        # there on (None: outside every module)
        self._starts: list[int] = []
        self._owners: list[str | None] = []
        self._handles: list[RemovableHandle] = []

    def install(self) -> None:
        """Register the global hooks and make ``tracker`` ask for the current module."""
        self._handles = [
            register_module_forward_pre_hook(self._enter),
            register_module_forward_hook(self._exit, always_call=True),
            register_optimizer_step_post_hook(self._forget),
        ]
        self._tracker.scope = self.current

    def remove(self) -> None:
        """Remove the hooks."""
        self._tracker.scope = None
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def current(self) -> str | None:
        """The path of the module allocating now, None outside every module."""
        stack = self._stack()
        if stack:
            return stack[-1][1]
        node = torch._C._current_autograd_node()
        if node is None:
            return None
        i = bisect_right(self._starts, node._sequence_nr()) - 1
        return self._owners[i] if i >= 0 else None

    def _stack(self) -> list[_Running]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _enter(self, module: torch.nn.Module, args: object) -> None:
        stack = self._stack()
        path = self._path(module, stack)
        stack.append((module, path))
        self._mark(path)
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            for event in self._tracker.alloc_events(t):
                self._tracker.modules.setdefault(id(event), path)

    def _exit(self, module: torch.nn.Module, args: object, output: object) -> None:
        stack = self._stack()
        for i in range(len(stack) - 1, -1, -1):  # an exception may have skipped inner exits
            if stack[i][0] is module:
                del stack[i:]
                break
        self._mark(stack[-1][1] if stack else None)

    def _mark(self, path: str | None) -> None:
        if torch.is_grad_enabled():  # no graph, no backward to attribute
            self._starts.append(_next_sequence_nr())
            self._owners.append(path)

    def _forget(self, optimizer: object, args: object, kwargs: object) -> None:
        """After a step the graphs before it have run their backward: keep the marks small."""
        if self._starts:
            self._starts, self._owners = [_next_sequence_nr()], [self._owners[-1]]

    def _path(self, module: torch.nn.Module, stack: list[_Running]) -> str:
        path = self._paths.get(module)
        if path is None:
            root = stack[0][0] if stack else module
            for name, sub in root.named_modules():
                if sub not in self._paths:
                    self._paths[sub] = name or type(root).__name__
                    self._note_file(sub)
            path = self._paths.get(module)
            if path is None:  # not registered under the root (a module in a plain list)
                path = self._paths[module] = f"{stack[-1][1]}.{type(module).__name__}"
                self._note_file(module)
        return path

    def _note_file(self, module: torch.nn.Module) -> None:
        code = getattr(type(module).forward, "__code__", None)
        if code is not None and not code.co_filename.startswith(_TORCH):
            self.files.add(code.co_filename)
