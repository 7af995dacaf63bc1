"""Allocation sites: which line of the user's code asked for memory, through which call."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import memprof
from memprof.trace.model import Frame, Frames

_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/", "/torch/", "torchinductor",
                    "/lib/python3", "<frozen ", "<string>")
# memprof's command line: its frames and those outside them are not the script's
_COMMANDS = str(Path(memprof.__file__).resolve().parent / "cli").replace("\\", "/") + "/"
# torch's module-call plumbing, and libraries' decorators (transformers' deprecate_kwarg,
# can_return_tuple, accelerate's hooks), say nothing about what allocated
_PLUMBING = {"_call_impl", "_wrapped_call_impl", "__call__", "inner", "wrapper", "decorate_context",
             "_fn", "new_forward", "forward_call", "_use_grad", "maybe_fallback",
             "wrapped_func", "wrapped", "_wrapper", "wrapped_fn", "wrapper_fn", "decorated"}


def is_library(frame: Frame) -> bool:
    """A frame of torch, an installed package or the standard library, not the user's code."""
    path = frame.filename.replace("\\", "/")
    return any(m in path for m in _LIBRARY_MARKERS) or path.startswith("<")


@dataclass(frozen=True, slots=True)
class Site:
    """Where an allocation came from: the user's line and the library call it made."""

    user: Frame | None
    call: Frame | None
    note: str | None = None  # the innermost ATen op, or why there is no stack

    @property
    def label(self) -> str:
        if self.user is None and self.call is None:
            return self.note or "unknown (no stack recorded)"
        parts = []
        if self.user is not None:
            parts.append(f"{short_path(self.user.filename)}:{self.user.line} {self.user.name}")
        if self.call is not None:
            parts.append(f"{short_path(self.call.filename)}:{self.call.line} {self.call.name}")
        return " → ".join(parts)


def short_path(filename: str, keep: int = 2) -> str:
    """The last ``keep`` components of a path, whatever its separators."""
    parts = filename.replace("\\", "/").split("/")
    return "/".join(parts[-keep:])


def site_of(frames: Frames) -> Site:
    """The site of a stack (innermost frame first); C++ frames are skipped."""
    python = []
    for f in frames:
        if f.is_python:
            if f.filename.replace("\\", "/").startswith(_COMMANDS):
                break  # ``run -c CODE``'s code is "<string>": no frame of it is a file
            python.append(f)
    for i, frame in enumerate(python):
        if not is_library(frame):
            return Site(frame, _library_call(python[:i]))
    if python:
        return Site(None, _library_call(python))
    return Site(None, None, _aten_op(frames))


def _library_call(inner: list[Frame]) -> Frame | None:
    """The outermost library frame below the user's, skipping module-call plumbing."""
    for frame in reversed(inner):
        if frame.name not in _PLUMBING:
            return frame
    return inner[-1] if inner else None


def _aten_op(frames: Frames) -> str | None:
    for frame in frames:
        name = frame.name
        if "at::_ops::" in name:
            op = name.split("at::_ops::", 1)[1].split("::", 1)[0]
            return f"aten::{op} (no Python stack)"
    return None
