"""Byte sizes for people: binary units out, human sizes in."""

from __future__ import annotations

import re

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
_PARSE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_FACTORS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def format_bytes(n: int | float) -> str:
    """``format_bytes(3 * 2**30) == '3.00 GiB'``; negative values keep their sign."""
    value, unit = float(abs(n)), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    sign = "-" if n < 0 else ""
    return f"{sign}{int(value)} B" if unit == 0 else f"{sign}{value:.2f} {_UNITS[unit]}"


def parse_bytes(text: str) -> int:
    """``parse_bytes('24GB') == 24 * 2**30``: K/M/G/T with or without i/B, binary multiples.

    GPU capacities are quoted in binary units ("80GB" is 80 GiB of HBM), so GB means GiB.
    """
    match = _PARSE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (try 24GB, 512MiB or 1073741824)")
    number, unit = match.groups()
    return int(float(number) * _FACTORS[unit[:1].lower()])
