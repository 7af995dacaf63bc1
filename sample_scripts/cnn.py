"""Train a small convolutional network with SGD and momentum on random images.

A memprof sample workload: stages of Conv2d + BatchNorm2d + ReLU + max pooling, global
average pooling and a Linear head, with a cross-entropy loss.

Examples: `python sample_scripts/cnn.py` (tiny, a few seconds on a CPU),
`python sample_scripts/cnn.py --size real --steps 20` (224x224 images, batch 64, four wide
stages; meant for a GPU). Any size flag overrides the preset.
"""

from __future__ import annotations

import argparse

import torch
from common import add_device_and_seed, parse_with_presets, preset_parser
from torch import nn
from torch.nn import functional as F

PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"image": 32, "batch": 8, "width": 16, "stages": 2, "classes": 10},
    "real": {"image": 224, "batch": 64, "width": 64, "stages": 4, "classes": 1000},
}


def build_model(width: int, stages: int, classes: int, in_channels: int = 3) -> nn.Sequential:
    """`stages` of Conv-BN-ReLU ×2 then 2x2 max pooling, doubling the channels each stage."""
    layers: list[nn.Module] = []
    channels = in_channels
    for stage in range(stages):
        out = width << stage
        for _ in range(2):
            layers += [nn.Conv2d(channels, out, 3, padding=1, bias=False), nn.BatchNorm2d(out),
                       nn.ReLU(inplace=True)]
            channels = out
        layers.append(nn.MaxPool2d(2))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)]
    return nn.Sequential(*layers)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace,
               device: torch.device) -> float:
    """One step on a fresh batch of random images and labels; returns the loss."""
    images = torch.randn(args.batch, 3, args.image, args.image, device=device)
    labels = torch.randint(args.classes, (args.batch,), device=device)
    loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags; the size flags default to the chosen preset's values."""
    parser = preset_parser(__doc__.splitlines()[0], PRESETS)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    add_device_and_seed(parser)
    return parse_with_presets(parser, PRESETS, argv)


def main(argv: list[str] | None = None) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """Train and return the model and its optimizer."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = build_model(args.width, args.stages, args.classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    print(f"CNN: {args.stages} stages from width {args.width}, {args.image}x{args.image} images,"
          f" batch {args.batch}, {sum(p.numel() for p in model.parameters()):,} parameters")
    loss = float("nan")
    for _ in range(args.steps):
        loss = train_step(model, optimizer, args, device)
    print(f"final loss {loss:.4f} after {args.steps} steps")
    return model, optimizer


if __name__ == "__main__":
    main()
