"""A report.json read back (``check``, ``suggest``): every field its readers use checked
against the schema once, at the edge, so that nothing past it meets a wrong type, a number
no device has, or a missing key.

A report is a file anyone can hand over, like a snapshot. Fields the readers do not use
may hold anything; the ones they do must be what ``memprof run`` and ``explain`` write
(``docs/report-schema.md``), or the report is refused with the first field that is not.

    problem = first_problem(data)   # None, or "devices[0].peak.allocated_bytes is 'x', ..."
"""

from __future__ import annotations

import keyword
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from memprof.trace.fields import MAX_BYTES, MAX_ID, describe

MAX_TIME = 1 << 62  # microseconds and counts: far beyond any clock
MAX_ITEMS = 1 << 20  # entries of one list or table: a report holds a few hundred


class _Refused(ValueError):
    """A field that is not what the schema says; its message names the field."""


Check = Callable[[Any, str], None]


def _fail(where: str, value: Any, expected: str) -> None:
    raise _Refused(f"{where} is {describe(value)}, expected {expected}")


def _integer(low: int, high: int, what: str) -> Check:
    def check(value: Any, where: str) -> None:
        if type(value) is not int or not low <= value < high:
            _fail(where, value, what)
    return check


def _number(low: float, high: float) -> Check:
    def check(value: Any, where: str) -> None:
        if type(value) not in (int, float) or not math.isfinite(value) \
                or not low <= value <= high:
            _fail(where, value, f"a number in [{low:g}, {high:g}]")
    return check


def _kind(kind: type, what: str) -> Check:
    def check(value: Any, where: str) -> None:
        if type(value) is not kind:
            _fail(where, value, what)
    return check


BYTES = _integer(0, MAX_BYTES + 1, "a byte count up to 16 TiB")
COUNT = _integer(0, MAX_ID, "a count")
INDEX = _integer(-1, MAX_ID, "an event index")
TIME = _integer(0, MAX_TIME, "a time in microseconds")
SHARE = _number(0, 1e6)
SECONDS = _number(0, 1e9)
TEXT = _kind(str, "a string")
FLAG = _kind(bool, "true or false")


def IDENTIFIER(value: Any, where: str) -> None:
    """A Python name (an argument's, shown in a snippet)."""
    if type(value) is not str or not value.isidentifier() or keyword.iskeyword(value):
        _fail(where, value, "a Python name")


def ANY(value: Any, where: str) -> None:
    """A field no reader uses beyond showing it."""


def optional(check: Check) -> Check:
    """``check``, or null."""
    def inner(value: Any, where: str) -> None:
        if value is not None:
            check(value, where)
    return inner


def items(check: Check) -> Check:
    """A list whose every item passes ``check``."""
    def inner(value: Any, where: str) -> None:
        if type(value) is not list or len(value) > MAX_ITEMS:
            _fail(where, value, "a list")
        for i, item in enumerate(value):
            check(item, f"{where}[{i}]")
    return inner


def table(check: Check) -> Check:
    """An object of names to values that pass ``check`` (categories, dtypes)."""
    def inner(value: Any, where: str) -> None:
        if type(value) is not dict or len(value) > MAX_ITEMS:
            _fail(where, value, "an object")
        for key, item in value.items():
            check(item, f"{where}.{key}")
    return inner


@dataclass(frozen=True)
class Record:
    """An object with these fields (others may be present and are not read); ``required``
    ones must be there, the rest may be missing."""

    fields: Mapping[str, Check]
    required: frozenset[str] = field(default_factory=frozenset)

    def __call__(self, value: Any, where: str) -> None:
        if type(value) is not dict:
            _fail(where, value, "an object")
        for name in self.required:
            if name not in value:
                raise _Refused(f"{where}.{name} is missing")
        for name, check in self.fields.items():
            if name in value:
                check(value[name], f"{where}.{name}")


def record(required: tuple[str, ...] = (), **fields: Check) -> Record:
    """A :class:`Record` of ``fields``, ``required`` among them."""
    return Record(fields, frozenset(required))


