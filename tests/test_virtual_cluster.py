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

from memprof.collect.virtual.gpu import VirtualGpu

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


@pytest.mark.parametrize("group", [(0, 3), (2, 3)], indirect=True)
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
    assert torch.cuda.memory_allocated() - before == sum(2 * block(n * F32) for n in own)
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


@pytest.mark.parametrize("group", [(2, 3)], indirect=True)
def test_fsdp1_shards_each_units_flat_parameter_padded_to_the_world_size(
        group: VirtualGpu) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FullyShardedDataParallel(model_on_card(), device_id=0,
                                     auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))
    units = [numel(w, w[0]) + b[0] for w, b in zip(shapes()[::2], shapes()[1::2], strict=True)]
    shards = [-(-n // 3) for n in units]  # FULL_SHARD: a flat parameter per unit, padded
    assert [p.numel() for p in model.parameters()] == shards
    assert torch.cuda.memory_allocated() == sum(block(n * F32) for n in shards)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(4, 64, device="cuda")).sum().backward()
    before = torch.cuda.memory_allocated()
    optimizer.step()
    assert torch.cuda.memory_allocated() - before == sum(2 * block(n * F32) for n in shards)


# --- ranks as processes: reports, the answer, explain, check and suggest -----------------

jobs = Jobs()


@jobs
def fsdp_cluster(where: Path) -> tuple[Any, Path]:
    out = where / "out"
    return memprof_run(where, "--nproc-per-node", "3", "-o", out, "--no-timeline",
                       SAMPLES / "fsdp2.py", *SIZE), out


@jobs
def ddp_torchrun(where: Path) -> tuple[Any, Path]:
    out = where / "out"
    return run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "-m", "memprof", "run", "-o", out, "--no-timeline",
                       SAMPLES / "ddp.py", *SIZE], where), out


@jobs
def one_rank(where: Path) -> tuple[Any, Any, Path]:
    return (memprof_run(where, "--nproc-per-node", "1", "-o", where / "cluster",
                        "--no-timeline", SAMPLES / "fsdp2.py", *SIZE),
            memprof_run(where, "-o", where / "alone", "--no-timeline", SAMPLES / "fsdp2.py",
                        *SIZE), where)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Any]]]:
    yield from jobs.started(tmp_path_factory, "cluster")


def test_every_fsdp2_rank_holds_its_shard_and_the_answer_comes_first(
        runs: dict[str, Future[Any]]) -> None:
    result, out = runs["fsdp_cluster"].result()
    assert result.code == 0, result.stderr[-3000:]
    world = 3
    units = [shapes()[i:i + 2] for i in range(0, len(shapes()), 2)]  # (weight, bias) each
    for rank in range(world):
        assert f"rank {rank}/{world}: loss" in result.stdout
        data = report(out, f"report-rank{rank}.json")
        assert (data["run"]["rank"], data["run"]["world_size"]) == (rank, world)
        device = data["devices"][0]
        at_peak = device["categories_requested"]
        padded = sum(numel(s, padded_rows(s[0], world)) for s in shapes())
        own = sum(numel(s, own_rows(s[0], world, rank)) for s in shapes())
        assert at_peak["parameters"] == F32 * padded
        assert at_peak["optimizer_state"] == 2 * F32 * own  # rank 2 holds fewer rows
        # each unit's gradients: views of its reduce-scatter output, of the padded shards
        assert device["category_peaks"]["gradients"] == sum(
            block(F32 * sum(numel(s, padded_rows(s[0], world)) for s in unit))
            for unit in units)
        # a unit gathered: each parameter's padded rows from every rank, and the flat
        # all-gather output it is copied out of; never more than every unit gathered at once
        # with one all-gather in flight
        gathered = [F32 * sum(numel(s, world * padded_rows(s[0], world)) for s in unit)
                    for unit in units]
        assert device["category_peaks"]["communication"] >= max(gathered)
        assert 0 < at_peak["communication"] <= sum(gathered) + max(gathered)
    worst = max(report(out, f"report-rank{r}.json")["devices"][0]["peak"]["reserved_bytes"]
                for r in range(world))
    lines = result.stderr.splitlines()
    answer = next(i for i, line in enumerate(lines) if line.startswith("fits: worst rank"))
    assert "(rank 0)" in lines[answer] and lines[answer + 1].split()[:2] == ["rank", "peak"]
    assert worst > 0 and lines[-1] == f"Next: memprof explain {out}"


def test_ddp_under_torchrun_holds_the_full_model_per_rank(runs: dict[str, Future[Any]]
                                                          ) -> None:
    result, out = runs["ddp_torchrun"].result()
    assert result.code == 0, result.stderr[-3000:]
    params = sum(numel(s, s[0]) for s in shapes())
    for rank in (0, 1):
        data = report(out, f"report-rank{rank}.json")
        at_peak = data["devices"][0]["categories_requested"]
        assert data["run"]["virtual_gpu"]["spec"] == "H100 80GB"
        assert (at_peak["parameters"], at_peak["gradients"], at_peak["optimizer_state"]) == (
            F32 * params, F32 * params, 2 * F32 * params)
        assert at_peak["communication"] == F32 * params  # DDP's one bucket beside the gradients


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
    assert suggested.code == 0 and "report-rank0.json" in suggested.stdout, suggested.stderr


def test_the_answer_names_the_worst_rank_or_the_first_out_of_memory() -> None:
    from memprof.report.cluster import Cluster, RankPeak, answer

    gib = 1 << 30
    ranks = [RankPeak(r, Path(f"report-rank{r}.json"), reserved=(3 + r % 2) * gib,
                      context=gib // 2, total=80 * gib, steps=4) for r in range(4)]
    assert answer(Cluster(ranks, "H100")) == "fits: worst rank 4.50 GiB of 80.00 GiB (rank 1)"
    error = ("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a"
             " total capacity of 79.19 GiB ...  See documentation for Memory Management")
    ranks[3] = RankPeak(3, ranks[3].report, steps=1, out_of_memory=True,
                        exit={"status": "raised", "code": 1, "error": error})
    ranks[2] = RankPeak(2, ranks[2].report, steps=2, out_of_memory=True, exit=ranks[3].exit)
    assert answer(Cluster(ranks, "H100")) == (
        "out of memory on rank 3 at step 2: OutOfMemoryError: CUDA out of memory. Tried to"
        " allocate 2.00 GiB. GPU 3 has a total capacity of 79.19 GiB ...")


def test_each_rank_gets_torchruns_environment() -> None:
    from memprof.collect.launch.ranks import Ranks

    env = Ranks(nodes=2, per_node=4).environment(5, 29400, "abc")
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK", "MASTER_PORT")} == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "MASTER_PORT": "29400"}
