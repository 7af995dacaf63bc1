"""Sharding remedies memprof applies to an unmodified distributed script, for ``memprof
suggest --verify`` (``MEMPROF_APPLY``, read by ``apply.py``):

- ``{"bucket_view": true}``: every ``DistributedDataParallel`` is made with
  ``gradient_as_bucket_view=True``;
- ``{"shard": "FULL_SHARD", "units": ["Block"]}``: every ``DistributedDataParallel(model,
  ...)`` is ``FullyShardedDataParallel(model, sharding_strategy=FULL_SHARD,
  auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True)`` instead (a wrapper
  with DDP's ``module`` and ``no_sync``), and every ``FullyShardedDataParallel`` the script
  makes itself gets that sharding strategy;
- ``{"offload": true}``: FSDP keeps the shards on the host, ``fully_shard(...,
  offload_policy=CPUOffloadPolicy())`` and ``FullyShardedDataParallel(...,
  cpu_offload=CPUOffload(offload_params=True))``;
- ``{"flat_mesh": true}``: FSDP2 shards over every rank of an HSDP mesh it is given
  (``fully_shard(..., mesh=<2-D (replicas, shards)>)``): one dimension of them all; FSDP1's
  HYBRID_SHARD is FULL_SHARD over the default group;
- ``{"schedule": "Schedule1F1B"}``: a pipeline's ``ScheduleGPipe`` is that schedule of
  ``torch.distributed.pipelining`` instead (the same arguments);
- ``{"zero_buckets": N}``: every DeepSpeed config, however the script gives it (a dict, a
  file, Hugging Face's or Lightning's), has ZeRO's ``reduce_bucket_size`` and
  ``allgather_bucket_size`` at N elements where they were larger.

An optimizer made before the wrapper works as well: with ``use_orig_params`` FSDP keeps the
parameter objects, their data its shard.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memprof.collect.hooks.parallelism import model_class

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
SCHEDULES = ("Schedule1F1B",)  # what a pipeline's GPipe schedule may become
# where scripts import FSDP2's fully_shard from (the older path too)
FULLY_SHARD_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


@contextlib.contextmanager
def distributed_applied(asked: dict[str, Any]) -> Iterator[None]:
    """Apply the sharding remedies ``asked`` names for the duration of the block."""
    strategy, units = asked.get("shard"), asked.get("units") or []
    sharded = strategy in STRATEGIES and isinstance(units, list) \
        and all(isinstance(u, str) for u in units)
    views, offload = asked.get("bucket_view") is True, asked.get("offload") is True
    flat = asked.get("flat_mesh") is True
    schedule, buckets = asked.get("schedule"), asked.get("zero_buckets")
    if schedule in SCHEDULES:
        with _gpipe_as(str(schedule)):
            yield
        return
    if type(buckets) is int and buckets > 0:
        with _zero_buckets(buckets):
            yield
        return
    if not (sharded or views or offload or flat):
        yield
        return
    import torch.nn.parallel as parallel
    import torch.nn.parallel.distributed as distributed
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    patches: list[tuple[Any, str, Any]] = []
    ddp = distributed.DistributedDataParallel
    if sharded:
        instead = _fsdp_instead(str(strategy), frozenset(units))
        patches += [(parallel, "DistributedDataParallel", instead),
                    (distributed, "DistributedDataParallel", instead)]
    if sharded or offload or flat:
        patches.append((FullyShardedDataParallel, "__init__", _forced(
            FullyShardedDataParallel.__init__,
            ShardingStrategy[str(strategy)] if sharded else None, offload, flat)))
    if views and not sharded:
        viewed = _bucket_views(ddp)
        patches += [(parallel, "DistributedDataParallel", viewed),
                    (distributed, "DistributedDataParallel", viewed)]
    if offload or flat:
        for name in FULLY_SHARD_MODULES:
            with contextlib.suppress(ImportError):
                owner = importlib.import_module(name)
                patches.append((owner, "fully_shard",
                                _fully_shard_as(owner.fully_shard, offload, flat)))
    kept = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in reversed(kept):
            setattr(owner, name, value)


@contextlib.contextmanager
def _gpipe_as(name: str) -> Iterator[None]:
    """``ScheduleGPipe`` as the schedule ``name``, wherever a script imports it from."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import schedules

    instead, gpipe = getattr(schedules, name), schedules.ScheduleGPipe
    for owner in (pipelining, schedules):
        owner.ScheduleGPipe = instead  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for owner in (pipelining, schedules):
            owner.ScheduleGPipe = gpipe  # type: ignore[attr-defined]


