"""Train a small MLP with Adam on random data: a memprof sample workload.

Example: `python sample_scripts/mlp_adam.py --hidden 1024 --layers 4 --steps 10`.
"""

from __future__ import annotations

import argparse

import torch
from common import add_device_and_seed, build_mlp
from torch import nn

IN_FEATURES = 128
OUT_FEATURES = 10


def build_model(hidden: int, layers: int) -> nn.Sequential:
    """`layers` blocks of Linear + ReLU, then a Linear head."""
    return build_mlp(IN_FEATURES, hidden, layers, OUT_FEATURES)


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: int, device: torch.device
) -> float:
    """One step on a fresh random batch; returns the loss."""
    optimizer.zero_grad()
    inputs = torch.randn(batch, IN_FEATURES, device=device)
    targets = torch.randn(batch, OUT_FEATURES, device=device)
    loss = nn.functional.mse_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.item()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256, help="hidden width")
    parser.add_argument("--layers", type=int, default=3, help="hidden Linear+ReLU blocks")
    parser.add_argument("--batch", type=int, default=64, help="batch size")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps")
    add_device_and_seed(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Train and return the model and its optimizer."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = build_model(args.hidden, args.layers).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = float("nan")
    for _ in range(args.steps):
        loss = train_step(model, optimizer, args.batch, device)
    print(f"final loss {loss:.4f} after {args.steps} steps")
    return model, optimizer


if __name__ == "__main__":
    main()
