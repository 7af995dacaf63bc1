"""The typed snapshot model: everything past ``memprof.trace`` reads these, never raw dicts.

Trace events are columnar (numpy arrays) because real traces hold millions of events;
their stack frames are converted to :class:`Frame` tuples only when asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np


class Action(IntEnum):
    """Trace actions, as codes for the event arrays."""

    ALLOC = 0
    FREE_REQUESTED = 1
    FREE_COMPLETED = 2
    SEGMENT_ALLOC = 3
    SEGMENT_FREE = 4
    SEGMENT_MAP = 5
    SEGMENT_UNMAP = 6
    OOM = 7
    SNAPSHOT = 8
    OTHER = 9


ACTION_CODES: dict[str, Action] = {a.name.lower(): a for a in Action if a is not Action.OTHER}

# What an allocation holds; the order breaks ties (a parameter saved for backward is a parameter).
PARAMETERS = "parameters"
BUFFERS = "buffers"  # module buffers: causal masks, positional tables, BatchNorm statistics
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer_state"
# a distributed run's collective buffers: parameters FSDP gathered, gradients waiting to be
# reduce-scattered, DDP's buckets (``analysis/categories.communication_overrides``)
COMMUNICATION = "communication"
ACTIVATIONS = "activations"
TEMPORARIES = "temporaries"
WORKSPACE = "workspace"  # a library's own buffers (cuBLAS workspaces): exact on a virtual GPU
OTHER = "other"
CATEGORIES = (PARAMETERS, BUFFERS, GRADIENTS, OPTIMIZER_STATE, COMMUNICATION, ACTIVATIONS,
              TEMPORARIES, WORKSPACE, OTHER)
# what a collective's own code made is a communication buffer unless the script's tensors
# hold it otherwise (a sharded parameter, a reduce-scattered gradient): the categories it
# gives up; parameters FSDP gathered are the module's parameters while they are gathered,
# and give those up too
COMMUNICATION_OVERRIDES = (ACTIVATIONS, TEMPORARIES, OTHER)
GATHERED_OVERRIDES = (PARAMETERS, *COMMUNICATION_OVERRIDES)
# run.model.parallelism's strategies that shard within a group and replicate across groups
# (FSDP1's HYBRID_SHARD)
HYBRID_STRATEGIES = ("fsdp1:hybrid_shard", "fsdp1:_hybrid_shard_zero2")
# what some activations were, for savings models: quadratic attention scores saved for
# backward, and tensors saved by forwards in eval mode that no backward ever used
ATTENTION_SCORES = "attention_scores"
EVAL_ACTIVATIONS = "eval_activations"
LOSS_LOGITS = "loss_logits"  # the log-probabilities a cross-entropy over a vocabulary saves
# an fp32 activation CUDA autocast would make, or save a copy of, in half precision, and a
# temporary it would make in half precision
AUTOCAST_HALF = "autocast_half"
AUTOCAST_HALF_TEMPORARY = "autocast_half_temporary"
TAGS = (ATTENTION_SCORES, EVAL_ACTIVATIONS, LOSS_LOGITS, AUTOCAST_HALF,
        AUTOCAST_HALF_TEMPORARY)


@dataclass(frozen=True, slots=True)
class Frame:
    """One stack frame; ``line`` is 0 for C++ frames."""

    filename: str
    line: int
    name: str

    @property
    def is_python(self) -> bool:
        """A Python frame (a file's, or code run from a string: ``-c``, ``exec``), not C++."""
        return self.filename.endswith(".py") or self.filename == "<string>"


Frames = tuple[Frame, ...]


@dataclass(slots=True)
class Block:
    """A block of a segment at the end of the recording."""

    address: int
    size: int
    requested_size: int
    state: str
    frames: Frames = ()

    @property
    def allocated(self) -> bool:
        """Held by a tensor (what the allocated stat counts)."""
        return self.state == "active_allocated"

    @property
    def occupied(self) -> bool:
        """Not reusable: allocated, or freed but waiting for the stream to finish with it."""
        return self.state != "inactive"


@dataclass(slots=True)
class Segment:
    """A region obtained from the device (cudaMalloc, or an expandable mapping)."""

    device: int
    address: int
    total_size: int
    allocated_size: int
    active_size: int
    requested_size: int
    stream: int
    segment_type: str
    pool_id: tuple[int, int]
    is_expandable: bool
    blocks: list[Block]
    frames: Frames = ()

    @property
    def is_small(self) -> bool:
        return self.segment_type == "small"


@dataclass(frozen=True, slots=True)
class AllocatorSettings:
    """The caching allocator's configuration, as recorded in the snapshot or overridden."""

    conf: str = ""
    max_split_size: int | None = None
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0
    roundup_power2_divisions: tuple[int, ...] = ()
    backend: str = "native"


@dataclass(slots=True)
class DeviceTrace:
    """One device's trace as parallel arrays, oldest event first."""

    device: int
    action: np.ndarray  # int8 Action codes
    addr: np.ndarray  # int64; for oom: 0
    size: np.ndarray  # int64; requested size for alloc/free, segment size for segment actions
    stream: np.ndarray  # int64
    time_us: np.ndarray | None  # int64, absent before PyTorch 2.2
    device_free: dict[int, int]  # oom event index -> device free bytes
    _frames: Sequence[object] = field(repr=False)
    _convert: Callable[[object], Frames] = field(repr=False)

    def __len__(self) -> int:
        return len(self.action)

    def frames(self, index: int) -> Frames:
        """The stack of event ``index``, innermost first."""
        return self._convert(self._frames[index])


@dataclass(slots=True)
class Snapshot:
    """A whole snapshot: final segments, per-device traces and allocator settings."""

    segments: list[Segment]
    traces: dict[int, DeviceTrace]
    settings: AllocatorSettings
    format: str
    labels: dict[int, dict[int, str]] = field(default_factory=dict)
    steps: dict[int, list[int]] = field(default_factory=dict)
    # memprof run's attribution: alloc event index -> module path, per device
    modules: dict[int, dict[int, str]] = field(default_factory=dict)
    model_files: frozenset[str] = frozenset()  # files defining those modules' forward
    tags: dict[int, dict[int, str]] = field(default_factory=dict)  # alloc event -> TAGS entry
    dropped: dict[int, int] = field(default_factory=dict)  # events memprof's ring buffer dropped
    # the most bytes held over the whole recording, dropped events included (memprof's
    # recorders): requested_bytes, and allocated_bytes / reserved_bytes where known
    run_peak: dict[int, dict[str, int | None]] = field(default_factory=dict)
    # private-pool segments by address, those freed before the end too (a prediction's)
    segment_pools: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)
    # the most the process may reserve (set_per_process_memory_fraction), where it was capped
    allowed: dict[int, int] = field(default_factory=dict)

    @property
    def devices(self) -> list[int]:
        """Devices with a segment or a recorded event."""
        seen = {s.device for s in self.segments}
        seen.update(d for d, t in self.traces.items() if len(t))
        return sorted(seen)

    def segments_of(self, device: int) -> list[Segment]:
        return [s for s in self.segments if s.device == device]
