"""Which ``optimizer.step()`` calls end a training step, when a script has several optimizers.

A GAN steps its discriminator's optimizer and then its generator's in every iteration; a
model may split its parameters between optimizers that step one after the other. Counting
every call would make an iteration several steps whose peaks alternate. A step ends
instead at the step of the optimizer that closes an iteration: the last to step before the
first one steps again. Until that is known (the first iteration), each new optimizer's
step moves the end of the step that is open; an optimizer that steps twice in a row, or
any one after the closer is gone, closes from then on (the script replaced its optimizer).

    pace = StepPace()
    pace.at(optimizer)  # from an optimizer step post-hook: END, MOVE or None
"""

from __future__ import annotations

import weakref

END = "end"  # a step ends here
MOVE = "move"  # the step that ended last ends here instead


class StepPace:
    """Tells where training steps end (see the module doc)."""

    def __init__(self) -> None:
        self._closer: weakref.ref[object] | None = None
        self._last: weakref.ref[object] | None = None  # the optimizer that stepped last
        self._first_cycle: list[weakref.ref[object]] | None = []  # None once it repeated

    @property
    def first_cycle(self) -> int | None:
        """The optimizers that have stepped in the first iteration, while it runs (None once
        it is over: an optimizer stepped again)."""
        cycle = self._first_cycle
        return None if cycle is None else sum(r() is not None for r in cycle)

    def at(self, optimizer: object) -> str | None:
        """``optimizer`` has just stepped: ``END``, ``MOVE`` or None (see the module doc)."""
        closer = self._closer() if self._closer is not None else None
        last = self._last() if self._last is not None else None
        self._last = ref = weakref.ref(optimizer)
        cycle = self._first_cycle
        repeats = cycle is not None and any(r() is optimizer for r in cycle)
        if repeats:
            self._first_cycle = cycle = None  # the first iteration is over: the closer is known
        if closer is None or optimizer is closer or optimizer is last:
            self._closer = ref
            if cycle is not None and not cycle:
                cycle.append(ref)
            return END
        if cycle is not None:  # a new optimizer in the first iteration: it closes it, so far
            cycle.append(ref)
            self._closer = ref
            return MOVE
        return None
