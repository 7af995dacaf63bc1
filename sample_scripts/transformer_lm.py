"""Train a small GPT-style decoder language model with AdamW on random tokens.

A memprof sample workload: token and position embeddings, N pre-LayerNorm blocks of
causal self-attention and an MLP, a final LayerNorm and an LM head.

Examples: `python sample_scripts/transformer_lm.py` (tiny, a few seconds on a CPU),
`python sample_scripts/transformer_lm.py --size real --steps 20` (GPT-2 small: 12 layers,
d_model 768, 1024 tokens; meant for a GPU). Any size flag overrides the preset.
"""

from __future__ import annotations

import argparse

import torch
from common import add_device_and_seed, parse_with_presets, preset_parser
from torch import nn
from torch.nn import functional as F

PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"layers": 2, "d_model": 64, "heads": 4, "seq": 32, "batch": 4, "vocab": 256},
    "real": {"layers": 12, "d_model": 768, "heads": 12, "seq": 1024, "batch": 8,
             "vocab": 50257},
}
AMP = {"off": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier ones."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class DecoderLM(nn.Module):
    """A GPT-style decoder: embeddings, blocks, final LayerNorm, LM head."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(args: argparse.Namespace) -> DecoderLM:
    """The model the parsed flags describe."""
    return DecoderLM(args.vocab, args.d_model, args.heads, args.layers, args.seq)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace,
               device: torch.device) -> float:
    """One next-token-prediction step on fresh random tokens; returns the loss."""
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.autocast(device.type, dtype=AMP[args.amp], enabled=args.amp != "off"):
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags; the size flags default to the chosen preset's values."""
    parser = preset_parser(__doc__.splitlines()[0], PRESETS)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps")
    parser.add_argument("--amp", choices=sorted(AMP), default="off",
                        help="autocast the forward pass to this dtype")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    add_device_and_seed(parser)
    return parse_with_presets(parser, PRESETS, argv)


def main(argv: list[str] | None = None) -> tuple[DecoderLM, torch.optim.Optimizer]:
    """Train and return the model and its optimizer."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    with device:  # parameters made where they live: no host copy of a large model
        model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    step_model = torch.compile(model) if args.compile else model
    n_params = sum(p.numel() for p in model.parameters())
    print(f"decoder LM: {args.layers} layers, d_model {args.d_model}, {args.heads} heads,"
          f" seq {args.seq}, batch {args.batch}, vocab {args.vocab}: {n_params:,} parameters")
    loss = float("nan")
    for _ in range(args.steps):
        loss = train_step(step_model, optimizer, args, device)
    print(f"final loss {loss:.4f} after {args.steps} steps")
    if device.type == "cuda":
        print(f"max_memory_allocated {torch.cuda.max_memory_allocated()}")
    return model, optimizer


if __name__ == "__main__":
    main()
