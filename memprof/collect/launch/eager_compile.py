"""``torch.compile`` while memprof records with a dispatch mode or on the virtual GPU: the
model itself, run eagerly, and the run says so once.

Under a Python dispatch mode Dynamo would fall back to eager execution without a word; on
the virtual GPU there is no kernel to compile for. Either way the memory measured is the
eager program's, so the notice names what is not measured.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


class EagerCompile:
    """A stand-in for ``torch.compile`` (as a call, a decorator, or a decorator factory)
    that says once for each thing compiled that it runs eagerly."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._said: set[str] = set()
        self._saved: Any = None

    def __call__(self, model: Any = None, **kwargs: Any) -> Any:
        if model is None:
            return self
        name = getattr(model, "__qualname__", None) or type(model).__name__
        if name not in self._said:
            self._said.add(name)
            print(f"memprof: {self.where}: torch.compile ran {name} eagerly; compiled kernels'"
                  " memory (fusion, the partitioner's saved activations, flex attention's"
                  " fused kernel) is not measured", file=sys.stderr)
        return model

    def install(self) -> None:
        self._saved = torch.compile
        torch.compile = self  # type: ignore[assignment]

    def remove(self) -> None:
        torch.compile = self._saved
