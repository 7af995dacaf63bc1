"""Turn the raw unpickled snapshot (dicts and lists) into the typed model, once, at the edge."""

from __future__ import annotations

from collections.abc import Mapping
from operator import itemgetter, methodcaller
from typing import Any

import numpy as np

from memprof.trace.model import (
    ACTION_CODES,
    Action,
    AllocatorSettings,
    Block,
    DeviceTrace,
    Frame,
    Frames,
    Segment,
    Snapshot,
)


class NotASnapshot(ValueError):
    """The object unpickled fine but is not a memory snapshot."""


class FrameTable:
    """Converts raw frame dicts to shared :class:`Frame` objects.

    Snapshots share frame dicts between events (pickle memoisation), so caching by
    object identity converts each distinct frame once. The raw lists stay referenced
    by the trace, which keeps the identities valid.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, Frame] = {}

    def frame(self, raw: Mapping[str, Any]) -> Frame:
        key = id(raw)
        cached = self._by_id.get(key)
        if cached is None:
            cached = Frame(str(raw.get("filename", "")), int(raw.get("line", 0) or 0),
                           str(raw.get("name", "")))
            self._by_id[key] = cached
        return cached

    def frames(self, raw: object) -> Frames:
        if not isinstance(raw, list):
            return ()
        return tuple(self.frame(f) for f in raw if isinstance(f, dict))


def normalize(raw: object) -> Snapshot:
    """Build a :class:`Snapshot` from any supported raw format, or raise :class:`NotASnapshot`."""
    table = FrameTable()
    if isinstance(raw, list):
        return Snapshot(_segments(raw, table), {}, AllocatorSettings(), "segments-list")
    if not isinstance(raw, dict) or not isinstance(raw.get("segments"), list):
        kind = type(raw).__name__
        raise NotASnapshot(f"a pickled {kind} without the 'segments' list of a snapshot")
    segments = _segments(raw["segments"], table)
    traces_raw = raw.get("device_traces") or []
    if not isinstance(traces_raw, list):
        raise NotASnapshot("'device_traces' is not a list")
    traces = {d: _trace(d, events, table) for d, events in enumerate(traces_raw) if events}
    fmt = "2.0" if any(_is_v20(s) for s in raw["segments"]) else "2.1+"
    # memprof's own key: exact labels and steps of the recorded device
    extra = raw.get("memprof") if isinstance(raw.get("memprof"), dict) else {}
    device = int(extra.get("device", 0))
    return Snapshot(
        segments=segments,
        traces=traces,
        settings=_settings(raw.get("allocator_settings")),
        format=fmt,
        labels={device: {int(i): str(c) for i, c in extra.get("labels", [])}} if extra else {},
        steps={device: [int(i) for i in extra.get("steps", [])]} if extra else {},
    )


def _is_v20(segment: object) -> bool:
    blocks = segment.get("blocks") if isinstance(segment, dict) else None
    return bool(blocks) and "address" not in blocks[0]


def _segments(raw: list, table: FrameTable) -> list[Segment]:
    out = []
    for i, s in enumerate(raw):
        if not isinstance(s, dict) or "address" not in s or "total_size" not in s:
            raise NotASnapshot(f"segment {i} is not a segment: no 'address'/'total_size'")
        blocks, addr = [], int(s["address"])
        for b in s.get("blocks") or []:
            history = b.get("history") or []
            # 2.0 blocks carry no address: they tile the segment in order.
            frames_raw = b.get("frames", history[-1].get("frames") if history else None)
            blocks.append(Block(
                address=int(b.get("address", addr)),
                size=int(b["size"]),
                requested_size=int(b.get("requested_size", b["size"])),
                state="active_pending_free" if b["state"] == "active_awaiting_free" else b["state"],
                frames=table.frames(frames_raw),
            ))
            addr = blocks[-1].address + blocks[-1].size
        pool = s.get("segment_pool_id") or (0, 0)
        out.append(Segment(
            device=int(s.get("device", 0)),
            address=int(s["address"]),
            total_size=int(s["total_size"]),
            allocated_size=int(s.get("allocated_size", 0)),
            active_size=int(s.get("active_size", 0)),
            requested_size=int(s.get("requested_size", 0)),
            stream=int(s.get("stream", 0)),
            segment_type=str(s.get("segment_type", "large")),
            pool_id=(int(pool[0]), int(pool[1])),
            is_expandable=bool(s.get("is_expandable", False)),
            blocks=blocks,
            frames=table.frames(s.get("frames")),
        ))
    return out


class _Codes(dict):
    def __missing__(self, key: object) -> Action:
        return Action.OTHER


_CODES = _Codes(ACTION_CODES)


def _column(events: list[dict], key: str, default: int | None = 0) -> np.ndarray | None:
    """One integer field of every event; where it is missing: ``default``, or None overall."""
    try:
        return np.fromiter(map(itemgetter(key), events), np.int64, len(events))
    except (KeyError, TypeError):  # some event lacks the field (or holds None)
        if default is None:
            return None
        return np.fromiter((e.get(key) or default for e in events), np.int64, len(events))


def _trace(device: int, events: list, table: FrameTable) -> DeviceTrace:
    if not isinstance(events, list):
        raise NotASnapshot(f"device_traces[{device}] is not a list of events")
    try:
        action = np.fromiter(map(_CODES.__getitem__, map(itemgetter("action"), events)),
                             np.int8, len(events))
        addr, size, stream = (_column(events, k) for k in ("addr", "size", "stream"))
        times = _column(events, "time_us", default=None)  # absent before PyTorch 2.2
        frames = list(map(methodcaller("get", "frames"), events))
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
        raise NotASnapshot(f"malformed event in device_traces[{device}]: {exc}") from None
    oom = np.flatnonzero(action == Action.OOM)
    return DeviceTrace(
        device=device,
        action=action,
        addr=addr,
        size=size,
        stream=stream,
        time_us=times,
        device_free={int(i): int(events[i].get("device_free", 0) or 0) for i in oom},
        _frames=frames,
        _convert=table.frames,
    )


def _settings(raw: object) -> AllocatorSettings:
    if not isinstance(raw, dict):
        return AllocatorSettings()
    conf = str(raw.get("PYTORCH_CUDA_ALLOC_CONF", "") or "")
    max_split = int(raw.get("max_split_size", -1) or -1)
    divisions = raw.get("roundup_power2_divisions") or {}
    if isinstance(divisions, dict):
        divisions = [int(v) for _, v in sorted(divisions.items(), key=lambda kv: int(kv[0]))]
    backend = "cudaMallocAsync" if "cudamallocasync" in conf.lower().replace(" ", "") else "native"
    return AllocatorSettings(
        conf=conf,
        max_split_size=max_split if 0 < max_split < (1 << 62) else None,
        expandable_segments=bool(raw.get("expandable_segments", False)),
        garbage_collection_threshold=float(raw.get("garbage_collection_threshold", 0.0) or 0.0),
        roundup_power2_divisions=tuple(int(d) for d in divisions),
        backend=backend,
    )
