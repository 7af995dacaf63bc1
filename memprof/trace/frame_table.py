"""Raw stacks (a snapshot's frame dicts, or the tuples memprof's recorders hold) as shared
:class:`Frame` tuples, each distinct one converted once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memprof.trace.fields import text
from memprof.trace.model import Frame, Frames

MAX_FRAMES = 1024  # innermost frames kept per stack; real stacks hold a few hundred at most


class FrameTable:
    """Converts raw frame lists (and the stacks memprof's recorders hold, ``events.py``) to
    shared :class:`Frame` tuples.

    Snapshots share frame dicts (and sometimes whole lists) between events (pickle
    memoisation), so caching by object identity converts each distinct one once, and a
    file cannot make memprof build more frames than it holds. The raw lists stay
    referenced by the trace, which keeps the identities valid.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, Frame] = {}
        self._lists: dict[int, Frames] = {}

    def frame(self, raw: Mapping[str, Any]) -> Frame:
        key = id(raw)
        cached = self._by_id.get(key)
        if cached is None:
            line = raw.get("line")
            cached = Frame(text(raw, "filename", "??"),
                           line if type(line) is int and 0 <= line < 1 << 31 else 0,
                           text(raw, "name", "??"))
            self._by_id[key] = cached
        return cached

    def recorded_frame(self, raw: tuple) -> Frame:
        """A frame as the recorders hold it: ``(name, filename, line)``."""
        key = id(raw)
        cached = self._by_id.get(key)
        if cached is None:
            name, filename, line = raw if len(raw) == 3 else ("??", "??", 0)
            cached = Frame(filename if type(filename) is str else "??",
                           line if type(line) is int and 0 <= line < 1 << 31 else 0,
                           name if type(name) is str else "??")
            self._by_id[key] = cached
        return cached

    def frames(self, raw: object) -> Frames:
        kind = type(raw)
        if kind is not list and kind is not tuple:
            return ()
        cached = self._lists.get(id(raw))
        if cached is None:
            convert, entry = (self.frame, dict) if kind is list else (self.recorded_frame, tuple)
            cached = tuple(convert(f) for f in raw[:MAX_FRAMES] if type(f) is entry)
            self._lists[id(raw)] = cached
        return cached
