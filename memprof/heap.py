"""The process's heap after the script: its freed pages handed back to the system (where the
C library can), its objects kept out of the cyclic collector's way while memprof works."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Iterator


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


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Freeze every object alive now (``gc.freeze``) for the block, unfrozen after.

    After the run the script's objects (a framework's modules hold hundreds of thousands)
    are only waiting for the process to end; memprof's analysis allocates enough to
    trigger full collections, each a pass over all of them that frees nothing. Frozen,
    they are skipped, and collections see memprof's own objects alone.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
