"""Remedies that spread the model state over GPUs.

A single-process run cannot be re-run sharded (its script does not shard), so ``--gpus N``
gives the ZeRO paper's formulas. A rank of a distributed run changes its own strategy, and
``--verify`` measures each by re-running the world on virtual cards with the change applied
(``collect/launch/apply_distributed.py``): DDP's gradients as views of its buckets, FSDP
instead of DDP over the same GPUs, FULL_SHARD instead of SHARD_GRAD_OP, FSDP's CPU
offload, FSDP over every GPU instead of HSDP, and (``--gpus N``) the same run over N GPUs.
"""

from __future__ import annotations

from dataclasses import replace

from memprof.advise.peak import Peak
from memprof.advise.remedy import SEEDS, Context, Remedy
from memprof.trace.model import (
    COMMUNICATION,
    GRADIENTS,
    HYBRID_STRATEGIES,
    OPTIMIZER_STATE,
    PARAMETERS,
    TEMPORARIES,
)

# what each strategy shards over the data-parallel world (run.model.parallelism)
SHARDED = {
    "fsdp2": (PARAMETERS, GRADIENTS, OPTIMIZER_STATE),
    "fsdp1:full_shard": (PARAMETERS, GRADIENTS, OPTIMIZER_STATE),
    "fsdp1:hybrid_shard": (PARAMETERS, GRADIENTS, OPTIMIZER_STATE),
    "fsdp1:shard_grad_op": (GRADIENTS, OPTIMIZER_STATE),
    "deepspeed:zero3": (PARAMETERS, GRADIENTS, OPTIMIZER_STATE),
    "deepspeed:zero2": (GRADIENTS, OPTIMIZER_STATE),
    "deepspeed:zero1": (OPTIMIZER_STATE,),
}
GATHERED_UNITS = 2  # FSDP holds the unit it computes and the one it prefetches
UNIT_GRADIENTS = 2  # in backward, a unit's unsharded gradient and FSDP1's padded copy of it
SEED = SEEDS["000"]


def sharding_remedies(peak: Peak, ctx: Context) -> list[Remedy]:
    """The sharding remedies that apply to this run."""
    if not peak.at_step[PARAMETERS]:
        return []
    if ctx.world_size > 1:
        return _distributed(peak, ctx)
    return _zero_formulas(ctx) if ctx.gpus > 1 else []


def _distributed(peak: Peak, ctx: Context) -> list[Remedy]:
    strategies = set((ctx.model.get("parallelism") or {}).get("strategies") or ())
    return ((_ddp(peak, ctx) if strategies == {"ddp"} else [])
            + (_full_shard(ctx) if strategies == {"fsdp1:shard_grad_op"} else [])
            + _offload(ctx, strategies) + _flat_mesh(ctx) + _more_gpus(ctx, strategies))


def _full_shard(ctx: Context) -> list[Remedy]:
    share = min(1.0, GATHERED_UNITS / (ctx.block or {}).get("count", 1))
    return [Remedy(
        "full_shard", "FSDP FULL_SHARD instead of SHARD_GRAD_OP", "sharding", 6,
        "communication: parameters gathered again in backward", SEED,
        f"between forward and backward {GATHERED_UNITS} units' parameters gathered, not"
        " every unit's",
        lambda p: _regathered(p, share),
        "FullyShardedDataParallel(model, ..., sharding_strategy=ShardingStrategy.FULL_SHARD)",
        {"shard": "FULL_SHARD", "units": _units(ctx)})]


def _offload(ctx: Context, strategies: set[str]) -> list[Remedy]:
    if not any(s == "fsdp2" or s.startswith("fsdp1:") for s in strategies):
        return []
    return [Remedy(
        "fsdp_offload", "FSDP CPU offload of the shards", "offload", 9,
        "time: each unit's shard crosses PCIe before its all-gather and its gradient"
        " after its reduce-scatter; the optimizer steps on the CPU; host RAM for the"
        " shards and the optimizer state", SEED,
        "the rank's parameter, gradient and optimizer-state shards and the optimizer"
        " step's temporaries stay on the host; the gathered units, and in backward a"
        " unit's gradient, stay on the card; so do, once, the parameters the script puts on"
        f" the card before FSDP shards them (at most {ctx.parameters_peak:,} bytes here)",
        lambda p: _on_host(p, _unit_bytes(ctx), ctx.parameters_peak),
        _offload_snippet(ctx, strategies),
        {"offload": True})]


