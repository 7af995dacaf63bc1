"""How a run's model is spread over its GPUs, read from the modules and parameters the
hooks saw: the wrappers and strategies (DDP, FSDP1 with its sharding strategy, FSDP2's
``fully_shard``, DeepSpeed's engine with its ZeRO stage) and the device meshes its DTensor
parameters live on (FSDP2, tensor parallel, HSDP: their shape, dimension names and how
each dimension places the parameters), the dtype FSDP's mixed precision computes in and
DeepSpeed's reduce buckets; and the pipeline schedule (``torch.distributed.pipelining``)
that ran a forward.

    parallelism(modules)  # {"strategies": ["fsdp2"], "meshes": [{"shape": [8], ...}]}
    pipeline_of(frame)    # {"strategies": ["pipeline"], "pipeline": {"schedule": ...}}
"""

from __future__ import annotations

from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch

from memprof.trace.model import HYBRID_STRATEGIES


def parallelism(modules: Iterable[torch.nn.Module]) -> dict[str, Any] | None:
    """``run.model.parallelism`` (JSON-ready), or None for a model on one GPU."""
    strategies: set[str] = set()
    meshes: dict[tuple[Any, ...], dict[str, Any]] = {}
    computes: set[str] = set()
    buckets: dict[str, Any] | None = None  # DeepSpeed's gradient-reduction buckets
    for module in modules:
        strategy = _strategy(module)
        if strategy is not None:
            strategies.add(strategy)
            computes.update(_param_dtype(module))
        if strategy is not None and strategy.startswith("deepspeed"):
            buckets = _deepspeed_buckets(module)
        if strategy in HYBRID_STRATEGIES:  # FSDP1's replica and shard groups: a 2-D mesh
            replicas, shards = (_group_size(module, name)
                                for name in ("_inter_node_pg", "process_group"))
            if replicas and shards:
                placements = ["Replicate()", "Shard(dim=0)"]
                meshes.setdefault(((replicas, shards), (), tuple(placements)), {
                    "shape": [replicas, shards], "dims": [], "placements": placements})
        for p in module.parameters(recurse=False):
            mesh = getattr(p, "device_mesh", None)  # a DTensor's
            if mesh is not None:
                names = list(mesh.mesh_dim_names or [])
                # how each dimension holds it: Replicate() first is HSDP's replicas
                placements = [repr(placement) for placement in p.placements]
                meshes.setdefault((tuple(mesh.shape), tuple(names), tuple(placements)),
                                  {"shape": list(mesh.shape), "dims": names,
                                   "placements": placements})
    if not strategies and not meshes:
        return None
    found: dict[str, Any] = {"strategies": sorted(strategies), "meshes": list(meshes.values())}
    if len(computes) == 1:
        found["param_dtype"] = computes.pop()
    if buckets:
        found["deepspeed"] = buckets
    return found


FSDP_PACKAGE = "torch.distributed.fsdp"


def merged(seen: dict[str, Any] | None, now: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two ``parallelism`` facts of one run as one: every strategy and mesh either saw."""
    if seen is None or now is None:
        return now or seen
    meshes = list(seen["meshes"])
    meshes += [mesh for mesh in now["meshes"] if mesh not in meshes]
    both = {"strategies": sorted({*seen["strategies"], *now["strategies"]}), "meshes": meshes}
    for key in ("param_dtype", "pipeline", "deepspeed"):
        if value := now.get(key) or seen.get(key):
            both[key] = value
    return both


PIPELINE = "pipeline"
_SCHEDULES = "/torch/distributed/pipelining/schedules.py"


def pipeline_of(frame: FrameType | None, depth: int = 40) -> dict[str, Any] | None:
    """The ``parallelism`` fact of the pipeline schedule whose step runs ``frame`` (a
    module's forward), within ``depth`` frames: its class, microbatches, the stages of the
    pipeline and the first this rank runs; None outside one."""
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_filename.replace("\\", "/").endswith(_SCHEDULES):
            schedule = frame.f_locals.get("self")
            stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
            index = getattr(stages[0], "stage_index", None)
            if isinstance(index, int) and hasattr(schedule, "_n_microbatches"):
                return {"strategies": [PIPELINE], "meshes": [], "pipeline": {
                    "schedule": type(schedule).__name__,
                    "microbatches": int(schedule._n_microbatches),
                    "stages": int(schedule._num_stages), "stage": index}}
        frame = frame.f_back
    return None


def model_class(module: torch.nn.Module) -> type:
    """The class the script defined ``module`` as: FSDP2's ``fully_shard`` gives a module a
    class of its own, ``FSDP<Name>``, a subclass of ``FSDPModule`` and the script's class."""
    cls = type(module)
    if cls.__module__.startswith(FSDP_PACKAGE) and any(
            base.__name__ == "FSDPModule" for base in cls.__mro__[1:]):
        return next((base for base in cls.__mro__[1:]
                     if not base.__module__.startswith(FSDP_PACKAGE)), cls)
    return cls


def is_wrapper(module: torch.nn.Module) -> bool:
    """Whether ``module`` is torch.distributed's wrapper of the script's module (FSDP1's
    units, DDP, the checkpoint wrapper), not a block of the model."""
    return model_class(module).__module__.startswith("torch.distributed.")


def _strategy(module: torch.nn.Module) -> str | None:
    """What ``module`` is, by its class's name (no distributed module imported)."""
    names = {cls.__name__ for cls in type(module).__mro__}
    if "FullyShardedDataParallel" in names:  # (suggest's FSDP made for DDP is both)
        strategy = getattr(module, "sharding_strategy", None)
        return f"fsdp1:{getattr(strategy, 'name', 'unknown').lower()}"
    if "DistributedDataParallel" in names:
        return "ddp"
    if "FSDPModule" in names:
        return "fsdp2"
    if "DeepSpeedEngine" in names:
        stage = getattr(module, "zero_optimization_stage", None)
        return f"deepspeed:zero{stage()}" if callable(stage) else "deepspeed"
    return None


def _deepspeed_buckets(engine: torch.nn.Module) -> dict[str, Any] | None:
    """A DeepSpeed engine's gradient-reduction buckets: ``reduce_bucket_size`` (elements)
    and ``overlap_comm`` (ZeRO-1/2 double them), as its config set them."""
    try:
        size, overlap = engine.zero_reduce_bucket_size(), engine.zero_overlap_comm()
    except (AttributeError, TypeError, KeyError):
        return None
    return {"reduce_bucket_size": int(size), "overlap_comm": bool(overlap)}


def _param_dtype(module: torch.nn.Module) -> list[str]:
    """The dtype FSDP's mixed precision computes ``module`` in (FSDP1's ``MixedPrecision``,
    FSDP2's ``MixedPrecisionPolicy``), if it sets one."""
    policy = getattr(module, "mixed_precision", None)  # FSDP1's
    state = getattr(module, "_get_fsdp_state", None)  # FSDP2's
    if policy is None and callable(state):
        policy = getattr(state(), "_mp_policy", None)
    dtype = getattr(policy, "param_dtype", None)
    return [str(dtype).removeprefix("torch.")] if isinstance(dtype, torch.dtype) else []


def _group_size(module: torch.nn.Module, name: str) -> int | None:
    """The size of the process group FSDP1 keeps as ``name``, if it keeps one."""
    group = module.__dict__.get(name)
    size = getattr(group, "size", None)
    return size() if callable(size) else None