SITE = record(site=TEXT, file=optional(TEXT), line=optional(COUNT), function=optional(TEXT),
              call=optional(TEXT), bytes=BYTES, count=COUNT, share=SHARE)
MODULE = record(module=TEXT, bytes=BYTES, count=COUNT, share=SHARE, frame=optional(TEXT))
LIVE = record(allocated_bytes=BYTES, categories=table(BYTES), top_sites=items(SITE),
              top_modules=items(MODULE))
OOM = record(event_index=INDEX, time_us=optional(TIME), requested_bytes=BYTES,
             device_alloc_bytes=BYTES, device_free_bytes=BYTES, allocated_bytes=BYTES,
             reserved_bytes=BYTES, cached_free_bytes=BYTES, largest_free_block_bytes=BYTES,
             kind=TEXT, live=LIVE, limit_bytes=BYTES, expandable_reserved_bytes=BYTES,
             short_bytes=BYTES)
POOL = record(pool=TEXT, stream=COUNT, segments=COUNT, reserved_bytes=BYTES,
              allocated_bytes=BYTES)
PEAK = record(("allocated_bytes", "reserved_bytes"), allocated_bytes=BYTES,
              reserved_bytes=BYTES, reserved_at_peak_bytes=BYTES, event_index=INDEX,
              time_us=optional(TIME))
