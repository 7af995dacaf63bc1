"""Allocations as intervals of event indices: the table every "what was live" question reads."""

from __future__ import annotations

import numpy as np
import pandas as pd

from memprof.analysis.replay import Replay
from memprof.trace.model import Action, DeviceTrace


def intervals(trace: DeviceTrace | None, replay: Replay) -> pd.DataFrame:
    """One row per allocation counted in the allocated stat.

    Columns: ``start`` (alloc event index, -1 before the window), ``end`` (index of
    its free request, or the trace length), ``size`` (block bytes), ``requested``,
    ``event`` (alloc event index or -1) and ``initial`` (index into
    ``replay.initial`` or -1).
    """
    counted = [i for i, b in enumerate(replay.initial) if b.counted]
    before = pd.DataFrame({
        "start": np.full(len(counted), -1, np.int64),
        "end": np.array([replay.initial[i].end for i in counted], np.int64),
        "size": np.array([replay.initial[i].size for i in counted], np.int64),
        "requested": np.array([replay.initial[i].requested for i in counted], np.int64),
        "event": np.full(len(counted), -1, np.int64),
        "initial": np.array(counted, np.int64),
    })
    if trace is None or not len(trace):
        return before
    idx = np.flatnonzero(trace.action == Action.ALLOC)
    during = pd.DataFrame({
        "start": idx,
        "end": replay.end[idx],
        "size": replay.block_size[idx],
        "requested": trace.size[idx],
        "event": idx,
        "initial": np.full(len(idx), -1, np.int64),
    })
    return pd.concat([before, during], ignore_index=True)


def live_at(table: pd.DataFrame, index: int) -> pd.DataFrame:
    """Rows allocated after event ``index`` was applied (-1: before the first event)."""
    return table[(table["start"] <= index) & (table["end"] > index)]
