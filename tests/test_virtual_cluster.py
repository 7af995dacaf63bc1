"""The virtual GPU cluster: torch.distributed on virtual tensors, and each rank's exact bytes.

In this process (the ``gpu`` fixture's card): rank R of a world of W over NCCL, on a store of
this process (no other rank is waited for: collectives exchange nothing), its collectives,
DDP's buckets and FSDP2's shards, every byte from first principles: a parameter's bytes,
rounded up to the caching allocator's 512-byte blocks. In processes: ``memprof run
--nproc-per-node 3`` and ``torchrun``, a report per rank with the same arithmetic, the answer
first on the console, explain/check/suggest of the run folder, and a world of one against
the single-GPU run.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import fsdp2  # a sample (conftest puts their folder on the path): its sharding
import pytest
import torch
import torch.distributed as dist
from common import build_mlp
from conftest import Jobs
from test_run_cli import F32, SAMPLES, block, memprof_here, memprof_run, report, run_python
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from memprof.collect.virtual.cards import parse_spec
from memprof.collect.virtual.gpu import VirtualGpu
from memprof.report.units import format_bytes

# torch 2.13 deprecates all_gather_into_tensor & co. for *_single, which older ones lack
pytestmark = [pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning"),
              pytest.mark.filterwarnings("ignore:FSDP2-wrapped module:UserWarning")]
MLP = {"hidden": 100, "layers": 2}  # Linear(64, 100), Linear(100, 100), Linear(100, 10)
SIZE = [f"--hidden={MLP['hidden']}", f"--layers={MLP['layers']}"]


def model_on_card() -> torch.nn.Sequential:
    return build_mlp(64, MLP["hidden"], MLP["layers"], 10).cuda()


def shapes() -> list[tuple[int, ...]]:
    """The sample MLP's parameter shapes, by unit (each Linear): weight, bias."""
    with torch.device("meta"):
        model = build_mlp(64, MLP["hidden"], MLP["layers"], 10)
    return [tuple(p.shape) for p in model.parameters()]


def numel(shape: tuple[int, ...], rows: int) -> int:
    """Elements of ``rows`` rows of a tensor of ``shape``."""
    return rows * (shape[1] if len(shape) > 1 else 1)


def padded_rows(rows: int, world: int) -> int:
    """FSDP2's rows per rank: dim 0 padded to a multiple of the world size, divided by it."""
    return -(-rows // world)


def own_rows(rows: int, world: int, rank: int) -> int:
    """The rows of dim 0 that are ``rank``'s own (the last ranks' shards may hold fewer)."""
    per = padded_rows(rows, world)
    return max(0, min(per, rows - rank * per))


@pytest.fixture
def group(gpu: VirtualGpu, request: pytest.FixtureRequest) -> Iterator[VirtualGpu]:
    """Rank R of W over NCCL (``request.param``: (R, W)), in this process."""
    rank, world = getattr(request, "param", (1, 3))
    dist.init_process_group("nccl", store=dist.HashStore(), rank=rank, world_size=world)
    try:
        yield gpu
    finally:
        dist.destroy_process_group()


# --- the backend and its collectives ----------------------------------------------------


def test_nccl_is_a_backend_whose_collectives_write_the_callers_tensors(group: VirtualGpu
                                                                       ) -> None:
    assert (dist.get_backend(), dist.get_rank(), dist.get_world_size()) == ("nccl", 1, 3)
    x = torch.ones(1024, device="cuda")
    outputs = [torch.empty_like(x) for _ in range(3)]
    before = torch.cuda.memory_allocated()
    for call in (lambda: dist.all_reduce(x), lambda: dist.broadcast(x, src=0),
                 lambda: dist.all_gather_into_tensor(torch.empty(3072, device="cuda"), x),
                 lambda: dist.reduce_scatter_tensor(x, torch.empty(3072, device="cuda")),
                 lambda: dist.all_to_all_single(torch.empty_like(x), x),
                 lambda: dist.all_to_all(outputs, [x, x, x]), dist.barrier,
                 lambda: dist.send(x, dst=0), lambda: dist.recv(x, src=0)):
        call()
    assert torch.cuda.memory_allocated() == before  # the outputs are the caller's tensors
    work = dist.all_reduce(x, async_op=True)
    assert work.wait() and work.is_completed() and work.get_future().wait()[0] is x
    dist.all_gather(outputs, torch.arange(1024.0, device="cuda"))
    assert outputs[2][:3].tolist() == [0.0, 1.0, 2.0]  # every rank sent this rank's values


def test_nccl_flattens_a_list_of_outputs_for_as_long_as_its_work_lives(group: VirtualGpu
                                                                       ) -> None:
    # ProcessGroupNCCL gathers a list of equal tensors into one flat tensor that its work
    # holds, and reduce-scatters a list of inputs from a flat copy of them
    x = torch.ones(1024, device="cuda")
    outputs = [torch.empty_like(x) for _ in range(3)]
    before = torch.cuda.memory_allocated()
    work = dist.all_gather(outputs, x, async_op=True)
    assert torch.cuda.memory_allocated() - before == 3 * block(1024 * F32)
    del work
    assert torch.cuda.memory_allocated() == before
    torch.cuda.reset_peak_memory_stats()
    dist.reduce_scatter(x, outputs)
    assert torch.cuda.memory_allocated() == before
    assert torch.cuda.max_memory_allocated() - before == 3 * block(1024 * F32)


@pytest.mark.parametrize("group", [(3, 4)], indirect=True)
def test_subgroups_device_meshes_and_functional_collectives(group: VirtualGpu) -> None:
    pair = dist.new_group([2, 3])
    assert dist.get_backend(pair) == "nccl" and pair.size() == 2
    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    assert mesh["tp"].size() == 2 and mesh.get_local_rank("dp") == 1
    from torch.distributed._functional_collectives import all_gather_tensor, wait_tensor

    x = torch.ones(256, device="cuda")
    before = torch.cuda.memory_allocated()
    gathered = wait_tensor(all_gather_tensor(x, 0, (mesh, 1)))  # a new tensor, as on a card
    assert gathered.shape == (512,) and gathered.is_cuda
    assert torch.cuda.memory_allocated() - before == block(512 * F32)


# --- DDP and FSDP2: each rank's bytes -------------------------------------------------------


@pytest.mark.parametrize("group", [(0, 2)], indirect=True)
def test_ddp_holds_every_gradient_in_one_bucket_until_it_learns_their_order(
        group: VirtualGpu) -> None:
    model = model_on_card()
    params = sum(p.numel() for p in model.parameters())
    before = torch.cuda.memory_allocated()
    ddp = DistributedDataParallel(model, device_ids=[0], gradient_as_bucket_view=True)
    assert torch.cuda.memory_allocated() - before == block(params * F32)  # one bucket
    ddp(torch.ones(4, 64, device="cuda")).sum().backward()
    storages = {p.grad.untyped_storage()._cdata for p in model.parameters()}
    assert len(storages) == 1  # every gradient is a view of the bucket
    assert next(iter(model.parameters())).grad.untyped_storage().nbytes() == params * F32


# world 8: rows 100, 100 and 10 pad to 13, 13 and 2 a rank; rank 5 owns none of the last
# weight's rows, rank 7 nine of the others'
@pytest.mark.parametrize("group", [(0, 3), (2, 3), (0, 8), (5, 8), (7, 8)], indirect=True)
def test_fsdp2_pads_each_weight_to_the_world_size_and_adam_keeps_the_ranks_own_rows(
        group: VirtualGpu) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = model_on_card()
    fsdp2.shard(model, torch.device("cuda", 0), world)
    # the full weights went; each rank holds a padded shard of each, a block of its own
    padded = [numel(s, padded_rows(s[0], world)) for s in shapes()]
    assert torch.cuda.memory_allocated() == sum(block(n * F32) for n in padded)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(4, 64, device="cuda")).sum().backward()
    before = torch.cuda.memory_allocated()
    optimizer.step()
    own = [numel(s, own_rows(s[0], world, rank)) for s in shapes()]
    # two moments of each parameter's own rows; a rank without rows of one has empty
    # moments, which take no block
    assert torch.cuda.memory_allocated() - before == sum(2 * block(n * F32) for n in own if n)
    assert [p.to_local().shape[0] for p in model.parameters()] == [
        own_rows(s[0], world, rank) for s in shapes()]


