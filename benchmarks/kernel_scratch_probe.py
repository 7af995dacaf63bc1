"""What attention and embedding kernels allocate on a real card, request by request.

Usage, on a machine with a CUDA GPU:
    python benchmarks/kernel_scratch_probe.py OUT.json [--only unmasked|masked|embedding]

For each case (scaled_dot_product_attention over dtypes, sequence lengths, head dims,
causal or not, dropout or not, contiguous or strided inputs, boolean and additive masks
of several shapes, with the backend PyTorch picks and with each fused backend forced;
the embedding's forward and backward at several token counts) it runs forward and
backward twice with PyTorch's allocator history on, and writes the allocator's own
requests (``alloc`` / ``free_requested``, their sizes, and which free ends which
allocation) to OUT.json. The virtual GPU's kernel models (``collect/virtual/
attention.py``, ``kernel_memory.py``) are checked against this file.
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BATCH, HEADS = 2, 4
FORCED = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# attention masks: (dtype, shape) with B, H, S for batch, heads, sequence
MASKS = {"bool_ss": ("bool", "SS"), "bool_b1ss": ("bool", "B1SS"), "bool_bhss": ("bool", "BHSS"),
         "float_ss": ("float", "SS"), "float_b1ss": ("float", "B1SS")}


def requests(run: Any) -> list[list[Any]]:
    """Run ``run()`` with history on: its [action, size, allocation index] requests."""
    torch.cuda.synchronize()
    before = len(torch.cuda.memory._snapshot()["device_traces"][0])
    run()
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][0][before:]
    index: dict[int, int] = {}
    events = []
    for entry in trace:
        if entry["action"] == "alloc":
            index[entry["addr"]] = len(events)
            events.append(["alloc", entry["size"], len(events)])
        elif entry["action"] == "free_requested":
            events.append(["free", entry["size"], index.pop(entry["addr"], None)])
    return events


def attention_inputs(dtype: torch.dtype, seq: int, dim: int, layout: str, kv_heads: int
                     ) -> list[torch.Tensor]:
    """q, k, v leaves that need grad, (B, H, S, D) contiguous or views of (B, S, H, D)."""
    tensors = []
    for heads in (HEADS, kv_heads, kv_heads):
        shape = (BATCH, heads, seq, dim) if layout == "bhsd" else (BATCH, seq, heads, dim)
        leaf = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
        tensors.append(leaf if layout == "bhsd" else leaf.transpose(1, 2))
    return tensors


def attention_mask(kind: str | None, dtype: torch.dtype, seq: int) -> torch.Tensor | None:
    """The ``attn_mask`` of kind ``kind`` (``MASKS``): bool, or additive in ``dtype``."""
    if kind is None:
        return None
    values, shape = MASKS[kind]
    sizes = {"B": BATCH, "H": HEADS, "S": seq, "1": 1}
    mask = torch.rand([sizes[c] for c in shape], device="cuda") > 0.1
    return mask if values == "bool" else torch.zeros(mask.shape, device="cuda", dtype=dtype
                                                     ).masked_fill(~mask, float("-inf"))


def attention_case(dtype: str, seq: int, dim: int, causal: bool, dropout: float, layout: str,
                   backend: str, kv_heads: int = HEADS, mask_kind: str | None = None
                   ) -> dict[str, Any]:
    """One SDPA case: the backend PyTorch picks, then two forward+backward passes."""
    case: dict[str, Any] = dict(op="sdpa", dtype=dtype, batch=BATCH, heads=HEADS,
                                kv_heads=kv_heads, seq=seq, dim=dim, causal=causal,
                                dropout=dropout, layout=layout, backend=backend, mask=mask_kind)
    q, k, v = attention_inputs(DTYPES[dtype], seq, dim, layout, kv_heads)
    mask = attention_mask(mask_kind, DTYPES[dtype], seq)
    gqa = kv_heads != HEADS
    try:
        case["picked"] = SDPBackend(torch._fused_sdp_choice(
            q, k, v, mask, dropout, causal, enable_gqa=gqa)).name
    except Exception as exc:  # the choice itself may refuse (e.g. GQA with fused kernels)
        case["picked"] = f"error: {exc}"[:200]
    grad = torch.randn(q.shape, device="cuda", dtype=q.dtype)

    def passes() -> None:
        for _ in range(2):
            out = F.scaled_dot_product_attention(q, k, v, mask, dropout_p=dropout,
                                                 is_causal=causal, enable_gqa=gqa)
            out.backward(grad)
            del out
    try:
        if backend == "default":
            case["events"] = requests(passes)
        else:
            with sdpa_kernel([FORCED[backend]]):
                case["events"] = requests(passes)
    except Exception as exc:  # a forced backend that does not take these inputs
        case["error"] = str(exc).splitlines()[0][:200]
    return case


def embedding_case(tokens: int, dtype: str, vocab: int = 50304, width: int = 768
                   ) -> dict[str, Any]:
    """nn.Embedding forward and backward over ``tokens`` random indices, twice."""
    table = torch.nn.Embedding(vocab, width, device="cuda", dtype=DTYPES[dtype])
    index = torch.randint(0, vocab, (tokens,), device="cuda")

    def passes() -> None:
        for _ in range(2):
            table(index).sum().backward()
            table.weight.grad = None
    return dict(op="embedding", dtype=dtype, tokens=tokens, vocab=vocab, width=width,
                events=requests(passes))


def unmasked() -> list[dict[str, Any]]:
    """Attention without a mask, over every backend; memory-efficient's fp32 head dims."""
    cases = []
    for dtype, seq, dim, causal, dropout, layout in itertools.product(
            ("bf16", "fp32"), (1000, 1024, 2048), (64, 128), (False, True), (0.0, 0.125),
            ("bhsd", "bshd")):
        cases.append(attention_case(dtype, seq, dim, causal, dropout, layout, "default"))
    for backend, dtype, seq, dim, causal, dropout in itertools.product(
            FORCED, ("bf16", "fp16"), (1000, 1024, 2048), (64, 96, 128, 256), (False, True),
            (0.0, 0.125)):
        cases.append(attention_case(dtype, seq, dim, causal, dropout, "bshd", backend))
    for seq, dim in itertools.product((1000, 1024, 2048), (64, 96, 128, 256)):
        cases.append(attention_case("fp32", seq, dim, True, 0.0, "bshd", "efficient"))
        cases.append(attention_case("bf16", seq, dim, True, 0.0, "bshd", "default", kv_heads=2))
    return cases


