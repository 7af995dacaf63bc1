"""Run a package's first import inside a context, then call back: how the virtual GPU
prepares libraries it must see imported (bitsandbytes, DeepSpeed's op builders).

    finder = when_imported("bitsandbytes", around, loaded)  # loaded() now, or after it runs
    forget(finder)                                          # when no longer wanted
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable
from typing import Any


class FirstImport(importlib.abc.MetaPathFinder):
    """Finds package ``name`` for its first import, runs it inside ``around``, then calls
    ``loaded``."""

    def __init__(self, name: str, around: Callable[[], contextlib.AbstractContextManager[None]],
                 loaded: Callable[[], None]) -> None:
        self.name = name
        self.around = around
        self.loaded = loaded

    def find_spec(self, name: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name != self.name:
            return None
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is not self and find is not None:
                spec = find(name, path, target)
                if spec is not None:
                    break
        if spec is not None and spec.loader is not None:
            spec.loader = _Around(spec.loader, self.around, self._ran)
        return spec

    def _ran(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self.loaded()


class _Around(importlib.abc.Loader):
    """A package's loader that runs it inside ``around``, then calls ``ran``."""

    def __init__(self, loader: Any, around: Callable[[], contextlib.AbstractContextManager[None]],
                 ran: Callable[[], None]) -> None:
        self._loader = loader
        self._around = around
        self._ran = ran

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        with self._around():
            self._loader.exec_module(module)
        self._ran()

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, get_source, ...
        return getattr(self._loader, name)


def when_imported(name: str, around: Callable[[], contextlib.AbstractContextManager[None]],
                  loaded: Callable[[], None]) -> FirstImport | None:
    """Call ``loaded`` now if ``name`` is imported already; else after its first import,
    run inside ``around``, by the finder returned (installed first on ``sys.meta_path``)."""
    if name in sys.modules:
        loaded()
        return None
    finder = FirstImport(name, around, loaded)
    sys.meta_path.insert(0, finder)
    return finder


def forget(finder: FirstImport | None) -> None:
    """Remove ``finder`` from ``sys.meta_path`` where it is still there."""
    if finder is not None and finder in sys.meta_path:
        sys.meta_path.remove(finder)