@contextlib.contextmanager
def _zero_buckets(size: int) -> Iterator[None]:
    """DeepSpeed's configs with ZeRO's buckets at ``size`` elements at most."""
    from deepspeed.runtime.config import DeepSpeedConfig

    init = DeepSpeedConfig.__init__

    @functools.wraps(init)
    def smaller(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        zero = self.zero_config
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            if getattr(zero, name, 0) > size:
                setattr(zero, name, size)

    DeepSpeedConfig.__init__ = smaller
    try:
        yield
    finally:
        DeepSpeedConfig.__init__ = init


def _bucket_views(ddp: type) -> type:
    class DistributedDataParallel(ddp):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "gradient_as_bucket_view": True})
    return DistributedDataParallel


def _fsdp_instead(strategy: str, units: frozenset[str]) -> type:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    class DistributedDataParallel(FullyShardedDataParallel):  # type: ignore[misc]
        """FSDP made with DDP's arguments (the module alone is kept): an instance of the
        class the script (or its library: Lightning asserts it) asked for, answering what
        libraries read of a DDP model."""

        __module__ = FullyShardedDataParallel.__module__  # torch.distributed's wrapper
        static_graph = False

        def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            classes = {type(m) for m in module.modules() if model_class(m).__name__ in units}
            device = next((p.device for p in module.parameters()), None)
            super().__init__(
                module, sharding_strategy=ShardingStrategy[strategy], use_orig_params=True,
                auto_wrap_policy=ModuleWrapPolicy(classes) if classes else None,
                device_id=device if device is not None and device.type == "cuda" else None)

        def _get_ddp_logging_data(self) -> dict[str, Any]:
            return {}
    return DistributedDataParallel


def _forced(init: Callable[..., None], strategy: Any, offload: bool, flat: bool
            ) -> Callable[..., None]:
    """FullyShardedDataParallel's ``__init__`` with its sharding ``strategy`` (unless None)
    and CPU offload of the parameters (if ``offload``) forced, however they were given;
    with ``flat``, a hybrid strategy shards over every rank instead (its mesh or pair of
    groups gone: the default group)."""
    signature = inspect.signature(init)

    def forced(self: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        from torch.distributed.fsdp import CPUOffload, ShardingStrategy

        given = signature.bind_partial(self, module, *args, **kwargs).arguments
        hybrid = {ShardingStrategy.HYBRID_SHARD: ShardingStrategy.FULL_SHARD,
                  ShardingStrategy._HYBRID_SHARD_ZERO2: ShardingStrategy.SHARD_GRAD_OP}
        if flat and given.get("sharding_strategy") in hybrid:
            given["sharding_strategy"] = hybrid[given["sharding_strategy"]]
            given.pop("process_group", None)
            given.pop("device_mesh", None)
        if strategy is not None:
            given["sharding_strategy"] = strategy
        if offload:
            given["cpu_offload"] = CPUOffload(offload_params=True)
        init(**given)
    return forced


def _fully_shard_as(fully_shard: Callable[..., Any], offload: bool, flat: bool
                    ) -> Callable[..., Any]:
    """``fully_shard`` with the shards on the host (``offload``) and an HSDP mesh made one
    dimension of all its ranks (``flat``)."""
    flattened: dict[int, tuple[Any, Any]] = {}  # a mesh of the script's, its 1-D twin

    @functools.wraps(fully_shard)  # its attributes too (``fully_shard.state``)
    def as_asked(module: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy

        if offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        mesh = kwargs.get("mesh")
        if flat and mesh is not None and mesh.ndim == 2:
            if id(mesh) not in flattened:
                flattened[id(mesh)] = (mesh, init_device_mesh(mesh.device_type,
                                                              (mesh.size(),)))
            kwargs["mesh"] = flattened[id(mesh)][1]
        return fully_shard(module, *args, **kwargs)
    return as_asked
