"""Train an MLP with a classic memory leak: summing loss tensors instead of numbers.

A memprof sample workload. Every step trains on a fresh batch, then measures the loss on
a fixed held-out batch for logging and adds it up with ``total_loss += loss``. The
held-out forward runs outside ``torch.no_grad()`` and no backward ever consumes it, so
the sum keeps every step's autograd graph alive, and with it the activations that graph
saved for a backward that never comes: memory grows by one forward's activations per
step until the loop ends. (Summing the *training* loss this way keeps the graphs too,
but their saved tensors are freed by ``loss.backward()``, so the growth is small.)
The fix is ``total_loss += loss.item()``; ``--fixed`` runs that version.

Examples: `python sample_scripts/leak.py` (tiny, a few seconds on a CPU),
`python sample_scripts/leak.py --size real --steps 50` (meant for a GPU).
"""

from __future__ import annotations

import argparse

import torch
from common import add_device_and_seed, build_mlp, parse_with_presets, preset_parser
from torch import nn

IN_FEATURES = 128
OUT_FEATURES = 10
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 256, "layers": 2, "batch": 64},
    "real": {"hidden": 4096, "layers": 4, "batch": 2048},
}


def build_model(hidden: int, layers: int) -> nn.Sequential:
    """`layers` blocks of Linear + ReLU, then a Linear head."""
    return build_mlp(IN_FEATURES, hidden, layers, OUT_FEATURES)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags; the size flags default to the chosen preset's values."""
    parser = preset_parser(__doc__.splitlines()[0], PRESETS)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--fixed", action="store_true",
                        help="sum loss.item() instead of the loss tensor: no leak")
    add_device_and_seed(parser)
    return parse_with_presets(parser, PRESETS, argv)


def main(argv: list[str] | None = None) -> float:
    """Train; return the mean held-out loss over the steps."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = build_model(args.hidden, args.layers).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    held_out = torch.randn(args.batch, IN_FEATURES, device=device)
    held_out_targets = torch.randn(args.batch, OUT_FEATURES, device=device)
    total_loss: torch.Tensor | float = 0.0
    for _ in range(args.steps):
        optimizer.zero_grad()
        inputs = torch.randn(args.batch, IN_FEATURES, device=device)
        targets = torch.randn(args.batch, OUT_FEATURES, device=device)
        loss_fn(model(inputs), targets).backward()
        optimizer.step()

        loss = loss_fn(model(held_out), held_out_targets)  # no torch.no_grad(): a graph
        if args.fixed:
            total_loss += loss.item()
        else:
            total_loss += loss  # the leak: keeps this step's graph and its activations alive
    mean = float(total_loss) / max(args.steps, 1)
    print(f"mean held-out loss {mean:.4f} over {args.steps} steps")
    return mean


if __name__ == "__main__":
    main()
