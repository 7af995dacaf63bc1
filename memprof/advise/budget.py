"""The memory budget of ``memprof suggest``: a size, decimal or binary, or a card."""

from __future__ import annotations

from memprof.report.units import format_bytes
from memprof.sizes import Size, TooLarge, read_size
from memprof.trace.fields import describe

Budget = Size  # a budget in bytes, and how the user's text was read


def parse_budget(text: str) -> Budget:
    """``24GB`` (decimal: 24 * 10**9), ``24GiB`` or ``24G`` (binary), ``24000MB``, bytes, or
    a card of the virtual GPU table (its memory less the CUDA context)."""
    try:
        size = read_size(text)
    except TooLarge as exc:
        raise ValueError(f"--budget {exc}") from None
    except ValueError:  # a card, then
        size = None
    if size is not None:
        return size
    from memprof.collect.virtual.cards import parse_spec

    try:
        card = parse_spec(text)
    except ValueError:
        raise ValueError(f"--budget {describe(text)}: not a size or a card (try 24GB, 22.5GiB,"
                         " 24000MB, 'A100 40GB')") from None
    return Budget(card.usable_bytes,
                  f"{card.name}: {format_bytes(card.total_bytes)} less the CUDA context"
                  f" ({format_bytes(card.context_bytes)},"
                  f" {'measured' if card.context_measured else 'assumed'}) ="
                  f" {card.usable_bytes:,} bytes")