def masked() -> list[dict[str, Any]]:
    """Attention with each kind of mask, as picked and on each fused backend forced."""
    return [attention_case(dtype, seq, dim, False, dropout, "bshd", backend, mask_kind=kind)
            for backend, dtype, seq, dim, dropout, kind in itertools.product(
                ("default", "cudnn", "efficient"), ("bf16", "fp16"), (1000, 1024), (64, 128),
                (0.0, 0.125), MASKS)]


def embeddings() -> list[dict[str, Any]]:
    """GPT-2's embedding at three token counts; then vocabularies and widths from a
    character model's to GPT-2's."""
    return [*(embedding_case(tokens, dtype)
              for tokens, dtype in itertools.product((1000, 8192, 16384), ("fp32", "bf16"))),
            *(embedding_case(tokens, "fp32", vocab, width)
              for tokens, vocab, width in itertools.product(
                  (4096, 16384), (65, 1024, 8192, 50304), (64, 384, 768)))]


GROUPS = {"unmasked": unmasked, "masked": masked, "embedding": embeddings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON file to write")
    parser.add_argument("--only", choices=GROUPS, action="append",
                        help="run only these groups of cases (default: all)")
    args = parser.parse_args()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=None,
                                             stacks="python")
    cases = [case for name in args.only or GROUPS for case in GROUPS[name]()]
    facts = dict(torch=torch.__version__, cuda=torch.version.cuda,
                 cudnn=torch.backends.cudnn.version(), name=torch.cuda.get_device_name(0),
                 capability=list(torch.cuda.get_device_capability(0)), cases=cases)
    with open(args.out, "w") as file:
        json.dump(facts, file)
    print(f"{len(cases)} cases, {sum('error' in c for c in cases)} refused by their backend")


if __name__ == "__main__":
    main()