def _flat_mesh(ctx: Context) -> list[Remedy]:
    hybrid, world = _hsdp_mesh(ctx), ctx.world_size
    if hybrid is None:
        return []
    replicas, shards = hybrid
    return [Remedy(
        "fsdp_flat_mesh", f"FSDP over all {world} GPUs instead of HSDP ({replicas}"
        f" replicas of {shards})", "sharding", 6,
        "communication: all-gathers and reduce-scatters span every GPU (across nodes),"
        " not one replica group", SEED,
        f"parameters, gradients and optimizer state split {world} ways instead of {shards}",
        lambda p: p.scaled(dict.fromkeys((PARAMETERS, GRADIENTS, OPTIMIZER_STATE),
                                         shards / world)),
        _flat_mesh_snippet(ctx), {"flat_mesh": True})]


def _flat_mesh_snippet(ctx: Context) -> str:
    """FSDP over every GPU, in the terms of the FSDP the run uses."""
    strategies = set((ctx.model.get("parallelism") or {}).get("strategies") or ())
    if strategies & set(HYBRID_STRATEGIES):
        return ("model = FullyShardedDataParallel(model, ...,  # no device_mesh, one group\n"
                "    sharding_strategy=ShardingStrategy.FULL_SHARD)  # not HYBRID_SHARD")
    return ("# the mesh fully_shard gets: one dimension of every rank, not (replicas, shards)\n"
            f'mesh = init_device_mesh("cuda", ({ctx.world_size},))\n'
            "fully_shard(module, mesh=mesh)")


def _more_gpus(ctx: Context, strategies: set[str]) -> list[Remedy]:
    sharded = set().union(*(SHARDED.get(s, ()) for s in strategies))
    n, world = ctx.gpus, ctx.world_size
    if n <= world or not sharded:
        return []
    return [Remedy(
        f"world_{n}", f"the same run over {n} GPUs", "gpus", 7,
        f"infrastructure: {n} GPUs instead of {world}", SEED,
        f"{', '.join(sorted(c.replace('_', ' ') for c in sharded))} split {n} ways instead"
        f" of {world}; the batch per GPU as now",
        lambda p: p.scaled(dict.fromkeys(sharded, world / n)),
        f"torchrun --nproc-per-node {n} ...  # or more nodes: {n} ranks in all",
        {"world": n})]


def _ddp(peak: Peak, ctx: Context) -> list[Remedy]:
    world, units = ctx.world_size, _units(ctx)
    found = []
    buckets = peak.at_step[COMMUNICATION]
    if buckets >= 0.5 * peak.at_step[GRADIENTS]:  # not views of the buckets already
        found.append(Remedy(
            "bucket_view", "DDP gradient_as_bucket_view=True", "ddp", 1,
            "none (gradients become views into DDP's buckets)", SEED,
            "DDP's buckets hold a copy of the gradients; as views of them, no second copy",
            lambda p: p.with_state(COMMUNICATION, -min(buckets, p.at_step[GRADIENTS])),
            _bucket_view_snippet(ctx), {"bucket_view": True}))
    model, unit = _model_bytes(ctx), _unit_bytes(ctx)
    for strategy, full, what in (("SHARD_GRAD_OP", False, "gradients and optimizer state"),
                                 ("FULL_SHARD", True, "parameters, gradients and optimizer"
                                  " state")):
        # gathered in forward: the units computed (FULL_SHARD) or every unit (SHARD_GRAD_OP)
        gathered = min(model, GATHERED_UNITS * unit) if full else model
        found.append(Remedy(
            f"fsdp_{strategy.lower()}", f"FSDP {strategy} instead of DDP over the {world} GPUs",
            "sharding", 6 + full, "communication: "
            + ("parameters gathered for each unit, " if full else "")
            + "gradients reduce-scattered", SEED,
            f"{what} split {world} ways (each rank also keeps a shard of the parameters);"
            f" DDP's buckets gone; {'units' if full else 'all'} of the parameters gathered"
            f" between forward and backward ({gathered:,} bytes); a unit's gradient and"
            " FSDP's padded copy of it held in backward",
            lambda p, g=gathered: _sharded(p, world, g, UNIT_GRADIENTS * unit),
            _fsdp_snippet(ctx, strategy, units),
            {"shard": strategy, "units": units}))
    return found


