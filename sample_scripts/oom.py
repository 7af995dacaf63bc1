"""Run out of GPU memory on purpose: train an MLP on ever larger batches until CUDA OOMs.

A memprof sample workload for out-of-memory diagnosis. The process is limited to a
fraction of the GPU with ``torch.cuda.set_per_process_memory_fraction`` (``--fraction``)
so that it fails quickly and leaves the rest of the card alone; the batch doubles every
step until ``torch.OutOfMemoryError``. On OOM the script prints what it was doing and
exits with status 1 (``sys.exit(message)``), as an unhandled OOM would.

Without CUDA there is nothing to run out of: the script says that it needs a GPU and
exits with status 0, so that CPU-only test suites can still run it.

Examples: `python sample_scripts/oom.py`, `python sample_scripts/oom.py --fraction 0.2`,
`memprof run sample_scripts/oom.py` (reports the failed request and what filled the GPU).
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import add_device_and_seed, build_mlp
from torch import nn

IN_FEATURES = 1024
OUT_FEATURES = 10


def build_model(hidden: int, layers: int) -> nn.Sequential:
    """`layers` blocks of Linear + ReLU, then a Linear head."""
    return build_mlp(IN_FEATURES, hidden, layers, OUT_FEATURES)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fraction", type=float, default=0.05,
                        help="share of the GPU's memory this process may use")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden width")
    parser.add_argument("--layers", type=int, default=4, help="hidden Linear+ReLU blocks")
    parser.add_argument("--batch", type=int, default=256, help="first batch size")
    parser.add_argument("--steps", type=int, default=40,
                        help="most steps (the batch doubles each step)")
    add_device_and_seed(parser, "torch device (OOM needs a CUDA device)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Grow the batch until CUDA runs out of memory; exit 1 when it does."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        print(f"oom.py needs a CUDA GPU to run out of memory (device {args.device!r},"
              f" CUDA available: {torch.cuda.is_available()}); nothing to do.")
        sys.exit(0)
    if not 0 < args.fraction <= 1:
        sys.exit(f"--fraction {args.fraction}: expected a number in (0, 1]")
    if device.index is None:  # set_per_process_memory_fraction needs the index
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(args.seed)
    torch.cuda.set_per_process_memory_fraction(args.fraction, device)
    limit = args.fraction * torch.cuda.get_device_properties(device).total_memory
    print(f"limited to {args.fraction:.0%} of {torch.cuda.get_device_name(device)}:"
          f" {limit / 2**30:.2f} GiB")
    model = build_model(args.hidden, args.layers).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = args.batch
    try:
        for step in range(1, args.steps + 1):
            optimizer.zero_grad(set_to_none=True)
            inputs = torch.randn(batch, IN_FEATURES, device=device)
            targets = torch.randn(batch, OUT_FEATURES, device=device)
            nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
            peak = torch.cuda.max_memory_allocated(device)
            print(f"step {step}: batch {batch} fits, peak {peak / 2**20:.1f} MiB")
            batch *= 2
    except torch.OutOfMemoryError as exc:
        first = str(exc).splitlines()[0]
        sys.exit(f"out of memory at batch {batch} (limit {args.fraction:.0%} of the GPU):"
                 f" {first}")
    print(f"batch {batch // 2} still fit after {args.steps} steps: raise --steps or lower"
          " --fraction to run out of memory")


if __name__ == "__main__":
    main()
