"""An LSTMCell sequence model trained with LBFGS on sine waves (many small ops per step).

A memprof benchmark workload in the manner of a time-series predictor: two LSTM cells
unrolled over every time step, LBFGS re-evaluating the closure up to 20 times per step,
so one optimizer step is several hundred thousand tensor operations.

Usage: python benchmarks/workloads/lbfgs_sequence.py [--steps N] [--length T] [--batch B]
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn


class Sequence(nn.Module):
    """Two stacked LSTM cells and a linear read-out, unrolled one time step at a time."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.cell1 = nn.LSTMCell(1, hidden)
        self.cell2 = nn.LSTMCell(hidden, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        zeros = x.new_zeros(x.size(0), self.hidden)
        h1, c1, h2, c2 = zeros, zeros, zeros, zeros
        outputs = []
        for x_t in x.split(1, dim=1):
            h1, c1 = self.cell1(x_t, (h1, c1))
            h2, c2 = self.cell2(h1, (h2, c2))
            outputs.append(self.head(h2))
        return torch.cat(outputs, dim=1)


def sine_waves(batch: int, length: int) -> torch.Tensor:
    """Phase-shifted sine waves, one per row."""
    t = torch.arange(length, dtype=torch.float64)
    shift = torch.randint(-80, 80, (batch, 1), dtype=torch.float64)
    return torch.sin((t + shift) / 20 * math.pi / 2).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="LBFGS steps")
    parser.add_argument("--length", type=int, default=300, help="time steps per sequence")
    parser.add_argument("--batch", type=int, default=97, help="sequences per batch")
    parser.add_argument("--hidden", type=int, default=51, help="LSTM hidden size")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = sine_waves(args.batch, args.length + 1)
    inputs, targets = data[:, :-1], data[:, 1:]
    model = Sequence(args.hidden)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.8)
    loss_fn = nn.MSELoss()
    for step in range(args.steps):
        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            return loss
        loss = optimizer.step(closure)
        print(f"step {step + 1}: loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