def _bucket_view_snippet(ctx: Context) -> str:
    """DDP's gradients as views of its buckets, in the terms of the loop's library."""
    if ctx.loop == "accelerate":
        return ("from accelerate import Accelerator, DistributedDataParallelKwargs\n\n"
                "accelerator = Accelerator(..., kwargs_handlers=[\n"
                "    DistributedDataParallelKwargs(gradient_as_bucket_view=True)])")
    if ctx.lightning:
        call, strategies = ctx.lightning
        return (f"from {strategies} import DDPStrategy\n\n"
                f"{call}..., strategy=DDPStrategy(gradient_as_bucket_view=True))")
    return "model = DistributedDataParallel(model, gradient_as_bucket_view=True)"


def _fsdp_snippet(ctx: Context, strategy: str, units: list[str]) -> str:
    """FSDP with ``strategy`` in the terms of the library whose loop runs the training."""
    if ctx.loop == "transformers":
        wrap = f", fsdp_config={{'transformer_layer_cls_to_wrap': {units}}}" if units else ""
        return (f'TrainingArguments(..., fsdp="{strategy.lower()} auto_wrap"{wrap})'
                "  # DDP no more")
    if ctx.loop == "accelerate":
        wrap = (f'auto_wrap_policy="transformer_based_wrap",\n    transformer_cls_names_to_wrap='
                f"{units}, " if units else "")
        return ("from accelerate import Accelerator, FullyShardedDataParallelPlugin\n\n"
                "accelerator = Accelerator(..., fsdp_plugin=FullyShardedDataParallelPlugin(\n"
                f'    {wrap}sharding_strategy="{strategy}"))')
    if ctx.lightning:
        call, strategies = ctx.lightning
        policy = f"auto_wrap_policy={{{units[0]}}}, " if units else ""
        return (f"from {strategies} import FSDPStrategy\n\n"
                f'{call}..., strategy=FSDPStrategy({policy}sharding_strategy="{strategy}"))')
    wrap = f"ModuleWrapPolicy({{{units[0]}}})" if units else "None  # the model one unit"
    return ("from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy\n"
            "from torch.distributed.fsdp.wrap import ModuleWrapPolicy\n\n"
            f"model = FullyShardedDataParallel(model, auto_wrap_policy={wrap},\n"
            f"    sharding_strategy=ShardingStrategy.{strategy}, use_orig_params=True,\n"
            "    device_id=torch.cuda.current_device())  # instead of DistributedDataParallel")


def _on_host(p: Peak, unit: int, loaded: int) -> Peak:
    """``p`` with FSDP's shards and the optimizer's step on the host; in backward the card
    still holds the gradient of the ``unit`` being reduce-scattered, before it leaves; and
    the ``loaded`` parameter bytes the script put on the card before FSDP sharded them
    are there once still."""
    q = _step_temporaries(p.scaled({PARAMETERS: 0, GRADIENTS: 0, OPTIMIZER_STATE: 0}), 0)
    return replace(q.added(GRADIENTS, min(p.at_peak[GRADIENTS], unit)),
                   floor=max(p.floor, loaded))


def _step_temporaries(p: Peak, share: float) -> Peak:
    """``p`` with ``share`` of the optimizer step's temporaries (they follow the state the
    step updates)."""
    return replace(p, at_step={**p.at_step, TEMPORARIES: int(p.at_step[TEMPORARIES] * share)})


def _offload_snippet(ctx: Context, strategies: set[str]) -> str:
    """FSDP's CPU offload in the terms of the loop's library, else of the FSDP in use."""
    if ctx.loop == "transformers":
        return 'TrainingArguments(..., fsdp="full_shard offload auto_wrap")'
    if ctx.loop == "accelerate":
        return ("accelerator = Accelerator(..., fsdp_plugin=FullyShardedDataParallelPlugin(\n"
                "    ..., cpu_offload=True))")
    if ctx.lightning:
        return f"{ctx.lightning[0]}..., strategy=FSDPStrategy(..., cpu_offload=True))"
    if "fsdp2" in strategies:
        return ("from torch.distributed.fsdp import CPUOffloadPolicy\n\n"
                "# in every fully_shard call (the optimizer then steps on the CPU)\n"
                "fully_shard(module, ..., offload_policy=CPUOffloadPolicy())")
    return ("from torch.distributed.fsdp import CPUOffload\n\n"
            "model = FullyShardedDataParallel(model, ...,"
            " cpu_offload=CPUOffload(offload_params=True))")


