"""What the gate measures: a metric of one device of a report, and the allowed increase."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memprof.sizes import parse_size
from memprof.trace.fields import describe
from memprof.trace.model import CATEGORIES

PEAK_METRICS = {"peak_allocated": "allocated_bytes", "peak_reserved": "reserved_bytes"}


@dataclass(frozen=True)
class Metric:
    """``peak_allocated``, ``peak_reserved`` or ``category:NAME``."""

    name: str

    @property
    def category(self) -> str | None:
        return self.name.split(":", 1)[1] if self.name.startswith("category:") else None

    @property
    def title(self) -> str:
        return f"{self.category} at most" if self.category else self.name.replace("_", " ")

    def value(self, device: dict[str, Any]) -> int | None:
        """The metric for a report's ``devices[]`` entry; None when the report lacks it."""
        if self.category is None:
            return device["peak"][PEAK_METRICS[self.name]]
        # the most the category held at any time; the split at the peak for foreign snapshots
        for key in ("category_peaks", "categories"):
            table = device.get(key)
            if isinstance(table, dict) and isinstance(table.get(self.category), int):
                return table[self.category]
        return None


def parse_metric(text: str) -> Metric:
    """The metric named ``text``; ValueError says what is accepted."""
    category = text.split(":", 1)[1] if text.startswith("category:") else None
    if text in PEAK_METRICS or category in CATEGORIES:
        return Metric(text)
    raise ValueError(f"unknown metric {text!r}: use peak_allocated, peak_reserved or"
                     f" category:NAME with NAME one of {', '.join(CATEGORIES)}")


@dataclass(frozen=True)
class Limit:
    """The increase allowed over the baseline: a fraction of it, or a number of bytes."""

    text: str
    fraction: float | None = None
    bytes: int | None = None

    def allowed(self, baseline: int) -> int:
        """The bytes the metric may grow over ``baseline``."""
        if self.fraction is not None:
            return int(baseline * self.fraction)
        return self.bytes or 0


def parse_limit(text: str) -> Limit:
    """``5%`` or ``200MiB`` (any size :func:`parse_size` reads); ValueError otherwise."""
    stripped = text.strip()
    if stripped.endswith("%"):
        try:
            percent = float(stripped[:-1])
        except ValueError:
            percent = -1.0
        if not 0 <= percent < 1e6:  # also refuses nan
            raise ValueError(f"--max-increase {describe(text)}: expected a percentage such as 5%")
        return Limit(stripped, fraction=percent / 100)
    try:
        return Limit(stripped, bytes=parse_size(stripped))
    except ValueError:
        raise ValueError(f"--max-increase {describe(text)}: expected a percentage (5%) or a size"
                         " (200MiB)") from None
