"""Repeated residual MLP blocks trained for a few steps with AdamW: as written, with the
blocks under the script's own activation checkpointing (``--ckpt``: reentrant or not, or
``inside`` each block's forward), or
its forward under CPU bf16 autocast (``--cpu-bf16``), or with CUDA autocast turned off
inside the model (``--no-autocast``: a remedy applied from outside changes nothing)."""

import argparse
import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d: int, inside: bool) -> None:
        super().__init__()
        self.inside = inside
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inside:  # checkpoints its own forward, as Hugging Face layers do
            return checkpoint(self.residual, x, use_reentrant=False)
        return self.residual(x)

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int, n: int, ckpt: str, autocast: bool) -> None:
        super().__init__()
        self.autocast = autocast
        self.blocks = nn.ModuleList(Block(d, ckpt == "inside") for _ in range(n))
        self.head = nn.Linear(d, 1)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with contextlib.nullcontext() if self.autocast else torch.autocast("cuda", enabled=False):
            for block in self.blocks:
                x = block(x) if self.ckpt in ("none", "inside") else checkpoint(
                    block, x, use_reentrant=self.ckpt == "reentrant")
            return self.head(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--ckpt", choices=["none", "reentrant", "non-reentrant", "inside"],
                   default="none")
    p.add_argument("--cpu-bf16", action="store_true")
    p.add_argument("--no-autocast", action="store_true")
    p.add_argument("--batch", type=int, default=16)
    a = p.parse_args()
    torch.manual_seed(0)
    model = Net(128, 4, a.ckpt, not a.no_autocast).to(a.device)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        x = torch.randn(a.batch, 64, 128, device=a.device, requires_grad=a.ckpt == "reentrant")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.cpu_bf16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
