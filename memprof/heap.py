"""Hand memory the process has freed back to the operating system, where the C library can."""

from __future__ import annotations

import ctypes


def trim() -> None:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``; elsewhere a
    no-op).

    After a run, the script's freed tensors and memprof's dropped trace leave free pages
    in the heap that stay resident until reused; trimmed, the analysis that follows does
    not raise the process's peak RSS above what the run itself reached.
    """
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim  # the symbols the interpreter has loaded
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl without it, ...)
        return
    malloc_trim(0)