@pytest.mark.parametrize("group", [(1, 4)], indirect=True)
def test_fsdp2_of_a_model_made_on_the_meta_device_and_tensor_parallel_on_a_2d_mesh(
        group: VirtualGpu) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    with torch.device("meta"):  # torchtitan's way: shard first, then materialise and init
        model = build_mlp(64, MLP["hidden"], MLP["layers"], 10)
    fsdp2.shard(model, torch.device("cuda", 0), 4)
    assert torch.cuda.memory_allocated() == 0
    model.to_empty(device="cuda")
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.reset_parameters()  # DTensor's random operators, on the card
    padded = [numel(s, padded_rows(s[0], 4)) for s in shapes()]
    assert torch.cuda.memory_allocated() == sum(block(n * F32) for n in padded)
    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    parallelize_module(tp.cuda(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fsdp2.fully_shard(tp, mesh=mesh["dp"])
    tp(torch.ones(4, 64, device="cuda")).sum().backward()
    # tp halves a colwise weight's rows and a rowwise one's columns; dp then halves the rows
    assert [p.to_local().shape for p in tp.parameters()] == [(32, 64), (32,), (32, 64), (32,)]


def test_a_wrapper_gone_by_the_end_still_says_how_the_model_was_spread() -> None:
    """Hugging Face's Trainer wraps the model in DDP inside its loop: by the end of the
    script the wrapper is gone, and the model's facts, taken again then, keep it."""
    from memprof.collect.cpu.recorder import CpuRecorder
    from memprof.trace.model import AllocatorSettings

    virtual = VirtualGpu(parse_spec("H100"), AllocatorSettings())
    with CpuRecorder(virtual.recorder) as recorder, virtual:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=2)
        try:
            model = model_on_card()
            optimizer = torch.optim.AdamW(model.parameters())

            def train() -> None:
                wrapped = DistributedDataParallel(model)
                for _ in range(2):
                    wrapped(torch.ones(4, 64, device="cuda")).sum().backward()
                    optimizer.step()
            train()
        finally:
            dist.destroy_process_group()
    assert recorder.snapshot()["memprof"]["model"]["parallelism"] == {
        "strategies": ["ddp"], "meshes": []}


@pytest.mark.parametrize("group", [(2, 3), (7, 8)], indirect=True)
def test_fsdp1_shards_each_units_flat_parameter_padded_to_the_world_size(
        group: VirtualGpu) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    world = dist.get_world_size()
    model = FullyShardedDataParallel(model_on_card(), device_id=0,
                                     auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))
    units = [numel(w, w[0]) + b[0] for w, b in zip(shapes()[::2], shapes()[1::2], strict=True)]
    shards = [-(-n // world) for n in units]  # FULL_SHARD: a flat parameter per unit, padded
    assert [p.numel() for p in model.parameters()] == shards
    assert torch.cuda.memory_allocated() == sum(block(n * F32) for n in shards)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(4, 64, device="cuda")).sum().backward()
    before = torch.cuda.memory_allocated()
    optimizer.step()
    assert torch.cuda.memory_allocated() - before == sum(2 * block(n * F32) for n in shards)


@pytest.mark.parametrize("group", [(1, 4)], indirect=True)
@pytest.mark.parametrize(("strategy", "shard_over"), [
    ("FULL_SHARD", 4), ("SHARD_GRAD_OP", 4), ("NO_SHARD", 1), ("HYBRID_SHARD", 2)])
def test_fsdp1_holds_each_units_flat_parameter_divided_as_its_strategy_shards_it(
        group: VirtualGpu, strategy: str, shard_over: int) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    # HYBRID_SHARD: shards within a node (the mesh's second dimension), replicas across
    mesh = init_device_mesh("cuda", (2, 2)) if strategy == "HYBRID_SHARD" else None
    model = FullyShardedDataParallel(model_on_card(), device_id=0, device_mesh=mesh,
                                     sharding_strategy=ShardingStrategy[strategy],
                                     auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))
    units = [numel(w, w[0]) + b[0] for w, b in zip(shapes()[::2], shapes()[1::2], strict=True)]
    shards = [-(-n // shard_over) for n in units]
    assert [p.numel() for p in model.parameters()] == shards
    assert torch.cuda.memory_allocated() == sum(block(n * F32) for n in shards)
    from memprof.collect.hooks.parallelism import parallelism

    # HYBRID_SHARD's groups, replicas across and shards within: a (2, 2) mesh, as HSDP's
    hybrid = [{"shape": [2, 2], "dims": [], "placements": ["Replicate()", "Shard(dim=0)"]}]
    assert parallelism(model.modules()) == {"strategies": [f"fsdp1:{strategy.lower()}"],
                                            "meshes": hybrid if mesh else []}
    # FSDP1's units are its wrappers, not the model's blocks: none repeats here (the Linears
    # are leaves)
    from memprof.collect.hooks.model_facts import model_facts

    assert model_facts(model.modules(), [], None, {})["repeated_blocks"] == []
    # its unsharded flat parameter, whose views the module holds while gathered, is a
    # communication buffer (a parameter's category gives way too), as FSDP2's gathered ones
    from memprof.analysis.categories import communication_call
    from memprof.trace.model import PARAMETERS

    assert PARAMETERS in communication_call("/site-packages/torch/distributed/utils.py",
                                            "_alloc_storage")
    if mesh is not None:  # suggest's FSDP over every rank: shards of all 4, not of 2
        from memprof.collect.launch.apply_distributed import distributed_applied

        with distributed_applied({"flat_mesh": True}):
            flat = FullyShardedDataParallel(
                model_on_card(), device_id=0, device_mesh=init_device_mesh("cuda", (2, 2)),
                sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))
        assert [p.numel() for p in flat.parameters()] == [-(-n // 4) for n in units]


@pytest.mark.parametrize("group", [(1, 4)], indirect=True)
def test_fsdp2_gathers_a_unit_in_the_mixed_precision_dtype_and_reshards_it(
        group: VirtualGpu) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    layer = torch.nn.Linear(100, 64).cuda()  # weight (64, 100), bias (64,)
    fsdp2.fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    sharded = torch.cuda.memory_allocated()
    # fp32 shards: 64 rows pad to 16 a rank
    assert sharded == block(16 * 100 * F32) + block(16 * F32)
    torch.cuda.reset_peak_memory_stats()
    layer.unshard()
    # every rank's rows in bf16, one block per parameter; the flat all-gather output they
    # were copied out of is gone
    gathered = block(64 * 100 * 2) + block(64 * 2)
    assert torch.cuda.memory_allocated() - sharded == gathered
    assert torch.cuda.max_memory_allocated() - sharded == gathered + block((16 * 100 + 16) * 4 * 2)
    layer.reshard()
    assert torch.cuda.memory_allocated() == sharded
    from memprof.collect.hooks.parallelism import parallelism

    assert parallelism([layer])["param_dtype"] == "bfloat16"  # the dtype it computes in


@pytest.mark.parametrize("group", [(1, 4)], indirect=True)
def test_fsdp2_resharding_after_forward_to_a_smaller_world_keeps_that_worlds_shard(
        group: VirtualGpu) -> None:
    layer = torch.nn.Linear(100, 64).cuda()
    fsdp2.fully_shard(layer, reshard_after_forward=2)
    torch.ones(1, 1, device="cuda") @ torch.ones(1, 1, device="cuda")  # cuBLAS's workspace
    before = torch.cuda.memory_allocated()
    x = torch.ones(4, 100, device="cuda", requires_grad=True)
    y = layer(x)
    # after forward, a rank holds a shard of a world of 2: 64 rows pad to 32 a rank
    assert torch.cuda.memory_allocated() - before == block(x.nbytes) + block(y.nbytes) + block(
        32 * 100 * F32) + block(32 * F32)


@pytest.mark.parametrize("group", [(0, 2)], indirect=True)
def test_fsdp2_offloaded_to_the_host_holds_no_parameter_on_the_card(group: VirtualGpu) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    model = model_on_card()
    assert torch.cuda.memory_allocated() == sum(block(numel(s, s[0]) * F32) for s in shapes())
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            fsdp2.fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fsdp2.fully_shard(model, offload_policy=CPUOffloadPolicy())
    assert torch.cuda.memory_allocated() == 0  # the full weights went, the shards are the host's
    assert all(p.to_local().device.type == "cpu" for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(4, 64, device="cuda")).sum().backward()
    before = torch.cuda.memory_allocated()
    optimizer.step()  # on the host's shards and gradients: its moments are the host's too
    assert torch.cuda.memory_allocated() == before


@pytest.mark.parametrize("group", [(1, 4)], indirect=True)
def test_suggests_offload_keeps_fsdps_shards_on_the_host(group: VirtualGpu) -> None:
    """``{"offload": true}`` (suggest --verify's FSDP CPU offload): fully_shard, however the
    script imported it, keeps its shards on the host."""
    import torch.distributed._composable.fsdp as older
    import torch.distributed.fsdp as fsdp

    from memprof.collect.launch.apply_distributed import distributed_applied

    with distributed_applied({"offload": True}):
        two = model_on_card()
        for layer in two.modules():
            if isinstance(layer, torch.nn.Linear):
                older.fully_shard(layer)  # the older path scripts import it from
        fsdp.fully_shard(two)
        assert torch.cuda.memory_allocated() == 0  # every shard is the host's
    assert all(p.to_local().device.type == "cpu" for p in two.parameters())
    # FSDP1 is given its CPUOffload, by keyword or by position
    with distributed_applied({"offload": True}):
        one = fsdp.FullyShardedDataParallel(model_on_card(), None, device_id=0)
    assert one.cpu_offload.offload_params
    assert torch.cuda.memory_allocated() == 0


@pytest.mark.parametrize("group", [(1, 2)], indirect=True)
@pytest.mark.filterwarnings("error:The .grad attribute")  # memprof reads no non-leaf's
def test_fsdp_made_for_ddp_is_what_a_library_asked_for_and_moves_to_the_host(
        group: VirtualGpu) -> None:
    """suggest's FSDP instead of DDP, as Lightning's DDP strategy uses it: the model is an
    instance of the DistributedDataParallel it made, answers DDP's ``static_graph``, and
    ``module.cpu()`` at teardown moves each flat parameter to the host in place, keeping
    FSDP's attributes on it, as a card does."""
    import torch.nn.parallel as parallel
    from torch.distributed.fsdp import FullyShardedDataParallel

    from memprof.collect.launch.apply_distributed import distributed_applied

    with distributed_applied({"shard": "FULL_SHARD", "units": []}):
        ddp = parallel.DistributedDataParallel
        model = ddp(model_on_card(), device_ids=[0])
    assert isinstance(model, ddp) and isinstance(model, FullyShardedDataParallel)
    assert model.static_graph is False
    model(torch.ones(4, 64, device="cuda")).sum().backward()
    flat = sum(numel(s, s[0]) for s in shapes())
    before = torch.cuda.memory_allocated()
    model.cpu()
    # the gradient leaves the card; the shard stays, as on a card: FSDP's _local_shard
    # still holds it (cuBLAS's workspaces stay too)
    assert before - torch.cuda.memory_allocated() == block(F32 * -(-flat // 2))
    assert model._flat_param._local_shard.is_cuda
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model._flat_param._unpadded_unsharded_size == (flat,)


@pytest.mark.parametrize("group", [(1, 4)], indirect=True)
@pytest.mark.parametrize("orig", [False, True])
def test_fsdp1_offloaded_to_the_host_gathers_each_unit_on_the_card_and_steps_on_the_host(
        group: VirtualGpu, orig: bool) -> None:
    """FSDP1's CPUOffload moves its flat parameter between the host and the card in place,
    while the module holds views of it, as each unit is gathered and resharded (with the
    original parameters, those outside the rank's shard are given a real empty host
    tensor)."""
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FullyShardedDataParallel(model_on_card(), device_id=0,
                                     cpu_offload=CPUOffload(offload_params=True),
                                     auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                                     use_orig_params=orig)
    flats = [m._flat_param for m in FullyShardedDataParallel.fsdp_modules(model)
             if m._flat_param is not None]
    units = [numel(w, w[0]) + b[0] for w, b in zip(shapes()[::2], shapes()[1::2], strict=True)]
    shards = [-(-n // 4) for n in units]
    assert torch.cuda.memory_allocated() == 0  # every shard is the host's
    assert [(p.numel(), p.device.type) for p in flats] == [(n, "cpu") for n in shards]
    torch.cuda.reset_peak_memory_stats()
    x = torch.ones(4, 64, device="cuda")
    # a unit computes on its flat parameter gathered whole, padded to the world size, on
    # the card: the largest one is there at the peak
    model(x).sum().backward()
    assert torch.cuda.max_memory_allocated() >= block(x.nbytes) + max(
        block(4 * n * F32) for n in shards)
    assert [(p.grad.numel(), p.grad.device.type) for p in flats] == [
        (n, "cpu") for n in shards]
    before = torch.cuda.memory_allocated()
    torch.optim.AdamW(model.parameters()).step()  # on the host: its moments too
    assert torch.cuda.memory_allocated() == before
    assert all(p.device.type == "cpu" for p in [*flats, *model.parameters()])


@pytest.mark.parametrize("group", [(1, 4)], indirect=True)
def test_a_fully_sharded_block_keeps_the_scripts_class_name(group: VirtualGpu) -> None:
    """fully_shard gives a module a class of its own, FSDP<Name>: the repeated blocks,
    their checkpointing and their snippets name the script's class."""
    import torch.distributed.fsdp as fsdp

    from memprof.collect.hooks.parallelism import model_class

    class Block(torch.nn.Sequential):
        pass

    blocks = torch.nn.Sequential(*(Block(torch.nn.Linear(8, 8)) for _ in range(2))).cuda()
    for each in blocks:
        fsdp.fully_shard(each)
    assert type(blocks[0]).__name__ == "FSDPBlock" and model_class(blocks[0]) is Block
    assert model_class(blocks) is torch.nn.Sequential  # not sharded: its own class


@pytest.mark.parametrize("group", [(1, 4)], indirect=True)
def test_hsdp_is_seen_and_suggest_can_shard_it_over_every_rank(group: VirtualGpu) -> None:
    """HSDP (fully_shard on a (replicas, shards) mesh) holds each weight's rows over the
    shards alone; ``{"flat_mesh": true}`` (suggest's FSDP over every GPU) shards them over
    all 4 ranks, and the remedy's estimate divides the model state by 4 instead of 2."""
    import torch.distributed.fsdp as fsdp

    from memprof.advise.peak import peak_of
    from memprof.advise.remedies import Context
    from memprof.advise.sharding import sharding_remedies
    from memprof.collect.hooks.parallelism import parallelism
    from memprof.collect.launch.apply_distributed import distributed_applied
    from memprof.trace.model import GRADIENTS, OPTIMIZER_STATE, PARAMETERS

    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("replicate", "shard"))

    def sharded() -> torch.nn.Sequential:
        model = model_on_card()
        for layer in model.modules():
            if isinstance(layer, torch.nn.Linear):
                fsdp.fully_shard(layer, mesh=mesh)
        return fsdp.fully_shard(model, mesh=mesh)

    hybrid = sharded()
    assert [p.to_local().shape[0] for p in hybrid.parameters()] == [
        padded_rows(s[0], 2) for s in shapes()]
    facts = parallelism(hybrid.modules())
    assert facts == {"strategies": ["fsdp2"], "meshes": [
        {"shape": [2, 2], "dims": ["replicate", "shard"],
         "placements": ["Replicate()", "Shard(dim=0)"]}]}
    with distributed_applied({"flat_mesh": True}):
        flat = sharded()
    assert [p.to_local().shape[0] for p in flat.parameters()] == [
        padded_rows(s[0], 4) for s in shapes()]
    held = dict.fromkeys(("parameters", "gradients", "optimizer_state"), 1 << 20)
    device = {"categories": held, "peak": {"allocated_bytes": 3 << 20,
                                           "reserved_bytes": 3 << 20}}
    context = Context({"parallelism": facts, "parameters": 1}, world_size=4)
    (remedy,) = [r for r in sharding_remedies(peak_of(device), context)
                 if r.key == "fsdp_flat_mesh"]
    assert remedy.verify == {"flat_mesh": True}
    after = remedy.change(peak_of(device))
    assert [after.at_step[k] for k in (PARAMETERS, GRADIENTS, OPTIMIZER_STATE)] == [1 << 19] * 3


# --- ranks as processes: reports, the answer, explain, check and suggest -----------------

jobs = Jobs()


@jobs
def fsdp_cluster(where: Path) -> tuple[Any, Path]:
    out = where / "out"
    return memprof_run(where, "--nproc-per-node", "3", "-o", out, "--no-timeline",
                       SAMPLES / "fsdp2.py", *SIZE), out


@jobs
def fsdp_some_ranks(where: Path) -> tuple[Any, Path]:
    out = where / "out"
    return memprof_run(where, "--nproc-per-node", "8", "--ranks", "0,5-5,7", "-o", out,
                       "--no-timeline", SAMPLES / "fsdp2.py", *SIZE), out


OBJECTS = """\
import os, sys, torch
import torch.distributed as dist
dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
sent = [{"from": rank}] if rank == 0 else [None]
dist.broadcast_object_list(sent, src=0)
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, rank)
sizes = torch.tensor([rank * 10 + 7, -1], device="cuda")  # small: it holds values
dist.broadcast(sizes, src=0)
# one write: the ranks share the pipe
sys.stdout.write(f"rank {rank}: {sent[0]} {gathered} {sizes.tolist()}\\n")
"""


@jobs
def objects_every_rank(where: Path) -> Any:
    (where / "objects.py").write_text(OBJECTS)
    return memprof_run(where, "--nproc-per-node", "3", "-o", where / "out", "--no-timeline",
                       "objects.py")


@jobs
def objects_some_ranks(where: Path) -> Any:
    (where / "objects.py").write_text(OBJECTS)
    return memprof_run(where, "--nproc-per-node", "4", "--ranks", "0,3", "-o", where / "out",
                       "objects.py")


PIPELINE = """\
import os, sys, torch, torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)
D, ROWS, M = 256, 4096, 4  # features, rows a step, microbatches
sizes = [(D, D), (D, D)] if rank == 0 else [(D, D), (D, 10)]
stage_model = torch.nn.Sequential(*(torch.nn.Linear(*s) for s in sizes)).to(device)
stage = PipelineStage(stage_model, rank, world, device)  # the stages send their shapes
schedule = ScheduleGPipe(stage, M, loss_fn=torch.nn.functional.cross_entropy)
optimizer = torch.optim.AdamW(stage_model.parameters())
for step in range(2):
    x, y = torch.randn(ROWS, D, device=device), torch.randint(10, (ROWS,), device=device)
    losses = []
    schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)
    optimizer.step()
    optimizer.zero_grad()
sys.stdout.write(f"rank {rank}: {len(losses)} losses\\n")
"""


@jobs
def pipeline_stages(where: Path) -> tuple[Any, Path]:
    return two_ranks_of(where, PIPELINE)


ENDS_IN_FORWARD = """\
import torch, torch.distributed as dist, fsdp2
from common import build_mlp
dist.init_process_group("nccl")
with torch.device("meta"):  # torchtitan's way: shard, then materialise on the card
    model = build_mlp(64, 100, 2, 10)
fsdp2.shard(model, torch.device("cuda", 0), dist.get_world_size())
model.to_empty(device="cuda")
def fail(module, args):
    raise RuntimeError("stopped inside the forward")
model[2].register_forward_pre_hook(fail)  # the second unit's own gathered, the last's not
model(torch.ones(4, 64, device="cuda"))
"""


ACCUMULATED = """\
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
dist.init_process_group("nccl")
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(2)]).cuda()
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in model:
    fully_shard(layer, mp_policy=policy)
fully_shard(model, mp_policy=policy)
optimizer = torch.optim.AdamW(model.parameters())
for micro in range(2):  # gradient accumulation: the reduce-scatter at the last microbatch
    model.set_requires_gradient_sync(micro == 1)
    model(torch.ones(16, 1024, device="cuda")).float().sum().backward()
optimizer.step()
"""


@jobs
def fsdp_accumulated(where: Path) -> tuple[Any, Path]:
    return two_ranks_of(where, ACCUMULATED)


def two_ranks_of(where: Path, script: str, **env: str) -> tuple[Any, Path]:
    """``memprof run --nproc-per-node 2`` of ``script`` (its text; the samples' folder on
    the path) in ``where``, with ``env`` set: the result and the run folder."""
    (where / "script.py").write_text(script)
    out = where / "out"
    return run_python(["-m", "memprof", "run", "--nproc-per-node", "2", "-o", out,
                       "--no-timeline", "script.py"], where,
                      env={"PYTHONPATH": str(SAMPLES), **env}), out


@jobs
def fsdp_ends_in_forward(where: Path) -> tuple[Any, Path]:
    return two_ranks_of(where, ENDS_IN_FORWARD)


@jobs
def ddp_torchrun(where: Path) -> tuple[Any, Path]:
    out = where / "out"
    return run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "-m", "memprof", "run", "-o", out, "--no-timeline",
                       SAMPLES / "ddp.py", *SIZE], where), out


OPTIMIZER_FIRST = """\
import torch, torch.distributed as dist
from common import build_mlp
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("nccl")
model = build_mlp(64, 100, 2, 10).cuda()
optimizer = torch.optim.AdamW(model.parameters())  # before the wrapper, as DDP's tutorial
model = DistributedDataParallel(model)
for _ in range(2):
    model(torch.ones(4, 64, device="cuda")).sum().backward()
    optimizer.step()
"""


@jobs
def fsdp_instead_of_ddp(where: Path) -> tuple[Any, Path]:
    """DDP with suggest's remedy applied: FSDP FULL_SHARD, the model one unit."""
    return two_ranks_of(where, OPTIMIZER_FIRST,
                        MEMPROF_APPLY='{"shard": "FULL_SHARD", "units": []}')


@jobs
def one_rank(where: Path) -> tuple[Any, Any, Path]:
    return (memprof_run(where, "--nproc-per-node", "1", "-o", where / "cluster",
                        "--no-timeline", SAMPLES / "fsdp2.py", *SIZE),
            memprof_run(where, "-o", where / "alone", "--no-timeline", SAMPLES / "fsdp2.py",
                        *SIZE), where)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Any]]]:
    yield from jobs.started(tmp_path_factory, "cluster")


def fsdp2_rank_holds_its_shard(out: Path, stdout: str, rank: int, world: int) -> None:
    """Rank ``rank`` of the FSDP2 sample over ``world`` ranks: its shards, its moments of
    its own rows, its gradients and what it gathered."""
    units = [shapes()[i:i + 2] for i in range(0, len(shapes()), 2)]  # (weight, bias) each
    assert f"rank {rank}/{world}: loss" in stdout
    data = report(out / f"rank-{rank}")
    assert (data["run"]["rank"], data["run"]["world_size"]) == (rank, world)
    device = data["devices"][0]
    assert device["device"] == rank  # one node: the rank's card is cuda:LOCAL_RANK
    at_peak = device["categories_requested"]
    padded = sum(numel(s, padded_rows(s[0], world)) for s in shapes())
    own = sum(numel(s, own_rows(s[0], world, rank)) for s in shapes())
    assert at_peak["parameters"] == F32 * padded
    assert at_peak["optimizer_state"] == 2 * F32 * own  # the last ranks hold fewer rows
    # each unit's gradients: views of its reduce-scatter output, of the padded shards
    assert device["category_peaks"]["gradients"] == sum(
        block(F32 * sum(numel(s, padded_rows(s[0], world)) for s in unit)) for unit in units)
    # a unit gathered: each parameter's padded rows from every rank, and the flat
    # all-gather output it is copied out of; never more than every unit gathered at once
    # with one all-gather in flight
    gathered = [F32 * sum(numel(s, world * padded_rows(s[0], world)) for s in unit)
                for unit in units]
    assert device["category_peaks"]["communication"] >= max(gathered)
    assert 0 < at_peak["communication"] <= sum(gathered) + max(gathered)


def test_every_fsdp2_rank_holds_its_shard_and_the_answer_comes_first(
        runs: dict[str, Future[Any]]) -> None:
    result, out = runs["fsdp_cluster"].result()
    assert result.code == 0, result.stderr[-3000:]
    world = 3
    for rank in range(world):
        fsdp2_rank_holds_its_shard(out, result.stdout, rank, world)
    worst = max(report(out / f"rank-{r}")["devices"][0]["peak"]["reserved_bytes"]
                for r in range(world))
    lines = result.stderr.splitlines()
    answer = next(i for i, line in enumerate(lines) if line.startswith("fits: worst rank"))
    assert "(rank 0)" in lines[answer] and lines[answer + 1].split()[:2] == ["rank", "peak"]
    summary = report(out, "cluster.json")  # the whole run, as the console answered it
    assert (summary["schema"], summary["world_size"], summary["nodes"], summary["answer"],
            summary["worst_rank"]) == ("memprof.cluster/1", world, 1, lines[answer], 0)
    # fully_shard over the default mesh of the world
    assert summary["parallelism"] == {"strategies": ["fsdp2"], "meshes": [
        {"shape": [world], "dims": [], "placements": ["Shard(dim=0)"]}]}
    assert [(r["rank"], r["report"], r["peak_reserved_bytes"]) for r in summary["ranks"]] == [
        (r, f"rank-{r}/report.json",
         report(out / f"rank-{r}")["devices"][0]["peak"]["reserved_bytes"])
        for r in range(world)]
    assert "were not run" not in result.stderr  # every rank ran
    # what filled the cards, by category: ranks 0 and 1 hold the same bytes, rank 2 the
    # remainder's fewer moments
    moments = [2 * sum(block(F32 * n) for s in shapes() if (n := numel(s, own_rows(
        s[0], world, r)))) for r in range(world)]  # in the allocator's blocks
    assert moments[0] == moments[1] > moments[2]
    table = lines[lines.index("What was allocated at each rank's peak") + 1:]
    assert table[0].split() == ["ranks", "0-1", "rank", "2"]
    state = next(line for line in table if line.lstrip().startswith("optimizer state"))
    assert state.split()[2:] == [*format_bytes(moments[0]).split(),
                                 *format_bytes(moments[2]).split()]
    assert [r["categories"] for r in summary["ranks"]] == [
        report(out / f"rank-{r}")["devices"][0]["categories"] for r in range(world)]
    # what it cannot see, it says: on the console and in the file
    assert summary["not_counted"][0].startswith("NCCL's own buffers")
    assert "NCCL's own buffers and each communicator's memory are outside" in result.stderr
    assert worst > 0 and lines[-1] == f"Next: memprof explain {out}"


def test_pipeline_stages_send_each_other_their_shapes_and_hold_their_own_layers(
        runs: dict[str, Future[Any]]) -> None:
    """``torch.distributed.pipelining`` as its documentation teaches it: a stage per rank,
    shapes inferred by sending them (``send_object_list``), a schedule that votes with
    small tensors; each rank holds its own layers' state, and a receive buffer per
    microbatch: activations from the stage before, gradients from the stage after."""
    result, out = runs["pipeline_stages"].result()
    assert result.code == 0, result.stderr[-3000:]
    d, rows, microbatches = 256, 4096, 4
    assert "rank 0: 0 losses" in result.stdout
    assert f"rank 1: {microbatches} losses" in result.stdout  # the last stage's, each one
    for rank, sizes in enumerate([[(d, d), (d, d)], [(d, d), (d, 10)]]):
        params = sum(i * o + o for i, o in sizes)
        data = report(out / f"rank-{rank}")
        held = data["devices"][0]["categories_requested"]
        assert (held["parameters"], held["optimizer_state"]) == (F32 * params, 2 * F32 * params)
        # the peak is in backward: every gradient at the end of it, in the allocator's blocks
        assert data["devices"][0]["category_peaks"]["gradients"] == sum(
            block(F32 * i * o) + block(F32 * o) for i, o in sizes)
        assert held["communication"] == microbatches * F32 * (rows // microbatches) * d
        assert data["run"]["model"]["parallelism"] == {
            "strategies": ["pipeline"], "meshes": [], "pipeline": {
                "schedule": "ScheduleGPipe", "microbatches": microbatches, "stages": 2,
                "stage": rank}}
    assert "large tensors hold no values" not in result.stderr  # the vote's were sent


@pytest.mark.parametrize("rank", [0, 1])
def test_a_gpipe_stage_is_offered_1f1b_for_the_microbatches_still_in_flight(
        runs: dict[str, Future[Any]], rank: int) -> None:
    """1F1B holds the activations of one microbatch per stage from this one to the last,
    where GPipe holds all four; no micro-batches (the schedule's are its own); a re-run
    starts every stage, as they wait for each other's shapes."""
    from memprof.advise.advice import advise
    from memprof.advise.budget import parse_budget
    from memprof.advise.peak import peak_of
    from memprof.advise.rerun import Rerun
    from memprof.advise.source import load_run

    _, out = runs["pipeline_stages"].result()
    run = load_run(out / f"rank-{rank}")
    start = peak_of(run.device)
    advice = advise(run, parse_budget(str(start.reserved // 2)))
    keys = [r.remedy.key for r in advice.ranked]
    assert not [k for k in keys if k.startswith("micro_batch")]
    one_f_one_b = next(r.remedy for r in advice.ranked if r.remedy.key == "schedule_1f1b")
    in_flight = 2 - rank  # of the 4 microbatches
    assert one_f_one_b.change(start).at_peak == {
        **start.at_peak, "activations": int(start.at_peak["activations"] * in_flight / 4)}
    assert one_f_one_b.verify == {"schedule": "Schedule1F1B"}
    options = Rerun.of(run).rank.options(["--virtual-gpu", "H100"])  # type: ignore[union-attr]
    assert options == ["--nnodes", "1", "--nproc-per-node", "2"]  # no --ranks: all of them


def test_the_1f1b_remedy_gives_a_script_1f1b_where_it_asks_for_gpipe() -> None:
    from memprof.collect.launch.apply import applied

    with applied({"schedule": "Schedule1F1B"}):
        from torch.distributed.pipelining import ScheduleGPipe
        from torch.distributed.pipelining.schedules import get_schedule_class
        assert ScheduleGPipe.__name__ == get_schedule_class("GPipe").__name__ == "Schedule1F1B"
    from torch.distributed.pipelining import ScheduleGPipe
    assert ScheduleGPipe.__name__ == "ScheduleGPipe"


def test_some_ranks_of_a_world_of_eight_run_alone_with_their_own_shards(
        runs: dict[str, Future[Any]]) -> None:
    result, out = runs["fsdp_some_ranks"].result()
    assert result.code == 0, result.stderr[-3000:]
    for rank in (0, 5, 7):  # full shards; none of the last weight's rows; the remainder
        fsdp2_rank_holds_its_shard(out, result.stdout, rank, 8)
    summary = report(out, "cluster.json")
    assert (summary["world_size"], summary["ranks_run"]) == (8, [0, 5, 7])
    # a run folder per rank run, and no other
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["rank-0", "rank-5", "rank-7"]
    assert "ranks 0, 5, 7 of 8 (--ranks)" in result.stderr
    assert "5 of the world's 8 ranks were not run" in result.stderr
    # every rank reads a loss's value: memprof says what that value is once for them all
    assert result.stderr.count("large tensors hold no values") == 1


def test_a_run_that_ends_inside_a_forward_holds_every_shard_and_its_gathered_units(
        runs: dict[str, Future[Any]]) -> None:
    result, out = runs["fsdp_ends_in_forward"].result()
    assert result.code == 1 and "stopped inside the forward" in result.stderr
    world = 2
    for rank in range(world):
        device = report(out / f"rank-{rank}")["devices"][0]
        at_peak = device["categories_requested"]
        # every unit's shard is a parameter, the last unit's (it never ran) included
        assert at_peak["parameters"] == F32 * sum(
            numel(s, padded_rows(s[0], world)) for s in shapes())
        # the second unit gathered: its flat all-gather output (every rank's padded
        # shards) and its unsharded weight and bias; and the first unit's all-gather
        # output, which FSDP2 frees once the next unit's has been copied out
        first, second = shapes()[:2], shapes()[2:4]
        assert at_peak["communication"] == F32 * (
            sum(numel(s, world * padded_rows(s[0], world)) for s in [*first, *second])
            + sum(numel(s, s[0]) for s in second))
        assert at_peak["other"] == 0


def test_every_rank_exchanges_its_objects_and_broadcast_values(runs: dict[str, Future[Any]]
                                                              ) -> None:
    """Ranks that exchange objects wait for each other: they all run at once (more ranks
    than cores, here), as on a cluster. A broadcast gives every rank the root's small
    values (a virtual tensor holds them), as DeepSpeed's checks that the ranks agree read
    them."""
    result = runs["objects_every_rank"].result()
    assert result.code == 0, result.stderr[-3000:]
    assert sorted(result.stdout.splitlines()) == [
        f"rank {r}: {{'from': 0}} [0, 1, 2] [7, -1]" for r in range(3)]


def test_an_object_from_a_rank_not_run_is_this_ranks_own(runs: dict[str, Future[Any]]
                                                          ) -> None:
    result = runs["objects_some_ranks"].result()
    assert result.code == 0, result.stderr[-3000:]
    # rank 0 sends its object to rank 3, which ran; ranks 1 and 2 send what each sends
    assert sorted(result.stdout.splitlines()) == [
        "rank 0: {'from': 0} [0, 0, 0, 3] [7, -1]", "rank 3: {'from': 0} [0, 3, 3, 3] [7, -1]"]
    assert result.stderr.count("an object collective involves ranks not run") == 1  # once


def test_ranks_are_chosen_among_the_worlds_on_virtual_cards_only(tmp_path: Path) -> None:
    from memprof.cli.run_cluster import cluster_ranks
    from memprof.errors import MemprofError

    card = parse_spec("H100")
    assert cluster_ranks(2, 4, "0-2,7, 5", card).running == (0, 1, 2, 5, 7)
    assert cluster_ranks(1, 2, "1,0", card).chosen is None  # every rank: the whole world
    # a large world on virtual cards: its representatives, unless all are asked for
    assert cluster_ranks(8, 8, None, card).running == (0, 1, 8, 32, 62, 63)
    assert "--ranks all runs every one" in cluster_ranks(8, 8, None, card).why
    assert cluster_ranks(1, 64, "all", card).chosen is None
    assert cluster_ranks(1, 16, None, card).chosen is None  # 16: every rank
    assert cluster_ranks(1, 64, None, None).chosen is None  # on GPUs every rank runs
    for chosen, error in (("4", "--ranks 4: '4' is not within ranks 0-3"),
                          ("a", "'a' is not a rank or a range"),
                          ("3-1", "'3-1' is not within ranks 0-3")):
        with pytest.raises(MemprofError, match=re.escape(error)):
            cluster_ranks(1, 4, chosen, card)
    with pytest.raises(MemprofError, match="--ranks runs some ranks on virtual cards only"):
        cluster_ranks(1, 2, "0", None)  # on GPUs (no virtual card) every rank must run
    for args, error in ((["--nproc-per-node", "4", "--ranks", "4"], "'4' is not within"),
                        (["--ranks", "0"], "give --nproc-per-node N too")):
        result = memprof_run(tmp_path, *args, "-c", "pass")  # as the command says them
        assert result.code == 2 and error in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1


def test_ddp_under_torchrun_holds_the_full_model_per_rank(runs: dict[str, Future[Any]]
                                                          ) -> None:
    result, out = runs["ddp_torchrun"].result()
    assert result.code == 0, result.stderr[-3000:]
    params = sum(numel(s, s[0]) for s in shapes())
    for rank in (0, 1):
        data = report(out / f"rank-{rank}")
        at_peak = data["devices"][0]["categories_requested"]
        assert data["run"]["virtual_gpu"]["spec"] == "H100 80GB"
        assert (at_peak["parameters"], at_peak["gradients"], at_peak["optimizer_state"]) == (
            F32 * params, F32 * params, 2 * F32 * params)
        assert at_peak["communication"] == F32 * params  # DDP's one bucket beside the gradients
        assert data["run"]["model"]["parallelism"] == {"strategies": ["ddp"], "meshes": []}


def test_a_world_of_one_is_the_single_gpu_run(runs: dict[str, Future[Any]]) -> None:
    cluster, alone, where = runs["one_rank"].result()
    assert cluster.code == 0 and alone.code == 0, cluster.stderr[-3000:] + alone.stderr[-3000:]
    assert ": 1 rank on H100 80GB" in cluster.stderr and "no report" not in cluster.stderr
    one, single = (report(where / "cluster")["devices"][0],
                   report(where / "alone")["devices"][0])
    assert one["peak"]["allocated_bytes"] == single["peak"]["allocated_bytes"]
    assert one["peak"]["reserved_bytes"] == single["peak"]["reserved_bytes"]
    assert one["categories_requested"] == single["categories_requested"]


def test_check_and_suggest_read_the_worst_rank_of_a_run_folder(
        runs: dict[str, Future[Any]]) -> None:
    _, out = runs["fsdp_cluster"].result()
    checked = memprof_here(out.parent, "check", out, "--baseline", out)
    assert checked.code == 0, checked.stderr
    suggested = memprof_here(out.parent, "suggest", out, "--budget", "80GB")
    assert suggested.code == 0 and "rank-0/report.json" in suggested.stdout, suggested.stderr


def test_a_rank_is_re_run_with_its_world(runs: dict[str, Future[Any]]) -> None:
    """suggest --verify and --fit-batch re-run the worst rank of a cluster as a rank of its
    world (the world launched again, on virtual cards that rank alone), not as a process of
    its own that would hold the whole model."""
    from memprof.advise.peak import peak_of
    from memprof.advise.rerun import Rank, Rerun
    from memprof.advise.source import load_run
    from memprof.trace.model import PARAMETERS

    _, out = runs["fsdp_cluster"].result()
    run = load_run(out)  # the worst rank's
    rerun = Rerun.of(run)
    assert rerun.rank == Rank(run.facts["rank"], 1, 3)
    measured, recorded = rerun.peak(), peak_of(run.device)
    assert (measured.at_peak, measured.at_step, measured.reserved) == (
        recorded.at_peak, recorded.at_step, recorded.reserved)
    whole = F32 * sum(numel(s, s[0]) for s in shapes())
    assert measured.at_peak[PARAMETERS] < whole  # a third of it, padded


def test_a_rank_is_re_run_over_another_world_and_its_worst_rank_measured(
        runs: dict[str, Future[Any]]) -> None:
    """suggest --gpus 6 of the FSDP2 sample over 3 GPUs: its estimate shards the model state
    6 ways instead of 3, and the world of 6 re-run (ranks 0 and 5 on virtual cards) holds
    each parameter's rows padded to a multiple of 6, divided by 6."""
    from memprof.advise.advice import advise
    from memprof.advise.budget import parse_budget
    from memprof.advise.remedies import catalogue
    from memprof.advise.rerun import Rank, Rerun
    from memprof.advise.source import load_run
    from memprof.advise.verify import measure_remedies
    from memprof.trace.model import GRADIENTS, OPTIMIZER_STATE, PARAMETERS

    _, out = runs["fsdp_cluster"].result()
    run = load_run(out)
    advice = advise(run, parse_budget("80GB"), 6)
    offered = {r.key: r for r in catalogue(advice.start, advice.context)}
    six, offload = offered["world_6"], offered["fsdp_offload"]
    assert six.verify == {"world": 6} and offload.verify == {"offload": True}
    now = advice.start
    on_host = offload.change(now)
    assert on_host.at_step[PARAMETERS] == on_host.at_step[OPTIMIZER_STATE] == 0
    assert on_host.at_step[GRADIENTS] == 0
    # in backward, the unit being reduce-scattered (no block repeats: the whole model, one
    # unit) still holds its gradient on the card
    assert advice.context.block is None
    model = sum(numel(s, s[0]) * F32 for s in shapes())
    assert on_host.at_peak[GRADIENTS] == min(now.at_peak[GRADIENTS], model) > 0
    # the sample puts the whole model on the card before fully_shard, which makes the first
    # Linear's shards (rows padded to 3) before that Linear's weights go: offloaded, the card
    # still holds that once
    weight, bias = shapes()[:2]
    loaded = sum(block(numel(s, s[0]) * F32) for s in shapes()) + block(
        F32 * numel(weight, padded_rows(weight[0], 3))) + block(F32 * padded_rows(bias[0], 3))
    assert advice.context.parameters_peak == loaded and on_host.floor == loaded
    assert on_host.allocated >= loaded
    assert "offload_policy=CPUOffloadPolicy()" in offload.snippet
    assert six.change(now).at_step[OPTIMIZER_STATE] == now.at_step[OPTIMIZER_STATE] // 2
    # as many ranks a node as the run had (they divide 6): two nodes
    assert Rank(1, 1, 3).options(["--virtual-gpu", "H100"], 6) == [
        "--nnodes", "2", "--nproc-per-node", "3", "--ranks", "0,1,5"]
    assert Rank(1, 1, 3).options(["--virtual-gpu", "H100"], 4)[:4] == [
        "--nnodes", "1", "--nproc-per-node", "4"]
    measured = measure_remedies([six], Rerun.of(run), lambda what: None)
    shards = [block(F32 * numel(s, padded_rows(s[0], 6))) for s in shapes()]
    assert measured["world_6"].at_peak[PARAMETERS] == sum(shards)


def test_fsdp_instead_of_ddp_holds_a_shard_of_the_padded_flat_parameter(
        runs: dict[str, Future[Any]]) -> None:
    """suggest's FSDP-instead-of-DDP remedy, applied to an unmodified DDP script over 2
    ranks: one flat parameter of every weight (each starting at a 16-byte boundary, as
    these do), padded to a multiple of 2 and halved; AdamW's two moments of the rank's own
    elements, though the optimizer was made before the wrapper; the gathered flat
    parameter is a communication buffer."""
    result, out = runs["fsdp_instead_of_ddp"].result()
    assert result.code == 0, result.stderr
    flat = sum(numel(s, s[0]) for s in shapes())
    assert all(numel(s, s[0]) % 4 == 0 for s in shapes()[:-1])  # fp32: 16-byte aligned
    for rank in (0, 1):
        device = report(out / f"rank-{rank}")["devices"][0]
        held = device["categories_requested"]
        own = min(-(-flat // 2), flat - rank * -(-flat // 2))
        assert held["parameters"] == F32 * -(-flat // 2)
        assert held["optimizer_state"] == 2 * F32 * own
        # at the peak, in backward, the flat parameter gathered whole (padded): a
        # communication buffer, though the module holds views of it and saved them
        assert held["communication"] == F32 * 2 * -(-flat // 2)
        assert report(out / f"rank-{rank}")["run"]["model"]["parallelism"]["strategies"] == [
            "fsdp1:full_shard"]


def test_a_ddp_rank_is_offered_fsdp_and_bucket_views_measured_by_re_running(
        runs: dict[str, Future[Any]]) -> None:
    from memprof.advise.advice import advise
    from memprof.advise.budget import parse_budget
    from memprof.advise.remedies import catalogue
    from memprof.advise.source import load_run

    _, out = runs["ddp_torchrun"].result()
    advice = advise(load_run(out / "rank-0"), parse_budget("1GB"), 4)
    offered = {r.key: r for r in catalogue(advice.start, advice.context)}
    assert offered["fsdp_full_shard"].verify == {"shard": "FULL_SHARD", "units": []}
    assert offered["fsdp_shard_grad_op"].verify == {"shard": "SHARD_GRAD_OP", "units": []}
    assert offered["bucket_view"].verify == {"bucket_view": True}
    # DDP shards nothing: more GPUs keep each rank's memory, and no ZeRO formula applies
    assert not {"world_4", "zero_1", "zero_2", "zero_3"} & set(offered)
    told = memprof_here(out.parent, "suggest", out, "--budget", "1GB", "--gpus", "4")
    assert "--gpus 4: the run shards none of its model state" in told.stderr, told.stderr


def test_the_answer_names_the_worst_rank_or_the_first_out_of_memory() -> None:
    from memprof.report.cluster import Cluster, RankPeak, answer

    gib = 1 << 30
    ranks = [RankPeak(r, Path(f"rank-{r}/report.json"), reserved=(3 + r % 2) * gib,
                      context=gib // 2, total=80 * gib, steps=4) for r in range(4)]
    assert answer(Cluster(ranks, "H100")) == "fits: worst rank 4.50 GiB of 80.00 GiB (rank 1)"
    # a rank that failed otherwise leads, with its error; the run did not get through, so
    # what the ranks held until then is no verdict
    raised = {"status": "raised", "code": 1, "error": "AssertionError\n  at train.py:12"}
    failing = [*ranks[:3], RankPeak(3, ranks[3].report, reserved=gib, context=gib // 2,
                                    total=80 * gib, exit=raised)]
    assert answer(Cluster(failing, "H100")) == (
        "rank 3 raised (exit code 1) after 0 steps: AssertionError; until then: worst rank"
        " 4.50 GiB of 80.00 GiB (rank 1)")
    # the ranks memprof stopped once it had failed (SIGTERM after the grace) come after it
    stopped = {"status": "stopped", "code": 143, "error": None}
    failing[0] = RankPeak(0, ranks[0].report, reserved=3 * gib, context=gib // 2,
                          total=80 * gib, exit=stopped)
    assert answer(Cluster(failing, "H100")).startswith("rank 3 raised (exit code 1)")
    error = ("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a"
             " total capacity of 79.19 GiB ...  See documentation for Memory Management")
    ranks[3] = RankPeak(3, ranks[3].report, steps=1, out_of_memory=True,
                        exit={"status": "raised", "code": 1, "error": error})
    ranks[2] = RankPeak(2, ranks[2].report, steps=2, out_of_memory=True, exit=ranks[3].exit)
    assert answer(Cluster(ranks, "H100")) == (
        "out of memory on rank 3 at step 2: OutOfMemoryError: CUDA out of memory. Tried to"
        " allocate 2.00 GiB. GPU 3 has a total capacity of 79.19 GiB ...")


def test_a_rank_waiting_for_another_through_the_store_ends_on_the_launchers_signal(
        ) -> None:
    """A rank waits for objects a failed rank will never send (a pipeline's shapes): the
    launcher's SIGTERM, once it has waited out its grace, ends its script there, as it
    would anywhere in the script, not after the store's own 30-minute timeout."""
    import os
    import signal
    import threading

    from memprof.collect.launch.endings import Stop, stops
    from memprof.collect.virtual.objects import _get

    store = dist.HashStore()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    with stops(), pytest.raises(Stop) as stopped:
        _get(store, "never-set")
    assert (stopped.value.reason, stopped.value.exit_code) == ("SIGTERM", 128 + signal.SIGTERM)


def test_each_rank_gets_torchruns_environment() -> None:
    from memprof.collect.launch.ranks import Ranks

    env = Ranks(nodes=2, per_node=4).environment(5, 29400, "abc")
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK", "MASTER_PORT")} == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "MASTER_PORT": "29400"}


def test_a_cluster_that_runs_out_of_memory_answers_with_the_first_rank(tmp_path: Path) -> None:
    """The sample's ranks on cards too small for them: the answer is PyTorch's message for
    the first rank; ranks not started after it are said to be not run, and leave no
    folder."""
    out = tmp_path / "out"
    result = memprof_run(tmp_path, "--nproc-per-node", "2", "--virtual-gpu", "560MiB", "-o",
                         out, "--no-timeline", SAMPLES / "fsdp2.py", *SIZE)
    assert result.code == 1, result.stderr[-3000:]
    summary = report(out, "cluster.json")
    assert summary["answer"].startswith("out of memory on rank 0 at step 1: OutOfMemoryError")
    ran = summary["ranks_run"]
    assert ran == list(range(len(ran))) and ran  # in order, as many at a time as cores
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [f"rank-{r}" for r in ran]
    assert ("a rank failed before they started" in result.stderr) == (len(ran) < 2)


RANK_SPAN = """\
import os, sys, time
start, failing = time.monotonic(), os.environ["RANK"] == "1" and sys.argv[2] != "0"
time.sleep(0 if failing else 0.5)
with open(os.path.join(sys.argv[1], os.environ["RANK"]), "w") as f:
    f.write(f"{start} {time.monotonic()}")
sys.exit(int(sys.argv[2]) if failing else 0)
"""


def test_ranks_run_a_few_at_a_time_and_a_failure_starts_no_more(tmp_path: Path) -> None:
    """Ranks on virtual cards wait for no other: ``at_once`` of them run at a time (the
    machine's cores, as its memory allows); once one has failed, no more start."""
    import sys

    from memprof.collect.launch.ranks import RankExit, Ranks, run_ranks

    def spans(code: int) -> tuple[list[RankExit], dict[int, tuple[float, float]]]:
        folder = tmp_path / str(code)
        folder.mkdir()
        exits = run_ranks(Ranks(1, 4), [sys.executable, "-c", RANK_SPAN, str(folder),
                                        str(code)], at_once=2)
        return exits, {int(p.name): tuple(map(float, p.read_text().split()))
                       for p in folder.iterdir()}

    exits, ran = spans(0)
    assert [(e.rank, e.code, e.started) for e in exits] == [(r, 0, True) for r in range(4)]
    starts = sorted(start for start, _ in ran.values())
    ends = sorted(end for _, end in ran.values())
    assert starts[2] >= ends[0]  # the third rank starts once one of the first two ended
    exits, ran = spans(3)  # rank 1 fails while rank 0 runs
    assert sorted(ran) == [0, 1] and [(e.rank, e.code, e.started) for e in exits] == [
        (0, 0, True), (1, 3, True), (2, 0, False), (3, 0, False)]


@pytest.mark.parametrize("group", [(1, 4)], indirect=True)
def test_sequence_parallel_shards_the_norms_activations_along_the_sequence(
        group: VirtualGpu) -> None:
    """Megatron's sequence parallelism over a tensor-parallel group of 4, unmodified
    (``parallelize_module`` with ``SequenceParallel``): the norm runs on a quarter of the
    sequence, the projections on the sequence all-gathered and a quarter of the features."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    batch, seq, dim, hidden = 2, 64, 32, 128
    mesh = init_device_mesh("cuda", (4,), mesh_dim_names=("tp",))
    block = torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, hidden),
                                torch.nn.GELU(), torch.nn.Linear(hidden, dim)).cuda()
    parallelize_module(block, mesh, {
        "0": SequenceParallel(),
        "1": ColwiseParallel(input_layouts=Shard(1)),
        "3": RowwiseParallel(output_layouts=Shard(1))})
    seen = {}
    for name, module in block.named_children():
        module.register_forward_hook(
            lambda m, i, out, name=name: seen.__setitem__(name, tuple(
                (out.to_local() if hasattr(out, "to_local") else out).shape)))
    x = torch.ones(batch, seq // 4, dim, device="cuda")  # this rank's quarter of the sequence
    block(x).sum().backward()
    # the norm on a quarter of the sequence; the projections on the whole sequence gathered,
    # each on a quarter of the hidden features; the output scattered back by sequence
    assert seen == {"0": (batch, seq // 4, dim), "1": (batch, seq, hidden // 4),
                    "2": (batch, seq, hidden // 4), "3": (batch, seq // 4, dim)}
    # weights: the norm replicated, colwise rows and rowwise columns a quarter each
    assert [tuple(p.to_local().shape) for p in block.parameters()] == [
        (dim,), (dim,), (hidden // 4, dim), (hidden // 4,), (dim, hidden // 4), (dim,)]


def test_fsdp2_s_accumulated_unsharded_gradients_are_gradients(
        runs: dict[str, Future[Any]]) -> None:
    """Between reduce-scatters (gradient accumulation, a pipeline's microbatches), FSDP2
    keeps each parameter's gradient whole, in the reduce dtype: gradients, not a
    communication buffer."""
    result, out = runs["fsdp_accumulated"].result()
    assert result.code == 0, result.stderr[-3000:]
    whole = 2 * 1024 * 1024 * F32  # both layers' fp32 gradients, unsharded
    for rank in (0, 1):
        peaks = report(out / f"rank-{rank}")["devices"][0]["category_peaks"]
        # at most: both accumulated, and a layer's bf16 gradient before it is added in
        assert peaks["gradients"] == whole + 1024 * 1024 * 2
