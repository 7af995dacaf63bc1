"""Dispatch modes without Dynamo's per-operator wrapper, and the frames torch puts between
an operator call and a mode's ``__torch_dispatch__``."""

from __future__ import annotations

import sys
from types import FrameType

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class PlainMode(TorchDispatchMode):
    """A dispatch mode whose ``__torch_dispatch__`` torch does not wrap in Dynamo's disable:
    the wrapper costs a few microseconds per operator, and it only matters to Dynamo tracing
    under the mode, which the recorders never do (``eager_compile.py``)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


class _Probe(PlainMode):
    """Finds the Python frames torch puts between an operator call and the mode."""

    def __init__(self, caller: FrameType) -> None:
        super().__init__()
        self.caller = caller
        self.codes: frozenset[int] = frozenset()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        codes = set()
        frame = sys._getframe(1)
        while frame is not None and frame is not self.caller:
            codes.add(id(frame.f_code))
            frame = frame.f_back
        self.codes = frozenset(codes)
        return func(*args, **(kwargs or {}))


def dispatch_wrapper_codes() -> frozenset[int]:
    """The code objects of the Python frames torch puts between an operator call and a
    dispatch mode (skipped when a stack is read)."""
    probe = _Probe(sys._getframe())
    with probe:
        torch.empty(0)
    return probe.codes
