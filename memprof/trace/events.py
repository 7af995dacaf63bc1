"""Trace events as memprof's recorders keep them: plain tuples in a snapshot entry's field order.

A recorded trace stays a list of these from the recorder to the file: a tuple holds an
event in a third of a dict's memory, and a long run holds millions. ``normalize`` reads
them as it reads a snapshot's dicts, and ``dump.py`` writes them as those dicts.

They are exact tuples of strings, integers and tuples, stacks included, because CPython's
cyclic collector stops tracking such a tuple at its first collection. A recording's
events then add nothing to the collections the script's own allocations trigger, where
tracked ones (a NamedTuple always is; so is any tuple holding a list or a dict) would be
walked by every full collection and would trigger more of them.

    event = ("alloc", addr, size, stream, time_us, stack)  # TraceEvent, read by index
    stack = (("forward", "/u/model.py", 42), ...)           # Stack of Frames, innermost first
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeAlias

Frame: TypeAlias = tuple[str, str, int]  # (name, filename, line)
Stack: TypeAlias = tuple[Frame, ...]
TraceEvent: TypeAlias = tuple[str, int, int, int, int, Stack]
# a TraceEvent's fields; an OomEvent's time and stack are its last two too
ACTION, ADDR, SIZE, STREAM, TIME_US, STACK = range(6)


class OomEvent(NamedTuple):
    """The trace's record of an allocation the device refused, in a snapshot's field order
    (rare: a NamedTuple, read by name)."""

    action: str
    addr: int
    size: int
    stream: int
    device_free: int
    time_us: int
    frames: Stack


def is_recorded(event: object) -> bool:
    """Whether ``event`` is a recorded event (a tuple above), not a snapshot's dict."""
    return type(event) is tuple or type(event) is OomEvent


def snapshot_stack(stack: Stack, frames: dict[int, dict[str, Any]] | None = None
                   ) -> list[dict[str, Any]]:
    """``stack`` as a snapshot holds it: a list of ``{"name", "filename", "line"}`` dicts;
    ``frames`` (by the frame tuple's id) shares the dicts of frames seen before."""
    if frames is None:
        return [{"name": n, "filename": f, "line": line} for n, f, line in stack]
    out = []
    for frame in stack:
        entry = frames.get(id(frame))
        if entry is None:
            name, filename, line = frame
            entry = frames[id(frame)] = {"name": name, "filename": filename, "line": line}
        out.append(entry)
    return out


def as_snapshot_events(events: list[Any], stacks: dict[int, list[dict[str, Any]]] | None = None
                       ) -> list[dict[str, Any]]:
    """``events`` as a snapshot's trace holds them: dicts, stacks as lists of frame dicts
    (recorded tuples converted, each distinct stack once: ``stacks``, by the stack's id, is
    the conversions made so far, and may be shared between calls)."""
    stacks = {} if stacks is None else stacks
    frames: dict[int, dict[str, Any]] = {}
    out = []
    for e in events:
        if type(e) is not tuple and type(e) is not OomEvent:
            out.append(e)
            continue
        stack = stacks.get(id(e[-1]))
        if stack is None:
            stack = stacks[id(e[-1])] = snapshot_stack(e[-1], frames)
        if type(e) is tuple:  # a dict display: half the time of a NamedTuple's _asdict()
            out.append({"action": e[0], "addr": e[1], "size": e[2], "stream": e[3],
                        "time_us": e[4], "frames": stack})
        else:
            out.append({**e._asdict(), "frames": stack})
    return out
