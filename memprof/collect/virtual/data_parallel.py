"""``nn.DataParallel`` on the virtual GPU: its scatter, gather and broadcast on one card.

``DataParallel.forward`` scatters its inputs even when it runs on one device (it calls
the module itself only after that), through ``torch._C._scatter``, a binding only CUDA
builds have. These are ``torch/csrc/cuda/comm.cpp``'s functions for virtual tensors on
the one card, cuda:0: a chunk already on it is a view, one on the host a copy; a gather
makes its output and copies into it; a broadcast hands back the tensors already on the
card. Replicas on other devices are refused in one line: the virtual GPU is one card. (A
card copies a host batch on DataParallel's own stream, whose blocks its allocator keeps
apart; the virtual card has one stream.)

    patches.update(data_parallel_patches())  # by (module, attribute), as gpu.py installs
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from memprof.collect.virtual.cuda_api import Stream
from memprof.collect.virtual.tensor import card_device
from memprof.collect.virtual.unsupported import VirtualGpuUnsupported


def data_parallel_patches() -> dict[tuple[Any, str], Callable[..., Any] | type]:
    """The ``torch._C`` communication bindings a CUDA build has, for the one card; and
    ``torch.Stream`` as a CUDA stream that orders nothing, whose uses a tensor may record
    (DataParallel copies host inputs on a stream of its own)."""
    return {(torch._C, "_scatter"): scatter, (torch._C, "_gather"): gather,
            (torch._C, "_broadcast"): broadcast,
            (torch._C, "_broadcast_coalesced"): broadcast_coalesced,
            (torch, "Stream"): Stream, (torch.Tensor, "record_stream"): _record_stream}


_RECORD_STREAM = torch.Tensor.record_stream


def _record_stream(tensor: torch.Tensor, stream: object) -> None:
    """``record_stream``: nothing for the virtual card's streams (they have no work pending)."""
    if not isinstance(stream, Stream):
        _RECORD_STREAM(tensor, stream)


def _on_the_card(devices: Sequence[int | None]) -> None:
    """Refuse devices other than the card's (DataParallel's replicas on several GPUs)."""
    card = card_device().index
    others = sorted({d for d in devices if d is not None and d >= 0 and d != card})  # -1: host
    if others:
        names = ", ".join(f"cuda:{d}" for d in (card, *others))
        raise VirtualGpuUnsupported(
            f"nn.DataParallel (torch.nn.parallel's scatter, gather and broadcast) across"
            f" {names}", f"the virtual GPU is one card, cuda:{card}", "leave DataParallel"
            f" its default device_ids, [{card}], or run memprof on a machine with the GPUs")


def scatter(tensor: torch.Tensor, devices: Sequence[int], chunk_sizes: Sequence[int] | None,
            dim: int, streams: object = None) -> list[torch.Tensor]:
    """``_scatter``: ``tensor`` in chunks along ``dim``, each on its device: a chunk already
    there is a view of ``tensor``, one on the host a copy (``comm.cpp``'s ``scatter``)."""
    _on_the_card(devices)
    chunks = (tensor.split(list(chunk_sizes), dim) if chunk_sizes is not None
              else tensor.chunk(len(devices), dim))
    card = card_device()
    return [c if c.device == card else c.to(card, non_blocking=True) for c in chunks]


def gather(tensors: Sequence[torch.Tensor], dim: int, destination: int | None) -> torch.Tensor:
    """``_gather``: one new tensor on ``destination`` (-1: the host) holding ``tensors``
    concatenated along ``dim``, channels-last where every input is."""
    _on_the_card([destination, *(t.get_device() for t in tensors)])
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.size(dim) for t in tensors)
    channels_last = all(t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
                        and not t.is_contiguous() for t in tensors)
    out = torch.empty(shape, dtype=tensors[0].dtype,
                      device="cpu" if destination == -1 else card_device(),
                      memory_format=torch.channels_last if channels_last
                      else torch.contiguous_format)
    start = 0
    for t in tensors:
        out.narrow(dim, start, t.size(dim)).copy_(t, non_blocking=True)
        start += t.size(dim)
    return out


def broadcast(tensor: torch.Tensor, devices: Sequence[int]) -> list[torch.Tensor]:
    """``_broadcast``: ``tensor`` on each device, itself where it already is."""
    _on_the_card(devices)
    card = card_device()
    return [tensor if tensor.device == card else tensor.to(card, copy=True) for _ in devices]


def broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[int],
                        buffer_size: int) -> list[list[torch.Tensor]]:
    """``_broadcast_coalesced``: the tensors, which must be on ``devices[0]``, for each
    device; on the first, the tensors themselves."""
    _on_the_card(devices)
    return [list(tensors) for _ in devices]
