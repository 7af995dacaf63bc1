"""Train an MLP sharded with FSDP2 (``fully_shard``) over NCCL, a GPU per rank: a memprof
sample.

    torchrun --nproc-per-node 2 sample_scripts/fsdp2.py       # on a machine with 2 GPUs
    memprof run --nproc-per-node 2 sample_scripts/fsdp2.py    # every rank, on virtual GPUs

Each Linear is a unit of its own, and the model the root. A rank holds a shard of each
weight: its first dimension padded to a multiple of the world size, divided by it; AdamW
(fp32) keeps two moments of the rank's own rows. Run without a launcher it trains alone.
"""

from __future__ import annotations

import argparse

import torch
from common import rank_args, run_rank
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 128, "layers": 2, "batch": 32},
    "real": {"hidden": 8192, "layers": 8, "batch": 256},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags; the size flags default to the chosen preset's values."""
    return rank_args(__doc__.splitlines()[0], PRESETS, argv, lambda parser: parser.add_argument(
        "--no-reshard-after-forward", action="store_true",
        help="keep the gathered weights from forward to backward"))


def shard(model: nn.Module, device: torch.device, world: int, reshard: bool = True
          ) -> nn.Module:
    """Each Linear a unit of its own, then the model the root."""
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


def main(argv: list[str] | None = None) -> float:
    """Train this rank's shards; return its final loss."""
    args = parse_args(argv)
    return run_rank(args, lambda model, device, world: shard(
        model, device, world, not args.no_reshard_after_forward))


if __name__ == "__main__":
    main()
