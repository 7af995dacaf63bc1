"""Explain a snapshot: peak, what was live and from where, fragmentation, OOMs, replay check."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import numpy as np

from memprof.analysis.allocator import CachingAllocator
from memprof.analysis.categories import CATEGORIES, Phase, infer_category, phase_of
from memprof.analysis.findings import (
    LEAK,
    DeviceFindings,
    Findings,
    Fragmentation,
    Leak,
    Live,
    ModuleUsage,
    Oom,
    ReplaySummary,
    SiteUsage,
    StepGrowth,
    StepPeak,
    Tagged,
    Timeline,
)
from memprof.analysis.intervals import Intervals, intervals
from memprof.analysis.modules import in_block, model_frame, rank_modules, rank_repeated
from memprof.analysis.peak_detail import PeakDetail, Row, peak_detail
from memprof.analysis.replay import Check, Moment, Replay, replay
from memprof.analysis.settings import unmodelled
from memprof.analysis.sites import Site, site_of
from memprof.analysis.steps import WARMUP_STEPS, step_growth, step_peaks
from memprof.analysis.tally import Tally
from memprof.analysis.whatif import unfragmented, what_if
from memprof.analysis.window_start import segments_after
from memprof.errors import MemprofError
from memprof.trace.model import (
    ACTIVATIONS,
    OPTIMIZER_STATE,
    OTHER,
    TAGS,
    Action,
    AllocatorSettings,
    DeviceTrace,
    Frames,
    Segment,
    Snapshot,
)

BEFORE_WINDOW = Site(None, None, "allocated before the recorded window")
T = TypeVar("T")


def explain(snapshot: Snapshot, source: str = "", devices: Sequence[int] | None = None,
            top: int = 10, what_ifs: Sequence[AllocatorSettings] = (),
            rank: int | None = None, device_memory: int | None = None,
            placed: dict[int, Tally] | None = None) -> Findings:
    """Analyse every device of ``snapshot`` (or those in ``devices``).

    ``what_ifs`` replay each trace under other allocator settings; ``device_memory``
    replays it (as recorded and under each what-if) on a device of that many bytes.
    ``placed``: the ``Tally`` of a device's trace that memprof placed itself, whose replay
    is the placement's own.
    """
    chosen = snapshot.devices if devices is None else [d for d in snapshot.devices if d in devices]
    segments: dict[int, list[Segment]] = {}
    for s in snapshot.segments:
        segments.setdefault(s.device, []).append(s)
    found = []
    for d in chosen:
        try:
            found.append(_device(snapshot, d, segments.get(d, []), top, what_ifs, device_memory,
                                 (placed or {}).get(d)))
        except (KeyError, IndexError, ValueError, AssertionError) as exc:
            # a well-formed file whose trace contradicts itself (or its final segments) in a
            # way the replay cannot follow: one line, not a traceback
            raise MemprofError(f"{source or 'snapshot'}: device {d}: the trace contradicts"
                               f" itself or the final segments ({type(exc).__name__} in the"
                               " allocator replay); memprof cannot explain it") from None
    for d in found:
        d.rank = rank
    return Findings(source=source, format=snapshot.format,
                    allocator_conf=snapshot.settings.conf, devices=found)


def merge_ranks(source: str, per_rank: Sequence[Findings]) -> Findings:
    """One report of the ranks of a distributed run (each rank's devices, tagged)."""
    first = per_rank[0]
    return Findings(source=source, format=first.format, allocator_conf=first.allocator_conf,
                    devices=[d for f in per_rank for d in f.devices])


def _device(snapshot: Snapshot, device: int, segments: list[Segment], top: int,
            what_ifs: Sequence[AllocatorSettings], device_memory: int | None,
            tally: Tally | None = None) -> DeviceFindings:
    trace = snapshot.traces.get(device)
    if tally is not None and trace is not None and tally.events == len(trace):
        result = tally.replay(device)
    else:  # an unmodelled backend gets the native rules for the timeline; the summary says so
        result = replay(trace, segments, replace(snapshot.settings, backend="native"),
                        snapshot.segment_pools.get(device))
    table = intervals(trace, result)
    n = 0 if trace is None else len(trace)

    allocated, reserved = result.allocated, result.reserved
    peak = int(np.argmax(allocated)) - 1
    labels = snapshot.labels.get(device)
    describe = _Describer(snapshot, device, table, result, labels, top)
    peaks = step_peaks(allocated, snapshot.steps.get(device, []))
    categories = None if labels is None else _timelines(table, labels, CATEGORIES, n)
    growth = _growth(peaks, categories, int(allocated[peak + 1]))
    times = trace.time_us if trace is not None else None
    before = table.size[table.start < 0]
    return DeviceFindings(
        device=device,
        events=n,
        first_time_us=int(times[0]) if times is not None and n else None,
        last_time_us=int(times[-1]) if times is not None and n else None,
        blocks_before_window=len(before),
        bytes_before_window=int(before.sum()),
        events_dropped=snapshot.dropped.get(device, 0),
        run_peak=snapshot.run_peak.get(device),
        peak_allocated_bytes=int(allocated[peak + 1]),
        peak_reserved_bytes=int(reserved.max()),
        reserved_at_peak_bytes=int(reserved[peak + 1]),
        peak_event_index=peak,
        peak_time_us=int(times[peak]) if times is not None and peak >= 0 else None,
        end_allocated_bytes=int(allocated[-1]),
        end_reserved_bytes=int(reserved[-1]),
        at_peak=describe.live(peak),
        categories_inferred=labels is None,
        fragmentation=_fragmentation(result.peak, result.final),
        ooms=[_oom(describe, m, trace, result, snapshot.settings, snapshot.allowed.get(device))
              for m in result.ooms],
        replay=_replay_summary(snapshot, result, segments, reserved, what_ifs, trace,
                               device_memory),
        timeline=Timeline(allocated, reserved, times),
        steps=peaks,
        leak=_leak(describe, peaks, growth),
        step_growth=growth,
        oom_events=result.oom_events,
        category_timeline=categories,
        tagged=_tagged(table, snapshot.tags.get(device), categories, peak, n),
        peak_detail=describe.detail(peak, segments_after(segments, trace, peak)),
    )


def _growth(peaks: list[StepPeak], categories: dict[str, np.ndarray] | None,
            peak_allocated: int) -> StepGrowth:
    state = None if categories is None else \
        [int(categories[OPTIMIZER_STATE][p.end]) for p in peaks]
    return step_growth([p.end_allocated_bytes for p in peaks], peak_allocated, state)


def _leak(describe: _Describer, peaks: list[StepPeak], growth: StepGrowth) -> Leak | None:
    """The site that grew most from the first step after warm-up to the last."""
    if growth.verdict != LEAK:
        return None
    every_site = 1 << 30
    first = describe.live(peaks[WARMUP_STEPS].end - 1, every_site)
    last = describe.live(peaks[-1].end - 1, every_site)
    before = {s.label: s.bytes for s in first.sites}
    size, site = max(((s.bytes - before.get(s.label, 0), s) for s in last.sites),
                     key=lambda g: g[0], default=(0, None))
    return Leak(growth.growth_per_step_bytes, growth.steps - WARMUP_STEPS - 1, site, size)


def _tagged(table: Intervals, tags: dict[int, str] | None,
            categories: dict[str, np.ndarray] | None, peak: int, n: int
            ) -> dict[str, Tagged] | None:
    """Bytes of each tag at the peak and where the activations peaked (exact labels only)."""
    if not tags or categories is None:
        return None
    at_activations = int(np.argmax(categories[ACTIVATIONS]))
    return {tag: Tagged(int(line[peak + 1]), int(line[at_activations]))
            for tag, line in _timelines(table, tags, TAGS, n).items()}


def _timelines(table: Intervals, labels: dict[int, str], names: Sequence[str], n: int
               ) -> dict[str, np.ndarray]:
    """Allocated bytes of each of ``names`` after each event (the state before the first
    included), from exact labels or tags."""
    code = {name: i for i, name in enumerate(names)}
    of = np.fromiter((code.get(labels.get(e, OTHER), -1) if e >= 0 else code.get(OTHER, -1)
                      for e in table.event.tolist()), np.int16, len(table.event))
    out = {}
    for i, name in enumerate(names):
        mine = of == i
        if not mine.any():  # zeros from calloc: no memory until written
            out[name] = np.zeros(n + 1, np.int64)
            continue
        delta = np.zeros(n + 2, np.int64)
        np.add.at(delta, table.start[mine] + 1, table.size[mine])
        np.add.at(delta, table.end[mine] + 1, -table.size[mine])
        out[name] = np.cumsum(delta[: n + 1], out=delta[: n + 1])
    return out


class _Describer:
    """Turns a set of live rows into categories and sites."""

    def __init__(self, snapshot: Snapshot, device: int, table: Intervals, result: Replay,
                 labels: dict[int, str] | None, top: int) -> None:
        self.trace = snapshot.traces.get(device)
        self.table = table
        self.result = result
        self.labels = labels
        self.modules = snapshot.modules.get(device)
        self.model_files = snapshot.model_files
        self.top = top
        self.n = 0 if self.trace is None else len(self.trace)
        self.python_stacks = self._has_python_stacks()
        # per distinct stack (holding it keeps its id unique): a file may give a million
        # blocks one long shared stack, and walking it for each would take minutes
        self._per_stack: dict[tuple, tuple[Frames, object]] = {}

    def live(self, index: int, top: int | None = None) -> Live:
        rows = self.table.live_at(index)
        sizes = rows.size.tolist()
        events, ends = rows.event.tolist(), rows.end.tolist()
        frames = [self._frames(e, i) for e, i in zip(events, rows.initial.tolist(), strict=True)]
        categories = dict.fromkeys(CATEGORIES, 0)
        requested = dict.fromkeys(CATEGORIES, 0)
        in_blocks = dict.fromkeys(CATEGORIES, 0) if self.modules else {}
        paths = self.modules or {}
        asked = self.trace.size if self.trace is not None else None  # an alloc's: requested
        for event, end, size, stack in zip(events, ends, sizes, frames, strict=True):
            category = self._category(event, end, stack)
            categories[category] += size
            requested[category] += int(asked[event]) if event >= 0 and asked is not None \
                else size
            path = paths.get(event)
            if path is not None and in_block(path):
                in_blocks[category] += size
        total = sum(sizes)
        groups: dict[str, list] = {}
        for size, stack, event in zip(sizes, frames, events, strict=True):
            site = self._site(event, stack)
            g = groups.setdefault(site.label, [site, 0, 0])
            g[1] += size
            g[2] += 1
        ranked = sorted(groups.items(), key=lambda kv: (-kv[1][1], kv[0]))[: top or self.top]
        sites = [SiteUsage(label, s.user, s.call, b, c, b / total if total else 0.0)
                 for label, (s, b, c) in ranked]
        modules, repeated = self._modules(events, sizes, frames, total, top)
        return Live(total, categories, sites, modules, repeated, in_blocks, requested)

    def detail(self, index: int, segments: dict[int, tuple[int, int, tuple[int, int], bool,
                                                          bool]]) -> PeakDetail:
        """Every block live after event ``index`` by category, module and site, and placed in
        ``segments`` (those after ``index``)."""
        rows = self.table.live_at(index)
        paths = self.modules or {}
        addrs = self.trace.addr if self.trace is not None else None
        out = []
        for event, end, size, initial in zip(rows.event.tolist(), rows.end.tolist(),
                                              rows.size.tolist(), rows.initial.tolist(),
                                              strict=True):
            stack = self._frames(event, initial)
            address = int(addrs[event]) if event >= 0 and addrs is not None else \
                self.result.initial[initial].addr
            out.append(Row(address, size, self._category(event, end, stack), paths.get(event),
                           self._site(event, stack).label))
        return peak_detail(out, segments)

    def _site(self, event: int, stack: Frames) -> Site:
        return self._once("site", stack, site_of) if stack or event >= 0 else BEFORE_WINDOW

    def _modules(self, events: list[int], sizes: list[int], frames: list[Frames], total: int,
                 top: int | None) -> tuple[list[ModuleUsage], list[ModuleUsage]]:
        """The top modules, and the top patterns of repeated blocks (``rank_repeated``)."""
        if not self.modules:
            return [], []
        paths = self.modules
        rows = ((paths[e], size, self._once("model frame", stack,
                                            lambda f: model_frame(f, self.model_files)))
                for e, size, stack in zip(events, sizes, frames, strict=True) if e in paths)
        rows = list(rows)
        return (rank_modules(rows, total, top or self.top),
                rank_repeated(rows, total, top or self.top))

    def _frames(self, event: int, initial: int) -> Frames:
        if event >= 0 and self.trace is not None:
            return self.trace.frames(event)
        return self.result.initial[initial].frames if initial >= 0 else ()

    def _category(self, event: int, end: int, stack: Frames) -> str:
        if self.labels is not None:
            return self.labels.get(event, OTHER)
        alloc_phase = self._phase(stack) if event >= 0 else Phase.UNKNOWN
        free_phase = None
        if end < self.n and self.trace is not None:
            free_phase = self._phase(self.trace.frames(end))
        return self._once(("category", alloc_phase, free_phase), stack,
                          lambda f: infer_category(f, alloc_phase, free_phase))

    def _phase(self, stack: Frames) -> Phase:
        return self._once("phase", stack, lambda f: phase_of(f, self.python_stacks))

    def _once(self, what: object, stack: Frames, compute: Callable[[Frames], T]) -> T:
        """``compute(stack)``, once per distinct stack object and ``what``."""
        key = (what, id(stack))
        cached = self._per_stack.get(key)
        if cached is None:
            cached = self._per_stack[key] = (stack, compute(stack))
        return cached[1]  # type: ignore[return-value]

    def _has_python_stacks(self) -> bool:
        if self.trace is None:
            return False
        allocs = np.flatnonzero(self.trace.action == Action.ALLOC)[:200]
        return any(f.is_python for i in allocs.tolist() for f in self.trace.frames(i))


def _fragmentation(peak: Moment, final: Moment) -> Fragmentation:
    return Fragmentation(
        unallocated_at_peak_bytes=peak.reserved - peak.allocated,
        largest_free_block_at_peak_bytes=peak.free.largest_block,
        unallocated_at_end_bytes=final.reserved - final.allocated,
        largest_free_block_at_end_bytes=final.free.largest_block,
        free_blocks_at_end=final.free.blocks,
        pools_at_peak=peak.pools,
        pools_at_end=final.pools,
    )


def _oom(describe: _Describer, moment: Moment, trace: DeviceTrace, result: Replay,
         settings: AllocatorSettings, allowed: int | None) -> Oom:
    i = moment.index
    requested = int(trace.size[i])
    # what the card had free, or less where the process was capped (a memory fraction)
    limit = moment.reserved + trace.device_free.get(i, 0)
    limit = limit if allowed is None else min(limit, allowed)
    fits, expandable_reserved, short = unfragmented(trace, result, settings, i, limit)
    return Oom(
        event_index=i,
        time_us=int(trace.time_us[i]) if trace.time_us is not None else None,
        requested_bytes=requested,
        device_alloc_bytes=CachingAllocator.segment_size(requested),
        device_free_bytes=trace.device_free.get(i, 0),
        allocated_bytes=moment.allocated,
        reserved_bytes=moment.reserved,
        cached_free_bytes=moment.free.free_bytes,
        largest_free_block_bytes=moment.free.largest_block,
        kind="fragmentation" if fits else "shortage",
        live=describe.live(i),
        limit_bytes=limit,
        expandable_reserved_bytes=expandable_reserved,
        short_bytes=short,
    )


def _verdict(c: Check) -> str:
    """What the replay check proved, in words: all reproduced only when every address was."""
    wrong = []
    if c.decisions_matched != c.decisions_total:
        wrong.append(f"{c.decisions_total - c.decisions_matched:,} decisions differ, the first"
                     f" at event {c.first_mismatch}")
    if c.addresses_matched != c.addresses_total:
        wrong.append(f"{c.addresses_total - c.addresses_matched:,} block addresses differ, the"
                     f" first at event {c.first_address_mismatch}")
    if c.inconsistencies:
        wrong.append(f"{c.inconsistencies:,} events could not be placed")
    return "; ".join(wrong) or "every decision and block address reproduced"


def _replay_summary(snapshot: Snapshot, result: Replay, segments: list[Segment],
                    reserved: np.ndarray, what_ifs: Sequence[AllocatorSettings],
                    trace: DeviceTrace | None, device_memory: int | None) -> ReplaySummary:
    settings = snapshot.settings
    final_reserved = sum(s.total_size for s in segments)
    final_allocated = sum(s.allocated_size for s in segments)
    notes = unmodelled(settings)
    c = result.check
    predicted = result.reserved_predicted
    dropped = sum(snapshot.dropped.values())
    summary = ReplaySummary(
        modelled=not notes,
        note="; ".join(notes) or _verdict(c) + (
            f"; the trace lost its {dropped:,} oldest events (a ring buffer), so the replay"
            " starts without the segments they made" if dropped else ""),
        decisions_matched=c.decisions_matched,
        decisions_total=c.decisions_total,
        segments_predicted=c.segments_predicted,
        segments_recorded=c.segments_recorded,
        addresses_matched=c.addresses_matched,
        addresses_total=c.addresses_total,
        reserved_bytes_predicted_peak=int(predicted.max()),
        reserved_bytes_recorded_peak=int(reserved.max()),
        final_reserved_predicted_bytes=result.final.reserved,
        final_reserved_recorded_bytes=final_reserved,
        final_allocated_predicted_bytes=result.final.allocated,
        final_allocated_recorded_bytes=final_allocated,
        inconsistencies=c.inconsistencies,
    )
    if trace is not None and len(trace) and (what_ifs or device_memory) and not notes:
        base = what_if(trace, result, settings)
        runs = [*([settings] if device_memory else []), *what_ifs]
        summary.what_if = [what_if(trace, result, s, base, device_memory) for s in runs]
    return summary
