"""Where a trace repeats itself: the steady state of a training loop, event for event.

Once a training loop's allocator settles, every step makes the same requests and gets the
same blocks: the same actions, addresses and sizes, step after step. The allocator is
deterministic, so a span of events that repeats one period exactly, replayed from the same
state, ends in the same state, with the same decisions on the way. ``replay`` uses that: it
replays the first periods of a repeating span, and when two period boundaries find the
allocator in the same state, fills the periods after them from the last one it replayed
(``skip``) instead of replaying them, event by event, again.

    repeat = find_repeat(codes, addr, size, stream, index)   # positions of the replay
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_PERIODS = 3  # two to find the state repeats, one or more to skip
MIN_SKIPPED = 20_000  # events: a shorter repeat is replayed (finding it costs about as much)
CANDIDATES = 64  # earlier occurrences of a probe event tried as the period's start
WINDOW = 2048  # events compared around the probe before a candidate is checked in full
PROBES = (1 / 2, 1 / 4, 3 / 4)  # where in the trace a repeat is looked for


@dataclass(frozen=True)
class Repeat:
    """Positions ``[start, stop)`` of the replayed events repeat with ``period``: the event
    at ``p`` and at ``p + period`` are the same for ``start <= p < stop - period``, and lie
    ``stride`` trace events apart."""

    start: int
    period: int
    stop: int
    stride: int


def find_repeat(columns: tuple[np.ndarray, ...], index: np.ndarray, exclude: int
                ) -> Repeat | None:
    """The longest repeating span found around a few probes of the events whose
    ``columns`` (action code, address, size, stream: one value per position) are given,
    ``index`` their trace positions; None if there is none worth skipping. A span never
    holds an event whose code is ``exclude`` (out-of-memory events are each described)."""
    n = len(index)
    if n < MIN_SKIPPED:
        return None
    codes = columns[0]
    found: Repeat | None = None
    for fraction in PROBES:
        probe = int(n * fraction)
        repeat = _around(columns, index, probe)
        if repeat is not None and not (codes[repeat.start:repeat.stop] == exclude).any() \
                and (found is None or repeat.stop - repeat.start > found.stop - found.start):
            found = repeat
        if found is not None and found.stop - found.start > n // 2:
            break
    return found


def _around(columns: tuple[np.ndarray, ...], index: np.ndarray, probe: int) -> Repeat | None:
    """The repeating span that holds position ``probe``, with the shortest period the
    events around it show."""
    same = np.ones(probe, bool)
    for column in columns:
        same &= column[:probe] == column[probe]
    earlier = np.flatnonzero(same)[::-1][:CANDIDATES]
    n = len(index)
    for start in earlier:
        period = probe - int(start)
        low, high = max(period, probe - WINDOW), min(n, probe + WINDOW)
        if high - low < WINDOW and high - low < period:
            continue
        if all(np.array_equal(c[low:high], c[low - period:high - period]) for c in columns):
            return _span(columns, index, probe, period)
    return None


def _span(columns: tuple[np.ndarray, ...], index: np.ndarray, probe: int, period: int
          ) -> Repeat | None:
    """The widest span around ``probe`` that repeats with ``period`` at a constant stride."""
    stride = index[period:] - index[:-period]
    same = stride == stride[probe - period]
    for column in columns:
        same &= column[period:] == column[:-period]
    breaks = np.flatnonzero(~same)
    # same[p] compares p with p + period: the span runs from the break before the probe's
    # period to the break after it
    after = int(np.searchsorted(breaks, probe - period))
    first = int(breaks[after - 1]) + 1 if after > 0 else 0
    last = int(breaks[after]) if after < len(breaks) else len(same)
    start, stop = first, last + period
    if stop - start < MIN_PERIODS * period or stop - start - 2 * period < MIN_SKIPPED:
        return None
    return Repeat(start, period, stop, int(stride[probe - period]))


MAX_TRIES = 8  # period boundaries compared before the allocator is taken not to settle


@dataclass(frozen=True)
class Boundary:
    """What the replay's state is at a period boundary."""

    state: tuple  # the allocator's (``BlockTable.state``)
    starts: dict[int, int]  # the live allocations' alloc events, by address
    tallies: tuple[int, ...]  # counts that grow as events are replayed
    troubles: tuple[int, ...]  # counts of what went wrong, which a skipped period never adds


class Skipper:
    """The boundaries of ``repeat``'s periods in the replay: ``boundary`` compares each
    with the one before, and where the allocator is the same, says how many periods to skip;
    ``skip`` fills what the replay of those would have written."""

    def __init__(self, repeat: Repeat, kept: np.ndarray) -> None:
        self.repeat = repeat
        self.kept = kept
        self.mark = repeat.start  # the next boundary's position; -1: no more
        self._pair: tuple[Boundary | None, Boundary | None] = (None, None)
        self._tries = 0

    def repeated_events(self) -> range:
        """The trace events that repeat the ones a period before them."""
        r = self.repeat
        return range(int(self.kept[r.start + r.period]), int(self.kept[r.stop - 1]) + 1)

    def boundary(self, position: int, now: Boundary) -> int:
        """At the boundary ``position``: how many periods to skip from here (0: replay on)."""
        r = self.repeat
        before = self._pair[1]
        self._pair = (before, now)
        self._tries += 1
        self.mark += r.period
        if self._tries > MAX_TRIES or self.mark > r.stop:
            self.mark = -1
        if before is None or before.state != now.state or before.troubles != now.troubles \
                or before.starts.keys() != now.starts.keys() or not all(
                    now.starts[a] == before.starts[a]
                    or (now.starts[a] - before.starts[a] == r.stride and before.starts[a] >= 0)
                    for a in now.starts):
            return 0
        self.mark = -1
        return (r.stop - position) // r.period

    def skip(self, position: int, periods: int, live: dict[int, tuple[object, int]],
             arrays: tuple[np.ndarray, ...], end: np.ndarray) -> tuple[int, ...]:
        """Skip ``periods`` periods from the boundary ``position``: each of ``arrays`` (one
        value per trace event) repeats the last period, ``end`` (each allocation's release)
        gets the releases those events made, and ``live`` the allocations of the last
        skipped period. Returns what each tally grows by."""
        r, kept = self.repeat, self.kept
        before, now = self._pair
        assert before is not None and now is not None
        first = int(kept[position])  # the first event skipped
        stop = first + periods * r.stride
        for values in arrays:
            values[first:stop] = np.tile(values[first - r.stride:first], periods)
        # an allocation of the last period still live took over its address from its
        # counterpart a period before, and is released a period after it
        n = len(end)
        shifted = [(address, start) for address, start in now.starts.items()
                   if start != before.starts[address]]
        for address, start in shifted:
            release = end[start - r.stride] + r.stride
            if release < stop:
                end[start] = release
            block, _ = live[address]
            live[address] = (block, start + periods * r.stride)
        # and each period's allocations are released as the period's before them
        for low in range(first, stop, r.stride):
            ends, earlier = end[low:low + r.stride], end[low - r.stride:low] + r.stride
            take = (ends == n) & (earlier < stop)
            ends[take] = earlier[take]
        return tuple(periods * (b - a) for a, b in zip(before.tallies, now.tallies,
                                                      strict=True))
