"""A tiny attention model trained for a few steps, with the habits ``memprof suggest``
looks for: hand-written or fused attention, zero_grad's set_to_none, and an evaluation
after each step with or without grad (its losses kept, as a careless loop would)."""

import argparse

import torch
from torch import nn

B, H, T, D = 4, 2, 512, 16


class Attention(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        self.qkv = nn.Linear(H * D, 3 * H * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.size(0), T, 3, H, D).permute(2, 0, 3, 1, 4)
        if self.fused:
            o = nn.functional.scaled_dot_product_attention(q, k, v)
        else:
            o = ((q @ k.transpose(-2, -1)) / D**0.5).softmax(-1) @ v
        return o.transpose(1, 2).reshape(x.size(0), T, H * D)


def build(fused: bool) -> nn.Module:
    return nn.Sequential(Attention(fused), nn.Linear(H * D, 1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fused", action="store_true")
    p.add_argument("--set-to-none", type=int, default=1)
    p.add_argument("--eval", choices=["grad", "no_grad"], default="no_grad")
    a = p.parse_args()
    torch.manual_seed(0)
    model = build(a.fused).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    losses = []
    for _ in range(3):
        model(torch.randn(B, T, H * D, device="cuda")).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=bool(a.set_to_none))
        model.eval()
        with torch.set_grad_enabled(a.eval == "grad"):
            losses.append(model(torch.randn(1, T, H * D, device="cuda")).sum())
        model.train()


if __name__ == "__main__":
    main()
