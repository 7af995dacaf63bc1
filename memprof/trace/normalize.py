"""Turn the raw unpickled snapshot (dicts and lists) into the typed model, once, at the edge.

The raw data comes from a file anyone can write: every field is checked here (type and
range, see :mod:`memprof.trace.fields`), and nothing past this module sees raw values.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from operator import itemgetter
from typing import Any

import numpy as np

from memprof.trace.events import OomEvent, is_recorded
from memprof.trace.fields import (
    MAX_ADDRESS,
    MAX_BYTES,
    NotASnapshot,
    describe,
    fraction,
    integer,
    text,
)
from memprof.trace.frame_table import FrameTable
from memprof.trace.model import (
    ACTION_CODES,
    CATEGORIES,
    TAGS,
    Action,
    AllocatorSettings,
    Block,
    DeviceTrace,
    Segment,
    Snapshot,
)

__all__ = ["NotASnapshot", "normalize"]

BLOCK_STATES = {"active_allocated": "active_allocated", "inactive": "inactive",
                "active_pending_free": "active_pending_free",
                "active_awaiting_free": "active_pending_free"}  # the docs' name for it
MAX_DEVICES = 1024  # device indices: a machine has a few dozen GPUs at most
# bytes of all the segments, or all the events of a trace, together: sums of them fit int64
MAX_TOTAL = 1 << 61


def normalize(raw: object, max_items: int | None = None) -> Snapshot:
    """Build a :class:`Snapshot` from any supported raw format, or raise :class:`NotASnapshot`.

    ``max_items``: refuse a snapshot with more segments, blocks and events than this (a
    file of N bytes holds fewer than N of them unless it repeats shared lists: a bomb).
    """
    table = FrameTable()
    if type(raw) is list:
        _check_size(raw, [], max_items)
        return Snapshot(_segments(raw, table), {}, AllocatorSettings(), "segments-list")
    if type(raw) is not dict or type(raw.get("segments")) is not list:
        kind = type(raw).__name__
        raise NotASnapshot(f"a pickled {kind} without the 'segments' list of a snapshot")
    traces_raw = raw.get("device_traces") or []
    if type(traces_raw) is not list:
        raise NotASnapshot("'device_traces' is not a list")
    if len(traces_raw) > MAX_DEVICES:
        raise NotASnapshot(f"'device_traces' lists {len(traces_raw):,} devices, more than"
                           f" {MAX_DEVICES:,}: no machine has that many GPUs")
    _check_size(raw["segments"], traces_raw, max_items)
    segments = _segments(raw["segments"], table)
    traces = {d: _trace(d, events, table) for d, events in enumerate(traces_raw) if events}
    fmt = "2.0" if any(_is_v20(s) for s in raw["segments"]) else "2.1+"
    snapshot = Snapshot(segments=segments, traces=traces,
                        settings=_settings(raw.get("allocator_settings")), format=fmt)
    extra = raw.get("memprof")  # memprof's own key: exact labels and steps of the recorded device
    if type(extra) is dict and extra:
        _memprof_extra(snapshot, extra)
    return snapshot


def _check_size(segments: list, traces: list, max_items: int | None) -> None:
    if max_items is None:
        return
    items = len(segments) + sum(len(t) for t in traces if type(t) is list)
    for s in segments:
        blocks = s.get("blocks") if type(s) is dict else None
        items += len(blocks) if type(blocks) is list else 0
        if items > max_items:
            break
    if items > max_items:
        raise NotASnapshot(f"it unpacks into more than {max_items:,} segments, blocks and"
                           " events, more than a file of its size can hold: the same lists"
                           " repeated (a pickle bomb)")


def _is_v20(segment: object) -> bool:
    blocks = segment.get("blocks") if type(segment) is dict else None
    return type(blocks) is list and bool(blocks) and type(blocks[0]) is dict \
        and "address" not in blocks[0]


def _segments(raw: list, table: FrameTable) -> list[Segment]:
    out = []
    for i, s in enumerate(raw):
        where = f"segment {i}"
        if type(s) is not dict or "address" not in s or "total_size" not in s:
            raise NotASnapshot(f"{where} is not a segment: no 'address'/'total_size'")
        address = integer(s, "address", where, MAX_ADDRESS)
        blocks_raw = s.get("blocks") or []
        if type(blocks_raw) is not list:
            raise NotASnapshot(f"{where}: 'blocks' is {describe(blocks_raw)}, not a list")
        blocks, addr = [], address
        for j, b in enumerate(blocks_raw):
            block = _block(b, f"{where} block {j}", addr, table)
            if block.address != addr:
                raise NotASnapshot(f"{where} block {j} starts at {block.address:#x}, not where"
                                   f" the block before it ends ({addr:#x})")
            blocks.append(block)
            addr = block.address + block.size
        pool = s.get("segment_pool_id") or (0, 0)
        if not _is_pool_id(pool):
            raise NotASnapshot(f"{where}: 'segment_pool_id' is {describe(pool)}, not a pair of"
                               " numbers")
        total_size = integer(s, "total_size", where, MAX_BYTES)
        if addr != address + total_size:
            raise NotASnapshot(f"{where}: its blocks cover {addr - address:,} bytes of its"
                               f" {total_size:,}")
        segment_type = text(s, "segment_type", "large")
        out.append(Segment(
            device=integer(s, "device", where, MAX_DEVICES, default=0),
            address=address,
            total_size=total_size,
            allocated_size=integer(s, "allocated_size", where, MAX_BYTES, default=0),
            active_size=integer(s, "active_size", where, MAX_BYTES, default=0),
            requested_size=integer(s, "requested_size", where, MAX_BYTES, default=0),
            stream=integer(s, "stream", where, default=0),
            segment_type=segment_type if segment_type in ("small", "large") else "large",
            pool_id=(pool[0], pool[1]),
            is_expandable=s.get("is_expandable") is True,
            blocks=blocks,
            frames=table.frames(s.get("frames")),
        ))
    _check_disjoint(out)
    if sum(s.total_size for s in out) >= MAX_TOTAL:
        raise NotASnapshot("its segments add up to more than 2 EiB, more than any devices have")
    return out


def _check_disjoint(segments: list[Segment]) -> None:
    ends: dict[int, tuple[int, int]] = {}  # device -> (end of the segment before, its index)
    for i in sorted(range(len(segments)), key=lambda i: (segments[i].device,
                                                         segments[i].address)):
        s = segments[i]
        end, before = ends.get(s.device, (0, -1))
        if s.address < end:
            raise NotASnapshot(f"segment {i} overlaps segment {before}")
        ends[s.device] = (s.address + s.total_size, i)


def _block(b: object, where: str, addr: int, table: FrameTable) -> Block:
    if type(b) is not dict:
        raise NotASnapshot(f"{where} is {describe(b)}, not a block")
    state = b.get("state")
    if type(state) is not str or state not in BLOCK_STATES:
        raise NotASnapshot(f"{where}: 'state' is {describe(state)}, not one of"
                           " active_allocated, active_pending_free, inactive")
    size = integer(b, "size", where, MAX_BYTES)
    history = b.get("history")
    history = history if type(history) is list and history and type(history[-1]) is dict \
        else None
    # 2.0 blocks carry no address: they tile the segment in order.
    frames_raw = b.get("frames", history[-1].get("frames") if history else None)
    return Block(
        address=integer(b, "address", where, MAX_ADDRESS, default=addr),
        size=size,
        requested_size=integer(b, "requested_size", where, MAX_BYTES, default=size),
        state=BLOCK_STATES[state],
        frames=table.frames(frames_raw),
    )


class _Codes(dict):
    def __missing__(self, key: object) -> Action:
        return Action.OTHER


_CODES = _Codes(ACTION_CODES)


def _column(events: list[dict], key: str, default: int | None = 0) -> np.ndarray | None:
    """One integer field of every event, as numpy reads it (``"12"`` is 12); where it is
    missing: ``default``, or None overall."""
    try:
        try:
            return np.fromiter(map(itemgetter(key), events), np.int64, len(events))
        except (KeyError, TypeError):  # some event lacks the field (or holds None)
            if default is None:
                return None
            return np.fromiter((e.get(key) or default for e in events), np.int64, len(events))
    except (TypeError, ValueError, OverflowError) as exc:
        raise NotASnapshot(f"an event's {key!r} is not a number ({exc})") from None


def _trace(device: int, events: object, table: FrameTable) -> DeviceTrace:
    where = f"device_traces[{device}]"
    if type(events) is not list:
        raise NotASnapshot(f"{where} is not a list of events")
    try:
        if events and is_recorded(events[0]):
            fields, free_at = _recorded_fields(events)
        else:
            fields, free_at = _raw_fields(events), _raw_device_free(events, where)
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
        raise NotASnapshot(f"malformed event in {where}: {exc}") from None
    actions, addr, size, stream, times, frames = fields
    if set(map(type, actions)) - {str}:  # checked before any of them is hashed
        raise NotASnapshot(f"malformed event in {where}: an event's 'action' is not a string")
    action = np.fromiter(map(_CODES.__getitem__, actions), np.int8, len(events))
    _in_range(where, "addr", addr, MAX_ADDRESS)
    _in_range(where, "size", size, MAX_BYTES)
    _in_range(where, "stream", stream, 1 << 62)
    if len(size) and float(size.sum(dtype=np.float64)) >= MAX_TOTAL:
        raise NotASnapshot(f"{where}: its events' sizes add up to more than 2 EiB, sizes no"
                           " device has")
    return DeviceTrace(
        device=device,
        action=action,
        addr=addr,
        size=size,
        stream=stream,
        time_us=times,
        device_free={int(i): free_at(int(i)) for i in np.flatnonzero(action == Action.OOM)},
        _frames=frames,
        _convert=table.frames,
    )


def _raw_fields(events: list) -> tuple:
    """The fields of a snapshot's events (dicts): actions, the integer columns, stacks."""
    actions = list(map(itemgetter("action"), events))  # each event: a dict with an action
    addr, size, stream = (_column(events, k) for k in ("addr", "size", "stream"))
    times = _column(events, "time_us", default=None)  # absent before PyTorch 2.2
    frames = list(map(dict.get, events, repeat("frames")))  # every event is a dict by now
    return actions, addr, size, stream, times, frames


