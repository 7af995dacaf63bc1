"""Which nn.Module is running: a per-thread stack of module paths, and in backward the module
whose forward created the autograd node being run.

A module's path is its name in the outermost running module's ``named_modules()``
(``transformer.h.3.attn``; the outermost itself goes by its class name). In backward, the
autograd node being run carries the sequence number autograd gave the forward op it
differentiates; the module that was innermost when that number was handed out is the one
whose backward allocates.

    stack = ModuleStack()
    path = stack.enter(module)  # from a forward pre-hook
    stack.exit(module)          # from a forward hook
    stack.current()             # the innermost path, or the backward's module, or None
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from pathlib import Path

import torch

from memprof.collect.hooks.weak_ids import WeakIdMap

_TORCH = str(Path(torch.__file__).resolve().parent)
_Running = tuple[torch.nn.Module, str]


class _Stacks(threading.local):
    """Each thread's running modules: an attribute from its first access on, as a missing
    attribute of a ``threading.local`` costs an exception, microseconds at every allocation
    made outside every module."""

    def __init__(self) -> None:
        self.stack: list[_Running] = []


def _next_sequence_nr() -> int:
    """The sequence number autograd gives the next node this thread creates."""
    return torch._C._autograd._get_sequence_nr()


class ModuleStack:
    """The modules running on each thread, by path, and the module of each autograd node."""

    def __init__(self) -> None:
        self.files: set[str] = set()  # files defining the seen modules' forward, outside torch
        self._local = _Stacks()
        self._paths: WeakIdMap[str] = WeakIdMap()  # module -> path
        # where the innermost module changed in forward: sequence numbers, and the path from
        # there on (None: outside every module)
        self._starts: list[int] = []
        self._owners: list[str | None] = []

    def enter(self, module: torch.nn.Module) -> str:
        """``module``'s forward starts on this thread: its path."""
        stack = self._local.stack
        path = self._path(module, stack)
        stack.append((module, path))
        self._mark(path)
        return path

    def exit(self, module: torch.nn.Module) -> None:
        """``module``'s forward has ended on this thread."""
        stack = self._local.stack
        for i in range(len(stack) - 1, -1, -1):  # an exception may have skipped inner exits
            if stack[i][0] is module:
                del stack[i:]
                break
        self._mark(stack[-1][1] if stack else None)

    def current(self) -> str | None:
        """The path of the module running now on this thread, None outside every module."""
        stack = self._local.stack  # asked at every allocation: no call
        return stack[-1][1] if stack else self.in_backward()

    def depth(self) -> int:
        """How many modules' forwards are running on this thread."""
        return len(self._local.stack)

    def in_backward(self) -> str | None:
        """The module whose forward made the autograd node this thread runs (None: none)."""
        node = torch._C._current_autograd_node()
        if node is None:
            return None
        i = bisect_right(self._starts, node._sequence_nr()) - 1
        return self._owners[i] if i >= 0 else None

    def forget(self) -> None:
        """After an optimizer step the graphs before it have run their backward: keep the
        marks small."""
        if self._starts:
            self._starts, self._owners = [_next_sequence_nr()], [self._owners[-1]]

    def _mark(self, path: str | None) -> None:
        if torch.is_grad_enabled():  # no graph, no backward to attribute
            self._starts.append(_next_sequence_nr())
            self._owners.append(path)

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
