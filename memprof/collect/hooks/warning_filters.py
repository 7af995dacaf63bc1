"""Warnings that memprof's own hooks make PyTorch give, kept out of the script's output.

    entry = ignore(COMPILE_WITH_GLOBAL_HOOKS)  # while the hooks are registered
    restore(entry)
"""

from __future__ import annotations

import warnings
from typing import Any

# torch.compile(module) called while global module hooks (memprof's) are registered
COMPILE_WITH_GLOBAL_HOOKS = r"Using `torch\.compile\(module\)` when there are global hooks"
# the light recorder's profiler has memory events and no operator events to match them to;
# inside an autograd Function the C++ warning becomes a Python one
PROFILER_WITHOUT_OPERATORS = "Failed to recover relationship between all profiler and kineto"


def ignore(message: str) -> Any:
    """Ignore warnings whose text starts with ``message`` (a regular expression); the filter
    to give ``restore``."""
    warnings.filterwarnings("ignore", message=message)
    return warnings.filters[0]


def restore(entry: Any) -> None:
    """Remove a filter ``ignore`` added (the script's own filters stay as they are)."""
    if entry in warnings.filters:
        warnings.filters.remove(entry)
        mutated = getattr(warnings, "_filters_mutated", None)  # drops the cached decisions
        if mutated is not None:
            mutated()
