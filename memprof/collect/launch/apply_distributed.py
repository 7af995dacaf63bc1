"""Sharding remedies memprof applies to an unmodified distributed script, for ``memprof
suggest --verify`` (``MEMPROF_APPLY``, read by ``apply.py``):

- ``{"bucket_view": true}``: every ``DistributedDataParallel`` is made with
  ``gradient_as_bucket_view=True``;
- ``{"shard": "FULL_SHARD", "units": ["Block"]}``: every ``DistributedDataParallel(model,
  ...)`` is ``FullyShardedDataParallel(model, sharding_strategy=FULL_SHARD,
  auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True)`` instead (a wrapper
  with DDP's ``module`` and ``no_sync``), and every ``FullyShardedDataParallel`` the script
  makes itself gets that sharding strategy.

An optimizer made before the wrapper works as well: with ``use_orig_params`` FSDP keeps the
parameter objects, their data its shard.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memprof.collect.hooks.parallelism import model_class

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


@contextlib.contextmanager
def distributed_applied(asked: dict[str, Any]) -> Iterator[None]:
    """Apply the sharding remedies ``asked`` names for the duration of the block."""
    strategy, units = asked.get("shard"), asked.get("units") or []
    sharded = strategy in STRATEGIES and isinstance(units, list) \
        and all(isinstance(u, str) for u in units)
    if asked.get("bucket_view") is not True and not sharded:
        yield
        return
    import torch.nn.parallel as parallel
    import torch.nn.parallel.distributed as distributed
    from torch.distributed.fsdp import FullyShardedDataParallel

    ddp, fsdp_init = distributed.DistributedDataParallel, FullyShardedDataParallel.__init__
    if sharded:
        instead = _fsdp_instead(str(strategy), frozenset(units))
        FullyShardedDataParallel.__init__ = _with_strategy(fsdp_init, str(strategy))
    else:
        instead = _bucket_views(ddp)
    parallel.DistributedDataParallel = distributed.DistributedDataParallel = instead
    try:
        yield
    finally:
        parallel.DistributedDataParallel = distributed.DistributedDataParallel = ddp
        FullyShardedDataParallel.__init__ = fsdp_init


def _bucket_views(ddp: type) -> type:
    class DistributedDataParallel(ddp):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "gradient_as_bucket_view": True})
    return DistributedDataParallel


def _fsdp_instead(strategy: str, units: frozenset[str]) -> type:
    class DistributedDataParallel:  # a class, for isinstance checks: no model is one
        def __new__(cls, module: torch.nn.Module, *args: Any, **kwargs: Any
                    ) -> torch.nn.Module:  # type: ignore[misc]
            from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            classes = {type(m) for m in module.modules() if model_class(m).__name__ in units}
            device = next((p.device for p in module.parameters()), None)
            return FullyShardedDataParallel(
                module, sharding_strategy=ShardingStrategy[strategy], use_orig_params=True,
                auto_wrap_policy=ModuleWrapPolicy(classes) if classes else None,
                device_id=device if device is not None and device.type == "cuda" else None)
    return DistributedDataParallel


def _with_strategy(init: Callable[..., None], strategy: str) -> Callable[..., None]:
    def with_strategy(self: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        from torch.distributed.fsdp import ShardingStrategy

        if len(args) >= 2:  # process_group, sharding_strategy, ... given by position
            args = (args[0], ShardingStrategy[strategy], *args[2:])
        else:
            kwargs["sharding_strategy"] = ShardingStrategy[strategy]
        init(self, module, *args, **kwargs)
    return with_strategy
