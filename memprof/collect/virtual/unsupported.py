"""What the virtual GPU cannot run: one error, which says why and what to do instead."""

from __future__ import annotations

import torch

from memprof.errors import Unsupported


class VirtualGpuUnsupported(Unsupported):
    """Something a script asked of CUDA that the virtual GPU cannot give it."""

    def __init__(self, what: str, why: str, instead: str) -> None:
        super().__init__(f"memprof's virtual GPU cannot run {what} ({why}); {instead}")


def strided_only(t: object) -> None:
    """Refuse a tensor of another layout than strided on the card (a sparse adjacency moved
    there): a virtual tensor is a strided meta tensor, which would charge it as dense."""
    layout = getattr(t, "layout", None)
    if layout is not None and layout != torch.strided:
        name = str(layout).removeprefix("torch.")
        raise VirtualGpuUnsupported(
            f"{name} tensors on CUDA", "it models strided tensors only, and would charge"
            " this one as dense", "keep it on the host, or profile the script on a GPU or"
            " its host tensors with --device cpu")
