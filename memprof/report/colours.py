"""The colour of each category, the same in the PNG and the HTML report: matplotlib's
default cycle (``tab10``), as the first PNGs drew them, and its cyan for what came later."""

from __future__ import annotations

CATEGORY_COLOURS = {
    "parameters": "#1f77b4", "buffers": "#ff7f0e", "gradients": "#2ca02c",
    "optimizer_state": "#d62728", "communication": "#17becf", "activations": "#9467bd",
    "temporaries": "#8c564b", "workspace": "#e377c2", "other": "#7f7f7f"}

RESERVED_COLOUR = "#000000"
ALLOCATED_COLOUR = CATEGORY_COLOURS["parameters"]  # tab:blue, one line without categories
PEAK_COLOUR = "#d62728"  # tab:red