def _raw_device_free(events: list, where: str) -> Callable[[int], int]:
    return lambda i: integer(events[i], "device_free", f"{where} event {i}", MAX_BYTES,
                             default=0)


def _recorded_fields(events: list) -> tuple[tuple, Callable[[int], int]]:
    """The fields of a trace memprof recorded in this process (``events.py`` tuples: six
    fields, an OomEvent seven)."""
    lengths = set(map(len, events)) if not set(map(type, events)) - {tuple, OomEvent} else {0}
    if lengths - {6, 7} or (7 in lengths and any(type(e) is tuple and len(e) == 7
                                                 for e in events)):
        raise TypeError("a recorded trace holds an event of another kind")
    n = len(events)
    actions = list(map(itemgetter(0), events))
    addr, size, stream, times = (np.fromiter(map(itemgetter(k), events), np.int64, n)
                                 for k in (1, 2, 3, -2))
    frames = list(map(itemgetter(-1), events))
    return (actions, addr, size, stream, times, frames), lambda i: events[i].device_free


def _in_range(where: str, key: str, column: np.ndarray, limit: int) -> None:
    if len(column) and (column.min() < 0 or column.max() >= limit):
        bad = int(np.flatnonzero((column < 0) | (column >= limit))[0])
        raise NotASnapshot(f"{where} event {bad}: {key!r} is {int(column[bad]):,}, not a number"
                           f" in [0, {limit:,})")


