"""A Llama-shaped model trained with FSDP2, written the way torchtitan writes it: built on
the meta device, each decoder block a unit of its own (bf16 parameters in compute, fp32
reductions), then materialised on the card, AdamW, random tokens.

Run it as a user would, one process per GPU:

    torchrun --nproc-per-node 8 llama_fsdp.py --preset 8b --checkpoint
    memprof run --nproc-per-node 64 --ranks 0,63 llama_fsdp.py --preset 70b

Presets are Llama 3's shapes (8B: 32 layers of 4096; 70B: 80 layers of 8192; grouped
query attention with 8 key/value heads; a 128,256-token vocabulary).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

PRESETS = {
    "tiny": {"dim": 256, "layers": 2, "heads": 8, "kv_heads": 2, "ffn": 768, "vocab": 1024},
    "small": {"dim": 1024, "layers": 4, "heads": 16, "kv_heads": 4, "ffn": 2816,
              "vocab": 32000},
    "8b": {"dim": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "ffn": 14336,
           "vocab": 128256},
    "70b": {"dim": 8192, "layers": 80, "heads": 64, "kv_heads": 8, "ffn": 28672,
            "vocab": 128256},
}


class Block(nn.Module):
    """Pre-norm attention (grouped-query, rotary, SDPA) and a SwiGLU feed-forward."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, s, self.heads, self.head_dim)
        k = self.wk(h).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(h).view(b, s, self.kv_heads, self.head_dim)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True,
                                             enable_gqa=True)
        x = x + self.wo(out.transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over the last dimension's halves."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class Llama(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, kv_heads: int, ffn: int,
                 vocab: int, seq: int, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        half = dim // heads // 2
        angles = torch.outer(torch.arange(seq, dtype=torch.float32),
                             1.0 / 500000.0 ** (torch.arange(half) / half))
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for layer in self.layers:
            x = (checkpoint(layer, x, cos, sin, use_reentrant=False) if self.checkpointed
                 else layer(x, cos, sin))
        return self.output(self.norm(x))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor
               ) -> torch.Tensor:
    """One optimizer step on next-token prediction over ``tokens``; the loss."""
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    del logits
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--checkpoint", action="store_true",
                        help="recompute each decoder block in backward")
    parser.add_argument("--adamw", choices=("fused", "foreach"), default="fused",
                        help="AdamW's implementation")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    shape = PRESETS[args.preset]
    with torch.device("meta"):
        model = Llama(**shape, seq=args.seq, checkpointed=args.checkpoint)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        half = shape["dim"] // shape["heads"] // 2
        angles = torch.outer(torch.arange(args.seq, dtype=torch.float32, device="cuda"),
                             1.0 / 500000.0 ** (torch.arange(half, device="cuda") / half))
        model.cos.copy_(angles.cos()[None, :, None, :])
        model.sin.copy_(angles.sin()[None, :, None, :])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4,
                                  **{args.adamw: True})
    for step in range(args.steps):
        tokens = torch.randint(0, shape["vocab"], (args.batch, args.seq + 1), device="cuda")
        loss = train_step(model, optimizer, tokens)
        if dist.get_rank() == 0:
            print(f"step {step + 1}: loss {loss.item():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
