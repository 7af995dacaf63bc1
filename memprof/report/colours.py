"""The colour of each category, the same in the PNG and the HTML report: matplotlib's
default cycle (``tab10``) in the order of ``CATEGORIES``, as the first PNGs drew them."""

from __future__ import annotations

from memprof.trace.model import CATEGORIES

CATEGORY_COLOURS = dict(zip(CATEGORIES, (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"),
    strict=True))
RESERVED_COLOUR = "#000000"
ALLOCATED_COLOUR = CATEGORY_COLOURS[CATEGORIES[0]]  # tab:blue, one line without categories
PEAK_COLOUR = "#d62728"  # tab:red
