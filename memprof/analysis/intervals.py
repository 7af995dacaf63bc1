"""Allocations as intervals of event indices: the table every "what was live" question reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memprof.analysis.replay import Replay
from memprof.trace.model import Action, DeviceTrace


@dataclass(frozen=True, slots=True)
class Intervals:
    """One entry per allocation counted in the allocated stat, as parallel arrays.

    ``start``: alloc event index (-1 before the window); ``end``: index of its free
    request (the trace length if never freed); ``size``: block bytes; ``event``: the
    alloc event (-1 before the window); ``initial``: index into ``Replay.initial`` or -1.
    """

    start: np.ndarray
    end: np.ndarray
    size: np.ndarray
    requested: np.ndarray
    event: np.ndarray
    initial: np.ndarray

    def live_at(self, index: int) -> Intervals:
        """The allocations counted after event ``index`` was applied (-1: before the first)."""
        mask = (self.start <= index) & (self.end > index)
        return Intervals(*(getattr(self, f)[mask] for f in self.__slots__))

    def __len__(self) -> int:
        return len(self.start)


def intervals(trace: DeviceTrace | None, replay: Replay) -> Intervals:
    """The allocations of a replayed trace, those before the window first."""
    counted = [i for i, b in enumerate(replay.initial) if b.counted]
    idx = np.flatnonzero(trace.action == Action.ALLOC) if trace is not None else \
        np.zeros(0, np.int64)
    initial = replay.initial

    def column(before: list[int], during: np.ndarray) -> np.ndarray:
        return np.concatenate([np.asarray(before, np.int64), during.astype(np.int64)])

    none = np.full(len(idx), -1, np.int64)
    return Intervals(
        start=column([-1] * len(counted), idx),
        end=column([initial[i].end for i in counted], replay.end[idx]),
        size=column([initial[i].size for i in counted], replay.block_size[idx]),
        requested=column([initial[i].requested for i in counted],
                         trace.size[idx] if trace is not None else none),
        event=column([-1] * len(counted), idx),
        initial=column(counted, none),
    )
