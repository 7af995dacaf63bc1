"""What the sample scripts share: an MLP, size presets as flags, the --device and --seed flags.

The samples import it with ``from common import ...``: Python puts a script's folder first
on ``sys.path`` (``python sample_scripts/X.py`` and ``memprof run`` alike); each sample also
puts it there itself, for code that imports the sample by its path (the tests do).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


def build_mlp(in_features: int, hidden: int, layers: int, out_features: int) -> nn.Sequential:
    """`layers` blocks of Linear + ReLU, then a Linear head."""
    blocks: list[nn.Module] = []
    width = in_features
    for _ in range(layers):
        blocks += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    blocks.append(nn.Linear(width, out_features))
    return nn.Sequential(*blocks)


def preset_parser(description: str, presets: dict[str, dict[str, int]],
                  override_help: str = "override the preset's {}") -> argparse.ArgumentParser:
    """A parser with `--size` to pick one of `presets` and a flag per size setting
    (`d_model` as `--d-model`) that overrides the preset; see `parse_with_presets`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--size", choices=sorted(presets), default="tiny",
                        help="preset for the size flags")
    for name in presets["tiny"]:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=override_help.format(name))
    return parser


def parse_with_presets(parser: argparse.ArgumentParser, presets: dict[str, dict[str, int]],
                       argv: list[str] | None) -> argparse.Namespace:
    """Parse `argv`; a size flag left out takes the chosen preset's value."""
    args = parser.parse_args(argv)
    for name, value in presets[args.size].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def add_device_and_seed(parser: argparse.ArgumentParser, device_help: str = "torch device",
                        ) -> None:
    """`--device` (CUDA, as training scripts are written; `memprof run` gives a machine
    without a GPU a virtual one) and `--seed`."""
    parser.add_argument("--device", default="cuda", help=device_help)
    parser.add_argument("--seed", type=int, default=0, help="random seed")


def join_process_group(backend: str) -> tuple[int, int, int]:
    """Join the process group that torchrun (or ``memprof run --nproc-per-node``) describes
    in the environment, or form a world of one in this process without a rendezvous;
    return (rank, world size, local rank)."""
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:  # plain `python sample.py`
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))


def rank_device(kind: str, local_rank: int) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current), or ``kind`` itself."""
    if kind != "cuda":
        return torch.device(kind)
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def rank_args(description: str, presets: dict[str, dict[str, int]], argv: list[str] | None,
              more: Callable[[argparse.ArgumentParser], object] | None = None
              ) -> argparse.Namespace:
    """The flags of a rank of a distributed sample: the size presets, `--steps`,
    `--backend` (NCCL), `--device` (a rank uses cuda:LOCAL_RANK), `--seed`, and those
    `more` adds."""
    parser = preset_parser(description, presets, "override the preset's {} (batch: per rank)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--backend", default="nccl", help="torch.distributed backend")
    add_device_and_seed(parser, "torch device type (a rank uses cuda:LOCAL_RANK)")
    if more is not None:
        more(parser)
    return parse_with_presets(parser, presets, argv)


def run_rank(args: argparse.Namespace,
             wrap: Callable[[nn.Module, torch.device, int], nn.Module]) -> float:
    """Join the process group, build the MLP on this rank's device (the same initial weights
    on every rank), ``wrap(model, device, world size)`` it (DDP, FSDP), train it with AdamW
    on random batches (a different data shard per rank), leave the group; print and return
    this rank's final loss."""
    rank, world, local = join_process_group(args.backend)
    try:
        device = rank_device(args.device, local)
        torch.manual_seed(args.seed)
        model = wrap(build_mlp(RANK_IN, args.hidden, args.layers, RANK_OUT).to(device), device,
                     world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(args.seed + 1 + rank)
        loss = torch.zeros((), device=device)
        for _ in range(args.steps):
            optimizer.zero_grad(set_to_none=True)
            inputs = torch.randn(args.batch, RANK_IN, device=device)
            targets = torch.randn(args.batch, RANK_OUT, device=device)
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()  # DDP all-reduces, FSDP reduce-scatters the gradients here
            optimizer.step()
        print(f"rank {rank}/{world}: loss {loss.item():.4f} after {args.steps} steps")
        return loss.item()
    finally:
        dist.destroy_process_group()


RANK_IN, RANK_OUT = 64, 10  # the distributed samples' MLP: its inputs and outputs
