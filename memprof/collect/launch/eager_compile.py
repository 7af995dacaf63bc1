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
    """A stand-in for ``torch.compile`` (as a call, a decorator, or a decorator factory)."""

    def __init__(self, where: str) -> None:
        self.notice = (f"memprof: {where}: torch.compile ran the model eagerly; compiled kernels'"
                       " memory (fusion, the partitioner's saved activations) is not measured")
        self._said = False
        self._saved: Any = None

    def __call__(self, model: Any = None, **kwargs: Any) -> Any:
        if not self._said:
            self._said = True
            print(self.notice, file=sys.stderr)
        return (lambda fn: fn) if model is None else model

    def install(self) -> None:
        self._saved = torch.compile
        torch.compile = self  # type: ignore[assignment]

    def remove(self) -> None:
        torch.compile = self._saved
