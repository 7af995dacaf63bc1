"""What the sample scripts share: an MLP, size presets as flags, the --device and --seed flags.

The samples import it with ``from common import ...``: Python puts a script's folder first
on ``sys.path`` (``python sample_scripts/X.py`` and ``memprof run`` alike); each sample also
puts it there itself, for code that imports the sample by its path (the tests do).
"""

from __future__ import annotations

import argparse

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
