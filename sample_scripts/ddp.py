"""Train an MLP with DistributedDataParallel over NCCL, a GPU per rank: a memprof sample.

    torchrun --nproc-per-node 2 sample_scripts/ddp.py         # on a machine with 2 GPUs
    memprof run --nproc-per-node 2 sample_scripts/ddp.py      # every rank, on virtual GPUs
    torchrun --nproc-per-node 2 -m memprof run sample_scripts/ddp.py

Run without a launcher it trains alone, as a world of one. AdamW (fp32): per rank the full
model's weights, gradients (DDP's buckets with --gradient-as-bucket-view) and two moments.
"""

from __future__ import annotations

import argparse

import torch
from common import rank_args, run_rank
from torch import nn
from torch.nn.parallel import DistributedDataParallel

PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 128, "layers": 2, "batch": 32},
    "real": {"hidden": 4096, "layers": 8, "batch": 256},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags; the size flags default to the chosen preset's values."""
    def bucket_flags(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--bucket-cap-mb", type=float, default=None,
                            help="DDP's gradient bucket size (default: DDP's 25)")
        parser.add_argument("--gradient-as-bucket-view", action="store_true",
                            help="gradients are views of DDP's buckets (no second copy)")
    return rank_args(__doc__.splitlines()[0], PRESETS, argv, bucket_flags)


def main(argv: list[str] | None = None) -> float:
    """Train this rank's replica; return its final loss."""
    args = parse_args(argv)

    def replicate(model: nn.Module, device: torch.device, world: int) -> nn.Module:
        return DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=args.bucket_cap_mb,
            gradient_as_bucket_view=args.gradient_as_bucket_view)
    return run_rank(args, replicate)


if __name__ == "__main__":
    main()
