"""The c10d collectives on virtual tensors: the caller's tensors back, and a completed Work.

``dist.all_reduce(t)``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, send and
recv, ... reach the dispatcher as ``c10d`` operators on the caller's tensors, which they
write in place: on a card the outputs are the caller's, and a collective allocates nothing
of its own but where NCCL does. NCCL's all-gather into a list of tensors gathers into one
flat tensor of them all (its ``Work`` holds it until the work is gone, then copies it out),
and its reduce-scatter from lists flattens its inputs first (``ProcessGroupNCCL.cpp``):
those buffers are made on the card for a group the script made over NCCL. Nothing is
exchanged (values are not there to exchange), so no backend is called: the operator returns
the caller's tensors and a ``Work`` whose future holds them, as NCCL's does (DDP's reducer
reads its buckets back from that future). A small tensor's values (``values.py``) follow PyTorch's
``FakeProcessGroup``: an all-gather copies this rank's input to every rank's slot, an
in-place reduction keeps this rank's values, any other output loses them; a broadcast's
come from its root, and a recv's from its sender, through the group's store
(``objects.py``), as checks that the ranks agree (DeepSpeed's) and pipeline schedules'
votes read them.

    if func in COLLECTIVES:
        return collective(func, args, on_card)  # on_card: a meta tensor made a card's
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_c10d = torch.ops.c10d


def _ops(*names: str) -> frozenset[Any]:
    """The ``c10d`` operators of these names that this torch has."""
    return frozenset(getattr(_c10d, n).default for n in names if hasattr(_c10d, n))


COLLECTIVES = _ops("allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_", "allgather_",
                   "_allgather_base_", "allgather_coalesced_",
                   "allgather_into_tensor_coalesced_", "reduce_scatter_",
                   "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "alltoall_",
                   "alltoall_base_", "gather_", "scatter_", "send", "recv_",
                   "recv_any_source_", "barrier", "monitored_barrier_")
_IN_PLACE = _ops("allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_", "send")
_GATHERS = _ops("allgather_", "_allgather_base_", "allgather_coalesced_",
                "allgather_into_tensor_coalesced_")
_NOTHING_WRITTEN = _ops("barrier", "monitored_barrier_")
_BROADCASTS = _ops("broadcast_")
_POINT_TO_POINT = _ops("send", "recv_")
_WORK = "Work"


def collective(func: torch._ops.OpOverload, args: tuple,
               on_card: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A ``c10d`` operator on virtual tensors: what it returns on a card, nothing moved;
    ``on_card`` makes a meta tensor a virtual tensor of the card (NCCL's own buffers)."""
    from torch._C._distributed_c10d import _create_work_from_future

    written = [] if func in _NOTHING_WRITTEN else args[0]
    group = _group(args)
    world = group.size() if group is not None else 1
    if func in _BROADCASTS:  # the root's small values, as a card's broadcast moves them
        from memprof.collect.virtual.objects import broadcast_values

        broadcast_values(group, args[2], _flat(written))
    _values(func, written, args[1] if func in _GATHERS else None, world)
    if func in _POINT_TO_POINT:  # the sender's small values, as a card's recv gets them
        from memprof.collect.virtual.objects import p2p_values

        p2p_values(func in _IN_PLACE, group, args[2], _flat(written))
    held = _flat(written)  # what the work's future holds
    if _over_nccl(group) and func in _FLATTENS and _same_size(args[_FLATTENS[func]][0]):
        listed = args[_FLATTENS[func]][0]
        flat = on_card(torch.empty((len(listed), *listed[0].shape), dtype=listed[0].dtype,
                                   device="meta"))
        held = [flat] if func in _GATHERS else held  # reduce-scatter's: freed at once
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(held)
    work = _create_work_from_future(future).boxed()  # the dispatcher's type
    returns = [work if _WORK in str(r.type) else written for r in func._schema.returns]
    if not returns:
        return None
    return returns[0] if len(returns) == 1 else tuple(returns)


# NCCL's collectives that flatten a list of tensors, and the argument holding the list
_LISTED_GATHER = _ops("allgather_")
_FLATTENS = {**dict.fromkeys(_LISTED_GATHER, 0), **dict.fromkeys(_ops("reduce_scatter_"), 1)}


def _group(args: tuple) -> Any:
    """The process group among an operator's arguments (the dispatcher boxes it)."""
    from torch._C._distributed_c10d import ProcessGroup

    for a in args:
        if isinstance(a, torch.ScriptObject):
            return ProcessGroup.unbox(a)
        if isinstance(a, ProcessGroup):
            return a
    return None


def _over_nccl(group: Any) -> bool:
    """Whether the script made ``group`` over NCCL (or left the backend to the device)."""
    import torch.distributed.distributed_c10d as c10d

    entry = c10d._world.pg_map.get(group) if group is not None else None
    return entry is not None and ("nccl" in str(entry[0]) or entry[0] == "undefined")


def _same_size(tensors: list[torch.Tensor]) -> bool:
    """``check_same_size``: NCCL flattens a list only of tensors of one size."""
    return bool(tensors) and all(t.shape == tensors[0].shape for t in tensors)


def _flat(tensors: Any) -> list[torch.Tensor]:
    """The tensors in an operator's argument (a tensor, a list, a list of lists)."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return [t for x in tensors for t in _flat(x)]


def _values(func: Any, written: Any, inputs: Any, world: int) -> None:
    """The host twins of what ``func`` wrote, as ``FakeProcessGroup`` leaves the data."""
    if func in _IN_PLACE:
        return
    sources = _flat(inputs) if inputs is not None else []  # an all-gather's input
    times = 1 if func in _LISTED_GATHER else world  # a copy in each output, or in one
    for out in _flat(written):
        if hasattr(out, "value"):
            out.value = _copy_of(sources[0], out.shape, times) if len(sources) == 1 else None


def _copy_of(source: torch.Tensor, shape: torch.Size, times: int) -> torch.Tensor | None:
    """``times`` copies of ``source``'s values in ``shape``, or None (it has none, or they
    do not fill it)."""
    value = getattr(source, "value", None)
    if value is None or value.numel() * times != shape.numel():
        return None
    return value.reshape(-1).repeat(times).reshape(shape)
