"""The memory budget of ``memprof suggest``: a size, decimal or binary, or a card."""

from __future__ import annotations

import re
from dataclasses import dataclass

from memprof.report.units import format_bytes

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(?:([kmgt])(i?)b?|b?)\s*$", re.IGNORECASE)
_POWER = {"k": 1, "m": 2, "g": 3, "t": 4}


@dataclass(frozen=True)
class Budget:
    """A budget in bytes, and how the user's text was read."""

    bytes: int
    read_as: str


def parse_budget(text: str) -> Budget:
    """``24GB`` (decimal: 24 * 10**9), ``24GiB`` or ``24G`` (binary), ``24000MB``, bytes, or
    a card of the virtual GPU table (its memory less the CUDA context)."""
    match = _SIZE.match(text)
    if match:
        number, prefix, binary = match.groups()
        if not prefix:
            return Budget(int(float(number)), f"{int(float(number)):,} bytes")
        exact = binary or not text.strip().lower().endswith("b")
        base = 1024 if exact else 1000
        size = int(float(number) * base ** _POWER[prefix.lower()])
        unit = f"{prefix.upper()}{'i' if exact else ''}B"
        power = _POWER[prefix.lower()]
        kind = f"binary: 1 {unit} = 2^{10 * power} bytes" if exact else \
            f"decimal: 1 {unit} = 10^{3 * power} bytes"
        return Budget(size, f"{number} {unit} = {size:,} bytes ({kind})")
    from memprof.collect.virtual.cards import parse_spec

    try:
        card = parse_spec(text)
    except ValueError:
        raise ValueError(f"--budget {text!r}: not a size or a card (try 24GB, 22.5GiB,"
                         " 24000MB, 'A100 40GB')") from None
    return Budget(card.usable_bytes,
                  f"{card.name}: {format_bytes(card.total_bytes)} less the CUDA context"
                  f" ({format_bytes(card.context_bytes)},"
                  f" {'measured' if card.context_measured else 'assumed'}) ="
                  f" {card.usable_bytes:,} bytes")
