"""Reading one field of a raw snapshot dict: its type and range checked, or a clear refusal.

Every number past this point fits the int64 arrays and the simulator's arithmetic: byte
counts are at most :data:`MAX_BYTES` (far above any device), addresses below
:data:`MAX_ADDRESS`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

MAX_BYTES = 1 << 44  # 16 TiB
MAX_ADDRESS = 1 << 62
MAX_ID = 1 << 62  # devices, streams, pool ids, event indices


class NotASnapshot(ValueError):
    """The object unpickled fine but is not a memory snapshot."""


def integer(raw: Mapping[str, Any], key: str, where: str, limit: int = MAX_ID,
            default: int | None = None) -> int:
    """``raw[key]`` as an int in ``[0, limit)``; ``default`` where it is missing or None."""
    value = raw.get(key)
    if value is None and default is not None:
        return default
    if type(value) is bool or not isinstance(value, int) or not 0 <= value < limit:
        raise NotASnapshot(f"{where}: {key!r} is {describe(value)}, not a number in"
                           f" [0, {limit:,})")
    return value


def fraction(raw: Mapping[str, Any], key: str, where: str) -> float:
    """``raw[key]`` as a finite number in [0, 1] (0 where missing or None)."""
    value = raw.get(key)
    if value is None:
        return 0.0
    if type(value) is bool or not isinstance(value, int | float) or not math.isfinite(value) \
            or not 0 <= value <= 1:
        raise NotASnapshot(f"{where}: {key!r} is {describe(value)}, not a number in [0, 1]")
    return float(value)


def text(raw: Mapping[str, Any], key: str, default: str = "") -> str:
    """``raw[key]`` if it is a string, else ``default``."""
    value = raw.get(key)
    return value if type(value) is str else default


def describe(value: object, limit: int = 40) -> str:
    """A short description of a raw value for an error message (never its whole repr; a
    string's first ``limit`` characters)."""
    if isinstance(value, bool | float) or value is None:
        return repr(value)
    if isinstance(value, int):
        bits = value.bit_length()
        return f"{value:,}" if bits < 64 else f"an integer of {bits} bits"
    if isinstance(value, str):
        return repr(value[:limit] + ("..." if len(value) > limit else ""))
    return f"a {type(value).__name__}"