def _settings(raw: object) -> AllocatorSettings:
    if type(raw) is not dict:
        return AllocatorSettings()
    where = "allocator_settings"
    conf = text(raw, "PYTORCH_CUDA_ALLOC_CONF")
    max_split = raw.get("max_split_size")
    if max_split is not None and (type(max_split) is not int):
        raise NotASnapshot(f"{where}: 'max_split_size' is {describe(max_split)}, not a number")
    divisions = raw.get("roundup_power2_divisions") or []
    if type(divisions) is dict:
        try:
            divisions = [v for _, v in sorted(divisions.items(), key=lambda kv: int(kv[0]))]
        except (TypeError, ValueError):
            raise NotASnapshot(f"{where}: 'roundup_power2_divisions' has a key that is not a"
                               " power of two") from None
    if type(divisions) is not list or not all(type(d) is int and 0 <= d <= 1 << 16
                                             for d in divisions):
        raise NotASnapshot(f"{where}: 'roundup_power2_divisions' is {describe(divisions)}, not"
                           " a list of division counts")
    backend = "cudaMallocAsync" if "cudamallocasync" in conf.lower().replace(" ", "") else "native"
    return AllocatorSettings(
        conf=conf,
        max_split_size=max_split if max_split and 0 < max_split < MAX_BYTES else None,  # -1: unset
        expandable_segments=raw.get("expandable_segments") is True,
        garbage_collection_threshold=fraction(raw, "garbage_collection_threshold", where),
        roundup_power2_divisions=tuple(divisions),
        backend=backend,
    )


