"""The autograd engine's gradient accumulation, in place as it is on a real card.

When two gradients flow into the same input of a backward node, the engine sums them
(``InputBuffer::accumulate`` in ``torch/csrc/autograd/input_buffer.cpp``). With grad
mode off it adds the new gradient into the buffered one in place (``old.add_(new)``) when
the buffered one is a plain dense tensor that nothing else holds; otherwise it allocates
``old + new``. A tensor subclass, or any dispatch mode, makes it take the out-of-place
branch, so under the virtual GPU every accumulation would allocate a gradient-sized
block that the card never allocates. The recorder recognises the engine's ``add`` and
answers it with the buffered tensor itself: the card's in-place sum (values do not
exist, so nothing is computed).
"""

from __future__ import annotations

from types import FrameType

import torch

from memprof.collect.virtual.tensor import VirtualTensor

ADD = torch.ops.aten.add.Tensor
_DENSE = torch.ops.aten.is_non_overlapping_and_dense.default
# the original, not the virtual GPU's wrapper: the engine's C++ is called from this frame
# (torch 2.3+; before it, no accumulation is recognised)
_ENGINE = getattr(getattr(torch.autograd.graph, "_engine_run_backward", None), "__code__", None)


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


# a storage's use count when one tensor holds it (the Python storage object asked counts
# in some releases: 2 in torch 2.13, 1 in 2.6)
_UNSHARED = _use_count(torch.empty(1, device="meta"))


def accumulates_in_place(args: tuple, kwargs: dict, caller: FrameType | None) -> bool:
    """Whether ``aten.add(*args, **kwargs)``, called from ``caller``, is the engine summing
    two gradients that a real card sums in place."""
    if (kwargs or len(args) != 2 or caller is None or _ENGINE is None
            or caller.f_code is not _ENGINE):
        return False  # alpha given, or a Python backward's own add
    old, new = args
    if type(old) is not VirtualTensor or type(new) is not VirtualTensor or old is new:
        return False
    if torch.is_grad_enabled() or torch._C._current_graph_task_id() == -1:
        return False  # create_graph: the engine adds out of place
    if old.shape != new.shape or old.dtype != new.dtype:
        return False
    elem = old.elem
    return _DENSE(elem) and _use_count(elem) == _UNSHARED
