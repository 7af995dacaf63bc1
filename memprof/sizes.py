"""Sizes typed by people: ``24GB``, ``512MiB``, ``1073741824``."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}


def parse_size(text: str) -> int:
    """``parse_size('24GB') == 24 * 2**30``.

    Binary multiples with or without ``i``: GPU memory is quoted in binary units (an
    "80 GB" card holds 80 GiB).
    """
    match = _SIZE.match(text)
    if not match or (match.group(3) and not match.group(2) and match.group(3).lower() != "b"):
        raise ValueError(f"not a size: {text!r} (try 24GB, 512MiB or 1073741824)")
    number, unit, _ = match.groups()
    return int(float(number) * (1 << _SHIFT[unit.lower()]))
