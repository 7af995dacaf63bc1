"""Sizes typed by people, read one way everywhere (``--budget``, ``--device-memory``,
``--max-peak``, ``--max-increase``, ``--virtual-gpu``, the pytest marker):

- ``24GB``, ``24000MB``: decimal, 10^9 and 10^6 bytes, as disks and the SI write them;
- ``24GiB``, ``24G``: binary, 2^30 bytes, as PyTorch and nvidia-smi count;
- ``1073741824``: bytes.

A size is exact (``0.5GiB`` is 536,870,912 bytes, 400 digits are read without overflow)
and at most :data:`MAX_SIZE`, more than any device holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

MAX_SIZE = 1 << 44  # 16 TiB, as a snapshot's byte counts (memprof.trace.fields.MAX_BYTES)

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(?:([kmgt])(i?)(b?)|(b?))\s*$", re.IGNORECASE)
_LONGEST = 1000  # characters: a number beyond this is no size, and Fraction would be slow
_POWER = {"k": 1, "m": 2, "g": 3, "t": 4}


class TooLarge(ValueError):
    """A size larger than :data:`MAX_SIZE`."""


@dataclass(frozen=True)
class Size:
    """A size in bytes, and how the text was read (for the user to check)."""

    bytes: int
    read_as: str


def read_size(text: str) -> Size:
    """``read_size('24GB').bytes == 24 * 10**9``; ValueError with a one-line message when
    ``text`` is not a size or is larger than :data:`MAX_SIZE`."""
    match = _SIZE.match(text) if len(text) <= _LONGEST else None
    if not match:
        raise ValueError(f"not a size: {text[:40]!r} (try 24GB, 24GiB, 512MiB or 1073741824)")
    number, prefix, binary, suffix, _ = match.groups()
    exact = Fraction(number)
    if not prefix:
        size, how = int(exact), "bytes"
    else:
        decimal = bool(suffix) and not binary
        power = _POWER[prefix.lower()]
        size = int(exact * (1000 if decimal else 1024) ** power)
        unit = f"{prefix.upper()}{'' if decimal else 'i'}B"
        how = (f"decimal: 1 {unit} = 10^{3 * power} bytes" if decimal else
               f"binary: 1 {unit} = 2^{10 * power} bytes")
    if size > MAX_SIZE:
        raise TooLarge(f"{text.strip()[:40]!r} is more than any device holds (16 TiB)")
    shown = f"{size:,} bytes" if not prefix else f"{number} {unit} = {size:,} bytes ({how})"
    return Size(size, shown)


def parse_size(text: str) -> int:
    """The bytes of :func:`read_size`."""
    return read_size(text).bytes