DEVICE = record(
    ("device", "peak"),
    device=COUNT, rank=optional(COUNT), events=COUNT,
    window=record(first_time_us=optional(TIME), last_time_us=optional(TIME),
                  blocks_before_window=COUNT, bytes_before_window=BYTES,
                  events_dropped=COUNT,
                  run_peak=optional(record(requested_bytes=optional(BYTES),
                                           allocated_bytes=optional(BYTES),
                                           reserved_bytes=optional(BYTES)))),
    peak=PEAK,
    end=record(allocated_bytes=BYTES, reserved_bytes=BYTES),
    categories=table(BYTES), categories_inferred=FLAG,
    categories_in_blocks=optional(table(BYTES)),
    categories_requested=optional(table(BYTES)), category_peaks=optional(table(BYTES)),
    tagged=optional(table(record(("at_peak_bytes", "at_activations_peak_bytes"),
                                 at_peak_bytes=BYTES, at_activations_peak_bytes=BYTES))),
    top_sites=items(SITE), top_modules=items(MODULE),
    fragmentation=record(unallocated_at_peak_bytes=BYTES,
                         largest_free_block_at_peak_bytes=BYTES,
                         unallocated_at_end_bytes=BYTES, largest_free_block_at_end_bytes=BYTES,
                         free_blocks_at_end=COUNT, pools_at_peak=items(POOL),
                         pools_at_end=items(POOL)),
    oom=optional(OOM), ooms=items(OOM), oom_events=COUNT,
    replay=record(modelled=FLAG, note=TEXT, what_if=items(record(
        settings=TEXT, peak_reserved_bytes=optional(BYTES),
        peak_allocated_bytes=optional(BYTES), saved_bytes=optional(_integer(
            -MAX_BYTES, MAX_BYTES + 1, "a byte difference"))))),
    steps=items(record(step=COUNT, start=COUNT, end=COUNT, peak_allocated_bytes=BYTES,
                       end_allocated_bytes=BYTES)),
    leak=optional(record(growth_per_step_bytes=BYTES, steps=COUNT, site=optional(SITE),
                         site_growth_bytes=BYTES)),
    step_growth=record(verdict=TEXT, steps=COUNT, steps_needed=COUNT, growth_bytes=BYTES,
                       growth_per_step_bytes=BYTES, grew_until_step=optional(COUNT),
                       optimizer_state_growth_bytes=BYTES),
)
MODEL = record(
    parameters=COUNT, parameter_bytes=BYTES, trainable=COUNT, dtypes=table(COUNT),
    small_tensor_elements=COUNT, trainable_numels=items(COUNT),
    optimizers=items(record(("class",), **{"class": TEXT}, state_bytes=BYTES,
                            momentum=optional(FLAG), fused=optional(FLAG),
                            foreach=optional(FLAG))),
    repeated_blocks=items(record(
        ("class", "count"), **{"class": TEXT}, module=optional(TEXT), count=COUNT,
        parameters_each=COUNT, switch=optional(TEXT),
        saved=optional(record(("inside_bytes", "kept_inputs_bytes", "largest_call_bytes",
                                "forward_bytes"), inside_bytes=BYTES,
                               kept_inputs_bytes=BYTES, largest_call_bytes=BYTES,
                               forward_bytes=BYTES, calls=COUNT)),
        call=optional(record(("args", "kwargs"), args=items(IDENTIFIER),
                             kwargs=items(IDENTIFIER))))),
    autocast=optional(TEXT), pretrained=FLAG, trainer=optional(TEXT),
    zero_grad_set_to_none=optional(FLAG),
    attention=optional(record(fused=optional(FLAG), score_shape=optional(items(COUNT)),
                              score_dtype=optional(TEXT), module=optional(TEXT))),
    eval_module=optional(TEXT), trained_in_eval=optional(TEXT), checkpointed=items(TEXT),
    loaded_state_dict=FLAG, ops_traced=FLAG, accumulation=optional(COUNT),
    loss=optional(record(("shape", "dtype"), shape=items(COUNT), dtype=TEXT,
                         logits_rows=COUNT)),
    parallelism=optional(record(strategies=items(TEXT), meshes=items(record(
        shape=items(COUNT), dims=items(TEXT), placements=optional(items(TEXT)))),
        param_dtype=optional(TEXT), pipeline=optional(record(
            schedule=TEXT, microbatches=COUNT, stages=COUNT, stage=COUNT)),
        deepspeed=optional(record(reduce_bucket_size=COUNT, overlap_comm=FLAG)))),
)
RUN = record(
    command=items(TEXT), started=TEXT, cwd=TEXT, launcher_env=optional(table(TEXT)),
    cards=optional(_integer(1, MAX_ID, "a card count")),
    torch_version=TEXT, device=TEXT,
    predicted=FLAG, allocator_conf=TEXT, duration_s=SECONDS,
    exit=record(status=TEXT, code=_integer(-(1 << 31), 1 << 31, "an exit code"),
                error=optional(TEXT)),
    stopped_by=optional(TEXT), optimizer_steps=COUNT, no_steps_reason=optional(TEXT),
    rank=COUNT, world_size=_integer(1, MAX_ID, "a world size"),
    cuda=optional(table(ANY)), model=optional(MODEL),
    virtual_gpu=optional(record(("spec",), spec=TEXT, device_name=TEXT, total_bytes=BYTES,
                                capability=items(COUNT), context_bytes=BYTES,
                                context_measured=FLAG)),
    need=optional(record(card_bytes=BYTES, context_bytes=BYTES, allocated_bytes=BYTES,
                         reserved_bytes=BYTES, total_bytes=BYTES, short_bytes=BYTES,
                         allowed_bytes=optional(BYTES), unknown=TEXT,
                         rerun=record(status=TEXT, optimizer_steps=COUNT,
                                      stopped_by=optional(TEXT)))),
    signature=optional(TEXT),
)
REPORT = record(
    ("schema", "devices"), schema=TEXT, command=TEXT,
    source=record(path=TEXT, format=TEXT, allocator_conf=TEXT), units=TEXT,
    devices=items(DEVICE), run=optional(RUN),
    imbalance=record(ranks=items(COUNT), peak_allocated_min_bytes=BYTES,
                     peak_allocated_max_bytes=BYTES, max_over_min=SHARE),
)


def first_problem(data: Any) -> str | None:
    """The first field of ``data`` that is not as the report schema says, or None."""
    try:
        REPORT(data, "report")
    except _Refused as exc:
        return str(exc).removeprefix("report.")
    return None