def _memprof_extra(snapshot: Snapshot, extra: dict) -> None:
    """memprof's own key: the exact category of each allocation, the step boundaries, and
    the module that made each allocation."""
    where = "memprof"
    device = integer(extra, "device", where, default=0)
    n = len(snapshot.traces[device]) if device in snapshot.traces else 0
    labels = _event_pairs(extra, "labels", n, CATEGORIES, "category")
    tags = _event_pairs(extra, "tags", n, TAGS, "tag")
    steps = extra.get("steps") or []
    if type(steps) is not list or not all(type(s) is int and 0 <= s <= n for s in steps) \
            or steps != sorted(steps):
        raise NotASnapshot(f"{where}: 'steps' is not an increasing list of event indices"
                           f" in [0, {n:,}]")
    dropped = extra.get("dropped_events", 0)
    if type(dropped) is not int or dropped < 0:
        raise NotASnapshot(f"{where}: 'dropped_events' is {describe(dropped)}, not a count")
    run_peak = extra.get("run_peak")
    if run_peak is not None:
        if type(run_peak) is not dict or type(run_peak.get("requested_bytes")) is not int or any(
                v is not None and (type(v) is not int or not 0 <= v < MAX_BYTES)
                for v in run_peak.values()):
            raise NotASnapshot(f"{where}: 'run_peak' is not a map of byte counts")
        snapshot.run_peak = {device: {k: run_peak.get(k) for k in (
            "requested_bytes", "allocated_bytes", "reserved_bytes")}}
    snapshot.labels = {device: dict(labels)}
    snapshot.dropped = {device: dropped}
    snapshot.steps = {device: list(steps)}
    modules, files = extra.get("modules"), extra.get("model_files") or []
    if modules is not None:  # absent before memprof attributed modules
        if type(modules) is not list or not all(
                type(p) in (list, tuple) and len(p) == 2 and type(p[0]) is int
                and 0 <= p[0] < n and type(p[1]) is str for p in modules):
            raise NotASnapshot(f"{where}: 'modules' is not a list of (event index, module path)"
                               " pairs")
        snapshot.modules = {device: dict(modules)}
    if type(files) is not list or not all(type(f) is str for f in files):
        raise NotASnapshot(f"{where}: 'model_files' is not a list of file names")
    snapshot.model_files = frozenset(files)
    snapshot.tags = {device: dict(tags)}
    pools = extra.get("segment_pools") or []
    if type(pools) is not list or not all(
            type(p) in (list, tuple) and len(p) == 2 and type(p[0]) is int and p[0] >= 0
            and _is_pool_id(p[1]) for p in pools):
        raise NotASnapshot(f"{where}: 'segment_pools' is not a list of (segment address,"
                           " pool id) pairs")
    snapshot.segment_pools = {device: {addr: (pool[0], pool[1]) for addr, pool in pools}}
    allowed = extra.get("allowed_bytes")
    if allowed is not None:
        if type(allowed) is not int or not 0 <= allowed < MAX_BYTES:
            raise NotASnapshot(f"{where}: 'allowed_bytes' is {describe(allowed)}, not a byte"
                               " count")
        snapshot.allowed = {device: allowed}


def _is_pool_id(pool: object) -> bool:
    """A ``segment_pool_id``: two non-negative numbers."""
    return type(pool) in (tuple, list) and len(pool) == 2 and all(
        type(p) is int and 0 <= p < 1 << 62 for p in pool)


def _event_pairs(extra: dict, key: str, n: int, allowed: tuple[str, ...], what: str
                 ) -> list[list[Any]]:
    """``extra[key]``: ``[event index, value]`` pairs, each value one of ``allowed``."""
    pairs = extra.get(key) or []
    if type(pairs) is not list or not all(
            type(p) in (list, tuple) and len(p) == 2 and type(p[0]) is int and 0 <= p[0] < n
            and p[1] in allowed for p in pairs):
        raise NotASnapshot(f"memprof: '{key}' is not a list of (event index, {what}) pairs")
    return pairs
