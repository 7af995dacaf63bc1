"""Byte sizes for people, in binary units."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: int | float) -> str:
    """``format_bytes(3 * 2**30) == '3.00 GiB'``; negative values keep their sign."""
    value, unit = float(abs(n)), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    sign = "-" if n < 0 else ""
    return f"{sign}{int(value)} B" if unit == 0 else f"{sign}{value:.2f} {_UNITS[unit]}"
