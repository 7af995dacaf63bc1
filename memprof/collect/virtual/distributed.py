"""``torch.distributed`` on the virtual GPU: a real c10d backend whose collectives move no data.

    groups = ProcessGroups(install)      # install: how gpu.py sets (and later restores) names
    patches.update(groups.patches())     # by (module, attribute)

A script's ``init_process_group("nccl")`` (or "gloo", or none) gets a process group whose
backend, for every device, is PyTorch's own ``FakeProcessGroup`` (the C++ backend of
``torch.testing._internal.distributed.fake_pg``): each collective checks nothing, moves no
data and returns a completed ``Work``, so ``new_group``, ``DeviceMesh`` and its subgroups,
coalescing and ``barrier`` behave as on a card. It is registered for ``meta`` too: C++ sees
a virtual tensor's inside, and the functional collectives (DTensor's) run their kernels on
it, allocating their outputs as on a card. The ``c10d`` operators on virtual tensors
themselves return the caller's tensors and a ``Work`` whose future holds them
(``collectives.py``); objects go through the group's store (``objects.py``).

The rendezvous (``env://``, ``tcp://``, a store) is the script's own, so ranks started by
``memprof run --nproc-per-node`` or ``torchrun`` meet as they would. ``dist.get_backend()``
and ``get_backend_config()`` answer the backend the script asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from memprof.collect.virtual.objects import ObjectCollectives

BACKEND = "memprof_virtual"  # the registered name; the script sees the one it asked for
_DEVICES = ["cpu", "cuda", "meta"]


def _fake_backend(common: Any, options: Any) -> Any:
    """The c10d backend for one group: PyTorch's ``FakeProcessGroup`` of its rank and size."""
    from torch._C._distributed_c10d import FakeProcessGroup

    make = getattr(FakeProcessGroup, "_create_internal", FakeProcessGroup)  # torch < 2.8
    return make(common.group_rank, common.group_size)


class ProcessGroups:
    """Gives every process group the script makes the virtual backend (``patches``); with
    the first group, DTensor answers for virtual local tensors (``dtensors.py``, imported
    then: it is slow to import), patched by ``install`` as the other patches are."""

    def __init__(self, install: Callable[[dict[tuple[Any, str], Any]], None]) -> None:
        self._install = install
        self._grouped = False  # whether a group was made
        # the first group's (rank, size): the world of a process no launcher numbered
        self.world: tuple[int, int] | None = None

    def patches(self) -> dict[tuple[Any, str], Callable[..., Any]]:
        """The replacements, by (module, attribute); none without ``torch.distributed``."""
        if not dist.is_available():
            return {}
        if BACKEND.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND, _fake_backend, extended_api=True,
                                          devices=_DEVICES)
        return {(c10d, "_new_process_group_helper"):
                self._on_virtual_backend(c10d._new_process_group_helper),
                # NCCL's default timeout, which a build without NCCL warns it lacks
                (c10d, "default_pg_nccl_timeout"): c10d.default_pg_timeout,
                **ObjectCollectives().patches()}

    def _on_virtual_backend(self, helper: Callable[..., Any]) -> Callable[..., Any]:
        """``_new_process_group_helper`` making the group on the virtual backend, recorded
        under the backend the script asked for (``get_backend``, ``new_group``'s default)."""
        @functools.wraps(helper)
        def new_group(group_size: int, group_rank: int, global_ranks: list[int], backend: Any,
                      *args: Any, **kwargs: Any) -> Any:
            if not self._grouped:
                from memprof.collect.virtual.dtensors import dtensor_patches

                self._grouped = True
                self._install(dtensor_patches())
                self.world = (group_rank, group_size)
            pg, store = helper(group_size, group_rank, global_ranks, BACKEND, *args, **kwargs)
            if pg is not c10d.GroupMember.NON_GROUP_MEMBER and pg in c10d._world.pg_map:
                asked = str(backend)
                c10d._world.pg_map[pg] = (dist.Backend(asked), c10d._world.pg_map[pg][1])
                c10d._world.pg_backend_config[pg] = _config(asked)
            return pg, store
        return new_group


def _config(backend: str) -> str:
    """``get_backend_config``'s answer on a machine with GPUs."""
    if backend == dist.Backend.UNDEFINED:
        return "cuda:nccl"
    if ":" in backend:
        return backend
    return ",".join(f"{device}:{backend}"
                    for device in dist.Backend.backend_capability.get(backend, ["cpu", "cuda"]))
