"""Train an MLP with DistributedDataParallel on the gloo backend (runs on CPUs too).

A memprof sample workload for multi-process runs. Launch it with torchrun, which sets
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process:

    torchrun --nproc-per-node 2 sample_scripts/ddp_gloo.py
    torchrun --nproc-per-node 2 -m memprof run sample_scripts/ddp_gloo.py  # one report per rank

Run without torchrun it trains alone as a world of one. `--size real` is meant for GPUs
(gloo all-reduces CUDA tensors too; ranks share the GPUs round-robin).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from common import add_device_and_seed, build_mlp, parse_with_presets, preset_parser
from torch import nn
from torch.nn.parallel import DistributedDataParallel

IN_FEATURES = 64
OUT_FEATURES = 10
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 128, "layers": 2, "batch": 32},
    "real": {"hidden": 4096, "layers": 6, "batch": 1024},
}


def build_model(hidden: int, layers: int) -> nn.Sequential:
    """`layers` blocks of Linear + ReLU, then a Linear head."""
    return build_mlp(IN_FEATURES, hidden, layers, OUT_FEATURES)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags; the size flags default to the chosen preset's values."""
    parser = preset_parser(__doc__.splitlines()[0], PRESETS,
                           "override the preset's {} (batch: per rank)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    add_device_and_seed(
        parser, "torch device type (a rank uses cuda:LOCAL_RANK mod the GPU count)")
    return parse_with_presets(parser, PRESETS, argv)


def _init() -> tuple[int, int]:
    """Join the process group torchrun describes, or form a world of one; (rank, world)."""
    if "RANK" not in os.environ:  # plain `python ddp_gloo.py`
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> float:
    """Train this rank's replica; return the final loss averaged over the ranks."""
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = DistributedDataParallel(build_model(args.hidden, args.layers).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(args.seed + 1 + rank)  # a different data shard per rank
    loss = torch.zeros((), device=device)
    for _ in range(args.steps):
        inputs = torch.randn(args.batch, IN_FEATURES, device=device)
        targets = torch.randn(args.batch, OUT_FEATURES, device=device)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()  # DDP all-reduces the gradients here
        optimizer.step()
    final = loss.detach().clone()
    dist.all_reduce(final)
    return final.item() / world


def main(argv: list[str] | None = None) -> float:
    """Join the process group, train, leave it; return the mean final loss."""
    args = parse_args(argv)
    rank, world = _init()
    try:
        if args.device == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        else:
            device = torch.device(args.device)
        # the DDP model lives in train(): it is gone before its process group is destroyed
        mean = train(args, rank, world, device)
        print(f"rank {rank}/{world}: mean final loss {mean:.4f} after {args.steps} steps")
        return mean
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
