"""A forward pass through named blocks with a causal-mask buffer: memprof's module attribution.

Example: `python sample_scripts/named_blocks.py --width 64 --hidden 256 --batch 32`.
The model holds `blocks.0.mlp.fc` ... `blocks.N.mlp.proj` and a `mask` buffer; the script
keeps the forward's graph (and so every activation autograd saved) alive at its end.
"""

from __future__ import annotations

import argparse

import torch
from common import add_device_and_seed
from torch import nn


class Mlp(nn.Module):
    """Linear, GELU (which saves its input: the Linear's output), Linear."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """A residual MLP block."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.mlp = Mlp(width, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Net(nn.Module):
    """`blocks` residual MLP blocks and a causal mask of `seq` x `seq` as a buffer."""

    def __init__(self, width: int, hidden: int, blocks: int, seq: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(blocks))
        self.register_buffer("mask", torch.ones(seq, seq).tril())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64, help="block input and output width")
    parser.add_argument("--hidden", type=int, default=256, help="MLP hidden width")
    parser.add_argument("--blocks", type=int, default=2, help="residual blocks")
    parser.add_argument("--seq", type=int, default=16, help="side of the causal mask buffer")
    parser.add_argument("--batch", type=int, default=32, help="batch size")
    add_device_and_seed(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> torch.Tensor:
    """Run one forward pass; return the loss, whose graph holds the saved activations."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = Net(args.width, args.hidden, args.blocks, args.seq).to(device)
    out = model(torch.randn(args.batch, args.width, device=device))
    loss = (out * out).sum()
    print(f"loss computed on {device}")
    return loss


if __name__ == "__main__":
    loss = main()
