"""What the virtual GPU cannot run: one error, which says why and what to do instead."""

from __future__ import annotations


class VirtualGpuUnsupported(NotImplementedError):
    """Something a script asked of CUDA that the virtual GPU cannot give it."""

    def __init__(self, what: str, why: str, instead: str) -> None:
        super().__init__(f"memprof's virtual GPU cannot run {what} ({why}); {instead}")
