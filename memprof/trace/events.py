"""Trace events as memprof's recorders keep them: tuples in a snapshot entry's field order.

A recorded trace stays a list of these from the recorder to the file: a tuple holds an
event in a third of a dict's memory, and a long run holds millions. ``normalize`` reads
them as it reads a snapshot's dicts, and ``dump.py`` writes them as those dicts.
"""

from __future__ import annotations

from typing import Any, NamedTuple

Frame = dict[str, Any]  # {"name", "filename", "line"}, as a snapshot holds it


class TraceEvent(NamedTuple):
    """One event of the trace, with the fields of a snapshot's trace entry, in its order."""

    action: str
    addr: int
    size: int
    stream: int
    time_us: int
    frames: list[Frame]


class OomEvent(NamedTuple):
    """The trace's record of an allocation the device refused, in a snapshot's field order."""

    action: str
    addr: int
    size: int
    stream: int
    device_free: int
    time_us: int
    frames: list[Frame]


RECORDED = (TraceEvent, OomEvent)


def as_snapshot_events(events: list[Any]) -> list[dict[str, Any]]:
    """``events`` as a snapshot's trace holds them: dicts (recorded tuples converted)."""
    # a dict display: half the time of _asdict(), and a long trace has millions of events
    return [{"action": e[0], "addr": e[1], "size": e[2], "stream": e[3], "time_us": e[4],
             "frames": e[5]} if type(e) is TraceEvent
            else e._asdict() if type(e) is OomEvent else e for e in events]
