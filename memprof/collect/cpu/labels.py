"""Exact category labels for recorded allocations, from the role hooks (``roles.py``).

A storage seen in several roles keeps the first in `CATEGORIES` order (a parameter
saved for backward stays a parameter). Unseen storages are `temporaries` if freed during
the run, `other` if still alive. Activations are also tagged with what they were
(`forward_facts.py`), for savings models.
"""

from __future__ import annotations

from typing import Any

import torch

from memprof.collect.cpu.storages import StorageTracker
from memprof.collect.hooks.roles import RoleHooks
from memprof.trace.events import ACTION, TraceEvent
from memprof.trace.model import (
    ACTIVATIONS,
    AUTOCAST_HALF,
    AUTOCAST_HALF_TEMPORARY,
    CATEGORIES,
    COMMUNICATION,
    EVAL_ACTIVATIONS,
    OTHER,
    TEMPORARIES,
)

_RANK = {category: rank for rank, category in enumerate(CATEGORIES)}


class LabelHooks(RoleHooks):
    """Global hooks that mark the alloc events of `tracker` with their category."""

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__()
        self._tracker = tracker
        self._marks: dict[int, str] = {}  # id(alloc event) -> category
        self._tags: dict[int, str] = {}  # id(alloc event) -> a TAGS entry
        tracker.per_event += [self._marks, self._tags]  # trimmed with the ring buffer
        self._eval_tagged = False

    def resolve(self, events: list[TraceEvent], survivors: list[TraceEvent]) -> list[list[Any]]:
        """Return `[event_index, category]` for every alloc event in `events`."""
        alive = {id(event) for event in survivors}
        labels: list[list[Any]] = []
        for index, event in enumerate(events):
            if event[ACTION] == "alloc":
                key = id(event)
                fallback = OTHER if key in alive else TEMPORARIES
                category = self._marks.get(key) or self._tracker.known.get(key, fallback)
                if category in self._tracker.communication.get(key, ()):
                    category = COMMUNICATION
                labels.append([index, category])
        return labels

    def resolve_tags(self, events: list[TraceEvent], labels: list[list[Any]]
                     ) -> list[list[Any]]:
        """Return `[event_index, tag]` for every alloc event in `events` labelled
        `activations` (``labels``: ``resolve``'s) that has a tag (a parameter an eval forward
        saved has none); one without a tag of the forward's is tagged if autocast would make
        it in half, or save a half copy of it, and a temporary if autocast would make it in
        half."""
        halves, copies = self._tracker.halves, self._tracker.half_copies
        category = dict(map(tuple, labels))
        tags = []
        for index, event in enumerate(events):
            key, label = id(event), category.get(index)
            if label == ACTIVATIONS and key not in self._tracker.communication:
                tag = self._tags.get(key) or (
                    AUTOCAST_HALF if key in halves or key in copies else None)
            else:
                tag = AUTOCAST_HALF_TEMPORARY if label == TEMPORARIES and key in halves \
                    else None
            if tag is not None:
                tags.append([index, tag])
        return tags

    def _mark(self, t: torch.Tensor, category: str) -> None:
        for event in self._tracker.alloc_events(t):
            key = id(event)
            current = self._marks.get(key)
            if current is None or _RANK[category] < _RANK[current]:
                self._marks[key] = category

    def _end_step(self) -> None:
        # the tracker's own list: its ring buffer shifts step ends as it drops events
        self._tracker.steps.append(len(self._tracker.events))

    def _move_step_end(self) -> None:
        self._tracker.steps[-1] = len(self._tracker.events)

    def _fused_attention(self) -> bool:
        return self._tracker.fused_attention

    def _traces_ops(self) -> bool:
        return True

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        for event in self._tracker.alloc_events(t):
            key = id(event)
            tag = self._forward.tag(t, key in self._tracker.square_scores,
                                    self._tracker.log_probabilities.get(key))
            if tag is not None:
                self._tags.setdefault(key, tag)
                self._eval_tagged |= tag == EVAL_ACTIVATIONS
        return super()._pack(t)

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        self._blocks.stop()
        if self._eval_tagged:  # a backward reads it: that eval forward was backpropagated
            for event in self._tracker.alloc_events(t):
                if self._tags.get(id(event)) == EVAL_ACTIVATIONS:
                    del self._tags[id(event)]
                    self._forward.trained_in_eval = True
        return t
