"""The peak's composition, and how it moves when a remedy changes what is held.

Two moments can be the peak of a training step: the end of the forward pass or early
backward, where activations pile up, and the optimizer step (every parameter, gradient and
moment at once, with the step's temporaries). The run recorded one of them exactly; the
other is rebuilt from the categories' own peaks. ``at_peak`` is the activation moment and
``at_step`` the step, whichever was recorded. A remedy rescales categories at both; the
new peak is the larger of the two. The allocator's cache (``cache_ratio`` of the recorded
peak's allocated bytes, unless an allocator remedy changes it) follows what it is made of:
it scales with the activations and temporaries where they change more than the whole does
(blocks freed and reused every step fragment the segments), and with the whole otherwise,
so a remedy of model state alone saves its own bytes, no more. Savings are therefore counted
only where bytes are alive at the peak, and never summed in isolation. Tagged activations
(attention scores, eval passes: ``report.json``'s ``tagged``) are tracked inside the
activations at each moment, scaled with them, so a remedy can drop exactly those.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from memprof.analysis.blocks import SMALL_BUFFER
from memprof.trace.model import (
    ACTIVATIONS,
    AUTOCAST_HALF_TEMPORARY,
    BUFFERS,
    CATEGORIES,
    COMMUNICATION,
    GRADIENTS,
    OPTIMIZER_STATE,
    OTHER,
    PARAMETERS,
    TEMPORARIES,
    WORKSPACE,
)

BUSY_SHARE = 0.05
TAG_CATEGORY = {AUTOCAST_HALF_TEMPORARY: TEMPORARIES}  # a tag within another category


@dataclass(frozen=True)
class Peak:
    """Bytes by category at the recorded peak and at the optimizer step, and the cache."""

    at_peak: dict[str, int]
    at_step: dict[str, int]
    cache_ratio: float  # reserved-but-unallocated bytes per allocated byte
    # within the activations (a temporary's tag: within the temporaries, TAG_CATEGORY)
    tags_at_peak: dict[str, int] = field(default_factory=dict)
    tags_at_step: dict[str, int] = field(default_factory=dict)
    # bytes allocated at a third moment a remedy may make the peak (FSDP's CPU offload:
    # the model the script put on the card whole before FSDP sharded it)
    floor: int = 0
    # the recorded peak's allocated bytes, and its activations and temporaries (0: unknown,
    # the cache in proportion to the whole)
    allocated_base: int = 0
    transient_base: int = 0

    @property
    def allocated(self) -> int:
        return max(sum(self.at_peak.values()), sum(self.at_step.values()), self.floor)

    @property
    def reserved(self) -> int:
        allocated = self.allocated
        share = allocated / self.allocated_base if self.allocated_base else 1.0
        if self.transient_base:
            moment = self.moment
            share = max(share, (moment[ACTIVATIONS] + moment[TEMPORARIES]) / self.transient_base)
        cache = self.cache_ratio * (self.allocated_base * share if self.allocated_base
                                    else allocated)
        # at least the allocated bytes in whole segments: the smallest is 2 MiB
        return max(int(allocated + cache), -(-allocated // SMALL_BUFFER) * SMALL_BUFFER)

    @property
    def busy(self) -> bool:
        """Whether activations and temporaries are a share of the peak (5%) worth the
        remedies that shrink them."""
        moment = self.moment
        return moment[ACTIVATIONS] + moment[TEMPORARIES] >= BUSY_SHARE * self.allocated

    @property
    def moment(self) -> dict[str, int]:
        """The composition of whichever moment is the peak."""
        return self.at_peak if sum(self.at_peak.values()) >= sum(self.at_step.values()) \
            else self.at_step

    def scaled(self, factors: dict[str, float], step_too: bool = True) -> Peak:
        """Categories multiplied by ``factors`` (at the optimizer step too, by default)."""
        def scale(held: dict[str, int]) -> dict[str, int]:
            return {k: int(v * factors.get(k, 1.0)) for k, v in held.items()}

        def tags(held: dict[str, int]) -> dict[str, int]:
            return {k: int(v * factors.get(TAG_CATEGORY.get(k, ACTIVATIONS), 1.0))
                    for k, v in held.items()}
        return replace(self, at_peak=scale(self.at_peak), tags_at_peak=tags(self.tags_at_peak),
                       at_step=scale(self.at_step) if step_too else self.at_step,
                       tags_at_step=tags(self.tags_at_step) if step_too else self.tags_at_step)

    def tagged(self, tag: str) -> int:
        """Bytes of ``tag`` at whichever moment is the peak."""
        held = self.tags_at_peak if self.moment is self.at_peak else self.tags_at_step
        return held.get(tag, 0)

    def without_tag(self, tag: str, share: float = 1.0) -> Peak:
        """``share`` of the activations tagged ``tag`` no longer held, at both moments."""
        def drop(held: dict[str, int], tags: dict[str, int]) -> dict[str, int]:
            gone = int(tags.get(tag, 0) * share)
            return {**held, ACTIVATIONS: max(0, held[ACTIVATIONS] - gone)}

        def left(tags: dict[str, int]) -> dict[str, int]:
            return {**tags, tag: tags.get(tag, 0) - int(tags.get(tag, 0) * share)}
        return replace(self, at_peak=drop(self.at_peak, self.tags_at_peak),
                       at_step=drop(self.at_step, self.tags_at_step),
                       tags_at_peak=left(self.tags_at_peak), tags_at_step=left(self.tags_at_step))

    def with_state(self, category: str, change: int) -> Peak:
        """``change`` bytes more (or fewer) in ``category`` wherever it holds any."""
        def moved(held: dict[str, int]) -> dict[str, int]:
            return {**held, category: max(0, held[category] + change)} if held[category] \
                else held
        return replace(self, at_peak=moved(self.at_peak), at_step=moved(self.at_step))

    def added(self, category: str, extra: int) -> Peak:
        """``extra`` bytes more in ``category`` at the recorded peak only."""
        return replace(self, at_peak={**self.at_peak,
                                      category: self.at_peak[category] + extra})


def peak_of(device: dict[str, Any]) -> Peak:
    """The model of a report device. If the recorded peak is the optimizer step (every
    gradient and moment held, the activations gone), the other moment is the forward pass
    at the activations' own peak; otherwise the other moment is the step, with the model
    state at its own peaks."""
    at_peak = {k: int(device["categories"].get(k, 0)) for k in CATEGORIES}
    peaks = {k: int(v) for k, v in (device.get("category_peaks") or at_peak).items()}
    # what the batch does not change: model state, and the buffers collectives gather it in
    kept = {k: at_peak[k] for k in (PARAMETERS, BUFFERS, OPTIMIZER_STATE, COMMUNICATION,
                                    WORKSPACE, OTHER)}
    zero = dict.fromkeys(CATEGORIES, 0)
    in_step = peaks.get(GRADIENTS, 0) > 0 and at_peak[GRADIENTS] >= 0.95 * peaks[GRADIENTS] \
        and at_peak[ACTIVATIONS] < 0.5 * peaks.get(ACTIVATIONS, 0)
    if in_step:
        forward = {**zero, **kept, ACTIVATIONS: peaks[ACTIVATIONS]}
        at_step, at_peak = at_peak, forward
    else:
        state = (PARAMETERS, BUFFERS, GRADIENTS, OPTIMIZER_STATE, WORKSPACE, OTHER)
        at_step = {**zero, **{k: peaks.get(k, 0) for k in state}}
    tagged = device.get("tagged") or {}
    recorded = {k: int(v["at_peak_bytes"]) for k, v in tagged.items()}
    forward = {k: int(v["at_activations_peak_bytes"]) for k, v in tagged.items()}
    tags_at_peak, tags_at_step = (forward, recorded) if in_step else (recorded, {})
    allocated = device["peak"]["allocated_bytes"] or 1
    reserved = device["peak"].get("reserved_at_peak_bytes") or device["peak"]["reserved_bytes"]
    transient = sum(int(device["categories"].get(k, 0)) for k in (ACTIVATIONS, TEMPORARIES))
    return Peak(at_peak, at_step, max(0.0, reserved / allocated - 1), tags_at_peak, tags_at_step,
                allocated_base=allocated, transient_base=transient)
