"""What the analysis finds: plain dataclasses that every renderer (console, JSON, plot) reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from memprof.analysis.peak_detail import PeakDetail
from memprof.analysis.replay import PoolState
from memprof.trace.model import Frame


@dataclass(slots=True)
class SiteUsage:
    """Bytes live at a moment that came from one allocation site."""

    label: str
    user: Frame | None
    call: Frame | None
    bytes: int
    count: int
    share: float


@dataclass(slots=True)
class ModuleUsage:
    """Bytes live at a moment that the nn.Module at ``module`` (a path) allocated."""

    module: str
    bytes: int
    count: int
    share: float
    frame: Frame | None  # the model-code line that allocated most of them
    # the module lists' elements it sums (``layers.*.mlp``: one per layer); 1 for a module
    instances: int = 1


@dataclass(slots=True)
class Live:
    """What was allocated at one moment, by category, by site and by module (where known)."""

    allocated_bytes: int
    categories: dict[str, int]
    sites: list[SiteUsage]
    modules: list[ModuleUsage] = field(default_factory=list)
    # the same, summed over the elements of module lists (``layers.*.mlp``), where a
    # pattern has at least two: what a repeated block holds in all
    repeated_modules: list[ModuleUsage] = field(default_factory=list)
    # bytes by category that the elements of module lists held (``blocks.3``,
    # ``transformer.h.0``: the repeated blocks); empty where modules are unknown
    in_blocks: dict[str, int] = field(default_factory=dict)
    # the bytes the tensors asked for, by category (``categories`` counts the allocator's
    # blocks: rounded up to 512 bytes, some left unsplit); a block allocated before the
    # trace's window counts its block size
    requested: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Fragmentation:
    """Reserved-but-unallocated memory: cached by the allocator, unusable by others."""

    unallocated_at_peak_bytes: int
    largest_free_block_at_peak_bytes: int
    unallocated_at_end_bytes: int
    largest_free_block_at_end_bytes: int
    free_blocks_at_end: int
    pools_at_peak: list[PoolState]
    pools_at_end: list[PoolState]


@dataclass(slots=True)
class Oom:
    """An out-of-memory event and why it happened."""

    event_index: int
    time_us: int | None
    requested_bytes: int  # the rounded request the allocator could not place
    device_alloc_bytes: int  # what it tried to obtain from the device ("Tried to allocate")
    device_free_bytes: int  # free on the device, by cudaMemGetInfo, at the OOM
    allocated_bytes: int
    reserved_bytes: int
    cached_free_bytes: int
    largest_free_block_bytes: int
    # decided by replaying the trace to this request under expandable segments with the
    # same memory: "fragmentation" if it then fits, else "shortage"
    kind: str
    live: Live
    limit_bytes: int = 0  # what PyTorch could reserve: reserved + free on the device
    expandable_reserved_bytes: int = 0  # reserved before the request, expandable segments
    short_bytes: int = 0  # a shortage's bytes missing even without fragmentation


@dataclass(slots=True)
class ReplaySummary:
    """The allocator replay checked against the recording."""

    modelled: bool
    note: str
    decisions_matched: int = 0
    decisions_total: int = 0
    segments_predicted: int = 0
    segments_recorded: int = 0
    addresses_matched: int = 0
    addresses_total: int = 0
    reserved_bytes_predicted_peak: int = 0
    reserved_bytes_recorded_peak: int = 0
    final_reserved_predicted_bytes: int = 0
    final_reserved_recorded_bytes: int = 0
    final_allocated_predicted_bytes: int = 0
    final_allocated_recorded_bytes: int = 0
    inconsistencies: int = 0
    what_if: list[WhatIf] = field(default_factory=list)


@dataclass(slots=True)
class WhatIf:
    """The same trace replayed under other allocator settings."""

    settings: str
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    saved_bytes: int  # against the recorded settings in the same simulation
    device_memory_bytes: int | None = None  # the cap on reserved memory, if one was given
    oom_event_index: int | None = None  # where it ran out of that memory (-1: at the start)
    oom_requested_bytes: int | None = None


@dataclass(slots=True)
class Timeline:
    """Allocated and reserved bytes after each event, with the state before the first."""

    allocated: np.ndarray
    reserved: np.ndarray
    time_us: np.ndarray | None


@dataclass(frozen=True, slots=True)
class StepPeak:
    """One optimizer step: events ``[start, end)``, its peak, what stayed allocated after it."""

    step: int
    start: int
    end: int
    peak_allocated_bytes: int
    end_allocated_bytes: int


LEAK = "leak"  # memory left after each step grows steadily through the last steps
BOUNDED = "bounded"  # it grew after warm-up, then stopped (optimizer history, a filled cache)
NO_GROWTH = "none"
TOO_FEW_STEPS = "too_few_steps"  # not enough steps (or uneven growth) to tell
NO_STEPS = "no_steps"  # no optimizer step was recorded


@dataclass(frozen=True, slots=True)
class StepGrowth:
    """The verdict on the memory left allocated after each optimizer step."""

    verdict: str  # LEAK, BOUNDED, NO_GROWTH, TOO_FEW_STEPS or NO_STEPS
    steps: int  # steps recorded
    steps_needed: int  # steps a verdict needs (more than ``steps`` for TOO_FEW_STEPS)
    growth_bytes: int = 0  # most the memory left after a step rose after warm-up (state aside)
    growth_per_step_bytes: int = 0  # LEAK: the mean growth over the last steps
    grew_until_step: int | None = None  # BOUNDED: the last step after which memory rose
    optimizer_state_growth_bytes: int = 0  # how much optimizer state rose after warm-up


@dataclass(frozen=True, slots=True)
class Leak:
    """Allocated memory that grew after every step, and the site that grew most."""

    growth_per_step_bytes: int
    steps: int
    site: SiteUsage | None
    site_growth_bytes: int


@dataclass(frozen=True, slots=True)
class Tagged:
    """Bytes of tagged activations live at two moments."""

    at_peak_bytes: int
    at_activations_peak_bytes: int


@dataclass(slots=True)
class DeviceFindings:
    """Everything memprof says about one device."""

    device: int
    events: int
    first_time_us: int | None
    last_time_us: int | None
    blocks_before_window: int
    bytes_before_window: int
    events_dropped: int  # by memprof's own ring buffer (its recorders keep live allocations)
    # the whole recording's peak where memprof's recorder counted it (Snapshot.run_peak)
    run_peak: dict[str, int | None] | None
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    reserved_at_peak_bytes: int
    peak_event_index: int  # -1: the state before the first recorded event
    peak_time_us: int | None
    end_allocated_bytes: int
    end_reserved_bytes: int
    at_peak: Live
    categories_inferred: bool
    fragmentation: Fragmentation
    ooms: list[Oom]  # the first MAX_OOMS of ``oom_events``
    replay: ReplaySummary
    timeline: Timeline
    steps: list[StepPeak] = field(default_factory=list)
    leak: Leak | None = None  # set when step_growth's verdict is LEAK
    step_growth: StepGrowth = StepGrowth(NO_STEPS, 0, 0)
    oom_events: int = 0
    rank: int | None = None  # the process under torchrun, for a run folder of several
    # allocated bytes per category after each event (state before the first included);
    # only where categories are exact
    category_timeline: dict[str, np.ndarray] | None = None
    # bytes of each tag (``TAGS``) live at the peak and when the activations peaked
    tagged: dict[str, Tagged] | None = None
    # every block live at the peak by category, module and site, and the segments' map
    peak_detail: PeakDetail | None = None

    def peak_before_window(self) -> tuple[int, int | None, bool] | None:
        """Where the ring buffer dropped events and the run held more before the kept ones:
        its peak allocated bytes, its peak reserved bytes (None: not counted) and whether
        the allocated figure is exact (else a lower bound: the storages' own bytes)."""
        peak = self.run_peak
        if not self.events_dropped or not peak:
            return None
        exact = peak["allocated_bytes"] is not None
        allocated = peak["allocated_bytes"] if exact else peak["requested_bytes"]
        if allocated is None or allocated <= self.peak_allocated_bytes:
            return None
        return allocated, peak["reserved_bytes"], exact


@dataclass(slots=True)
class Findings:
    """The analysis of one snapshot."""

    source: str
    format: str
    allocator_conf: str
    devices: list[DeviceFindings]