def _hsdp_mesh(ctx: Context) -> tuple[int, int] | None:
    """(replicas, shards) of an HSDP run's mesh (FSDP2 on a 2-D mesh, FSDP1's
    HYBRID_SHARD): two dimensions, the parameters replicated over the first and sharded
    over the second; None for any other run."""
    facts = ctx.model.get("parallelism") or {}
    strategies = set(facts.get("strategies") or ())
    if not strategies & {"fsdp2", *HYBRID_STRATEGIES}:
        return None
    for mesh in facts.get("meshes") or ():
        placements = mesh.get("placements") or []
        if len(mesh["shape"]) == 2 and placements[:1] == ["Replicate()"] \
                and str(placements[-1]).startswith("Shard"):
            return mesh["shape"][0], mesh["shape"][1]
    return None


def _units(ctx: Context) -> list[str]:
    """The FSDP units a sharding remedy wraps: the largest repeated block's class."""
    return [ctx.block["class"]] if ctx.block else []


def _model_bytes(ctx: Context) -> int:
    """The model's parameters' bytes, whole."""
    return int(ctx.model.get("parameter_bytes") or 4 * (ctx.model.get("parameters") or 0))


def _unit_bytes(ctx: Context) -> int:
    """The parameters' bytes of one FSDP unit: the largest repeated block (the whole model
    where no block repeats)."""
    params = int(ctx.model.get("parameters") or 0)
    if not ctx.block or not params:
        return _model_bytes(ctx)
    return int(ctx.block["parameters_each"] * _model_bytes(ctx) / params)


def _sharded(p: Peak, world: int, gathered: int, gradients: int) -> Peak:
    """``p`` (a DDP rank's) under FSDP over ``world`` ranks: parameters, gradients and
    optimizer state sharded, and the step's temporaries with them; DDP's buckets gone;
    ``gathered`` parameters and a unit's ``gradients`` held at the activation moment."""
    factors = {PARAMETERS: 1 / world, GRADIENTS: 1 / world, OPTIMIZER_STATE: 1 / world,
               COMMUNICATION: 0}
    q = _step_temporaries(p.scaled(factors), 1 / world)
    return q.added(COMMUNICATION, gathered).added(TEMPORARIES, gradients)


def _regathered(p: Peak, share: float) -> Peak:
    """``p`` holding ``share`` of the gathered parameters it holds at the activation moment
    (every unit's, under SHARD_GRAD_OP)."""
    return replace(p, at_peak={**p.at_peak,
                               COMMUNICATION: int(p.at_peak[COMMUNICATION] * share)})


def _zero_formulas(ctx: Context) -> list[Remedy]:
    n = ctx.gpus
    stages = (
        (1, {OPTIMIZER_STATE: 1 / n}, "optimizer state"),
        (2, {OPTIMIZER_STATE: 1 / n, GRADIENTS: 1 / n}, "optimizer state and gradients"),
        (3, {OPTIMIZER_STATE: 1 / n, GRADIENTS: 1 / n, PARAMETERS: 1 / n},
         "optimizer state, gradients and parameters"))
    snippets = {
        1: "from torch.distributed.optim import ZeroRedundancyOptimizer\n\n"
           "optimizer = ZeroRedundancyOptimizer(model.parameters(),"
           " optimizer_class=torch.optim.AdamW, lr=lr)",
        2: 'ds_config = {"zero_optimization": {"stage": 2}}',
        3: "from torch.distributed.fsdp import fully_shard\n\n"
           "for module in model.modules():\n"
           f"    if type(module).__name__ == {(ctx.block or {}).get('class', 'Block')!r}:\n"
           "        fully_shard(module)\nfully_shard(model)"}
    return [Remedy(
        f"zero_{stage}", f"ZeRO-{stage}{' / FSDP' if stage == 3 else ''} over {n} GPUs",
        "sharding", 6 + stage, f"infrastructure: {n} GPUs and their communication",
        SEED, f"{what} split {n} ways (ZeRO paper: per GPU"
        f" {['4P + 12P/N', '2P + 14P/N', '16P/N'][stage - 1]} bytes of mixed-precision Adam"
        " state); the parameters of the layer being computed, gathered, are not counted",
        lambda p, f=factors: p.scaled(f), snippets[stage])
        for stage, factors, what in stages]
