"""Pick the recorder for a run: each returns a ``Recording`` (``recording.py``), so nothing
past ``collect/`` asks where a trace came from.

    record = recorder(use_cuda=False, light=False, card=DEFAULT_CARD)
    recording = record(target, RunOptions(settings, max_entries))
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from memprof.collect.recording import Recorder

if TYPE_CHECKING:
    from memprof.collect.virtual.cards import Card


def recorder(use_cuda: bool, light: bool, card: Card | None, announce: str | None = None
             ) -> Recorder:
    """The virtual GPU's recorder for ``card`` (``announce``: its first words on stderr),
    else the GPU's allocator history with ``use_cuda``, else the light or the exact CPU
    recorder."""
    if card is not None:
        from memprof.collect.virtual.session import record

        return functools.partial(record, card=card, announce=announce)
    if use_cuda:
        from memprof.collect.cuda.recorder import record
    elif light:
        from memprof.collect.cpu.light import record
    else:
        from memprof.collect.cpu.recorder import record
    return record
