"""Write a snapshot as ``torch.cuda.memory._dump_snapshot`` does: a pickle of plain containers.

A trace memprof recorded in this process holds tuples (``events.py``); it is written as
the dicts a snapshot holds, a chunk at a time, so a long trace is never held as dicts.
The pickle is one stream that PyTorch's memory viewer and any unpickler read as usual:
protocol 2, whose memo entries carry their index, so that after each chunk the
pickler can forget the chunk's dicts and keep what later events share (their stacks,
converted and written once, first, under ``memprof.stacks``).
"""

from __future__ import annotations

import io
import pickle
from typing import Any, BinaryIO

from memprof.trace.events import as_snapshot_events, is_recorded, snapshot_stack

_CHUNK = 8192  # events converted to dicts at a time
_PROTOCOL = 2
_PUT_SIZES = {pickle.BINPUT[0]: 2, pickle.LONG_BINPUT[0]: 5}  # opcode and index


def dump_snapshot(snapshot: dict[str, Any], f: BinaryIO) -> None:
    """Pickle ``snapshot`` to ``f``, its recorded traces streamed as dicts."""
    traces = snapshot.get("device_traces") or []
    if not any(trace and is_recorded(trace[0]) for trace in traces):
        pickle.dump(snapshot, f, protocol=4)
        return
    writer = _Writer()
    stacks = _stacks(traces)
    # First the stacks, so that they hold the memo's first entries: the pickler can then
    # go back to those alone (``forget``) and number new entries after them.
    f.write(pickle.PROTO + bytes([_PROTOCOL]) + pickle.EMPTY_DICT + pickle.MARK
            + writer.body("memprof") + pickle.EMPTY_DICT + pickle.MARK
            + writer.body("stacks") + writer.body(list(stacks.values())))
    shared = writer.memo()
    for key, value in (snapshot.get("memprof") or {}).items():
        f.write(writer.body(key))
        _write(f, writer, shared, value, stacks)
    f.write(pickle.SETITEMS)
    for key, value in snapshot.items():
        if key not in ("memprof", "device_traces"):
            f.write(writer.body(key) + writer.body(value))
    f.write(writer.body("device_traces") + pickle.EMPTY_LIST + pickle.MARK)
    for trace in traces:
        _write(f, writer, shared, trace, stacks)
    f.write(pickle.APPENDS + pickle.SETITEMS + pickle.STOP)


def _write(f: BinaryIO, writer: _Writer, shared: dict[int, Any], value: object,
           stacks: dict[int, list[Any]]) -> None:
    """Write ``value``; a list (a trace, a recording's labels) a chunk at a time, its
    recorded events as dicts (their stacks: ``stacks``, written already), the pickler back
    to ``shared`` after each chunk."""
    if type(value) is not list:
        f.write(writer.body(value))
        return
    f.write(pickle.EMPTY_LIST)
    writer.forget(shared)
    for start in range(0, len(value), _CHUNK):
        f.write(writer.items(as_snapshot_events(value[start:start + _CHUNK], stacks)))
        writer.forget(shared)


def _stacks(traces: list[list[Any]]) -> dict[int, list[Any]]:
    """Each distinct stack of the recorded traces, as a snapshot's list of frame dicts, by
    the id of the tuple the events share."""
    converted: dict[int, list[Any]] = {}
    frames: dict[int, dict[str, Any]] = {}
    for trace in traces:
        for event in trace:
            if is_recorded(event) and id(event[-1]) not in converted:
                converted[id(event[-1])] = snapshot_stack(event[-1], frames)
    return converted


class _Writer:
    """One pickler whose memo spans the stream: each object's opcodes without the header."""

    def __init__(self) -> None:
        self._buffer = io.BytesIO()
        self._pickler = pickle.Pickler(self._buffer, protocol=_PROTOCOL)

    def body(self, obj: object) -> bytes:
        """The opcodes that push ``obj``, memoised for what follows."""
        self._buffer.seek(0)
        self._buffer.truncate()
        self._pickler.dump(obj)
        return self._buffer.getvalue()[2:-1]  # without PROTO 2 and STOP

    def items(self, chunk: list[Any]) -> bytes:
        """The opcodes that append ``chunk``'s items to the list below them."""
        body = self.body(chunk)  # EMPTY_LIST, its PUT, then the APPEND(S) batches
        return body[1 + _PUT_SIZES[body[1]]:]

    def memo(self) -> dict[int, Any]:
        return self._pickler.memo.copy()

    def forget(self, memo: dict[int, Any]) -> None:
        """Back to ``memo``: its entries keep their indices, new ones reuse those after."""
        self._pickler.memo = memo
