"""``memprof run``'s options read into what the run uses: the virtual card, the limit."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memprof.errors import MemprofError

if TYPE_CHECKING:
    from memprof.collect.virtual.cards import Card


def max_peak(text: str | None) -> int | None:
    from memprof.sizes import parse_size

    try:
        return None if text is None else parse_size(text)
    except ValueError as exc:
        raise MemprofError(f"--max-peak: {exc}") from None


def virtual_card(spec: str | None, by_default: bool, memory: str | None = None
                 ) -> Card | None:
    """The card of ``--virtual-gpu SPEC``, the default card where there is no GPU, or None;
    with ``memory``, its memory changed to that size."""
    from dataclasses import replace

    from memprof.collect.virtual.cards import DEFAULT_CARD, parse_spec
    from memprof.sizes import parse_size

    try:
        card = parse_spec(spec) if spec is not None else DEFAULT_CARD if by_default else None
    except ValueError as exc:
        raise MemprofError(f"--virtual-gpu: {exc}") from None
    if memory is None or card is None:
        return card
    try:
        total = parse_size(memory)
    except ValueError as exc:
        raise MemprofError(f"--virtual-gpu-memory: {exc}") from None
    if total <= card.context_bytes:
        raise MemprofError(f"--virtual-gpu-memory {memory}: no larger than the card's CUDA"
                           " context; give more memory")
    return replace(card, total_bytes=total)
