"""The cards a virtual GPU can be: memory as the CUDA driver reports it, capability, context.

``total_bytes`` is what ``torch.cuda.get_device_properties(0).total_memory`` (the
driver's ``totalGlobalMem``, deviceQuery's "Total amount of global memory") reports on
that card: less than the marketing size and less than nvidia-smi's total. It moves by
tens of MiB between driver versions; the sources are given per card (exact bytes from
deviceQuery where found; ``_CudaDeviceProperties`` prints whole MiB, OOM messages GiB
with two decimals).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memprof.sizes import parse_size
from memprof.trace.fields import describe

_MIB = 1 << 20

# The CUDA context (driver state, kernels loaded lazily, the cuBLAS handle) that a
# PyTorch process holds outside the caching allocator. Measured on one card only, the
# H200 (tests/fixtures/gpu, benchmarks/results/gpu-validation.md): NVML's memory for the
# process less memory_reserved() was 742 MiB after training with cuBLAS (torch
# 2.11.0+cu130, driver 580.159.04), 758 MiB with cuDNN convolutions or bf16 autocast,
# 676 MiB without cuBLAS. Other cards keep the assumption, inside the 300-600 MiB that
# PyTorch processes with lazy module loading (CUDA 11.7+) were reported to show beside
# memory_reserved() in nvidia-smi with CUDA 11 and 12; CUDA 13 loads more. The one
# ground-truth fixture that tells (Constructor-Sun's OOM on device 1: 78.42 GiB reserved
# + 91.25 MiB free, an 80 GB non-Hopper card) leaves about 0.75 GiB on an A100 80GB, but
# that process also held nn.DataParallel's NCCL state: not a clean measurement.
CONTEXT_ASSUMED_BYTES = 512 * _MIB
CONTEXT_H200_BYTES = 742 * _MIB


@dataclass(frozen=True)
class Card:
    """One GPU model as a script on it would see it."""

    name: str
    device_name: str  # what torch.cuda.get_device_name() returns
    total_bytes: int
    capability: tuple[int, int]
    sm_count: int
    context_bytes: int = CONTEXT_ASSUMED_BYTES
    context_measured: bool = False

    @property
    def usable_bytes(self) -> int:
        """What the caching allocator can reserve before the card is full."""
        return self.total_bytes - self.context_bytes


CARDS: tuple[Card, ...] = (
    # deviceQuery "81090 MBytes (85028896768 bytes)" (driver 12.8), the same 81090MB that
    # torch's _CudaDeviceProperties prints; other drivers: 81079-81106 MiB, and "total
    # capacity of 79.11 GiB" in a 2025 vLLM OOM message (vllm-project/vllm#27508).
    Card("H100 80GB", "NVIDIA H100 80GB HBM3", 85028896768, (9, 0), 132),
    # measured by this project: total_memory 150109880320 ("total capacity of 139.80 GiB"
    # in its OOM message) on driver 580.159.04, torch 2.11.0+cu130; nvidia-smi: 143771MiB.
    Card("H200", "NVIDIA H200", 150109880320, (9, 0), 132, CONTEXT_H200_BYTES, True),
    # gpu_total_bytes=99456909312 logged by torch 2.5.1+cu124 on an "NVIDIA H100 NVL";
    # a RunPod H100 NVL's OOM says "total capacity of 93.00 GiB" (ali-vilab/VACE#56).
    Card("H100 NVL 94GB", "NVIDIA H100 NVL", 99456909312, (9, 0), 132),
    # deviceQuery "81158 MBytes (85100068864 bytes)" (driver 12.5); 81051 MiB on 12.3,
    # and "79.25 GiB total capacity" in an OOM message (levihsu/OOTDiffusion#235).
    Card("A100 80GB", "NVIDIA A100-SXM4-80GB", 85100068864, (8, 0), 108),
    # total_memory=40536MB for an A100-SXM4-40GB (the PCIe card reports 40326MB).
    Card("A100 40GB", "NVIDIA A100-SXM4-40GB", 40536 * _MIB, (8, 0), 108),
    # deviceQuery "45373 MBytes (47576711168 bytes)" (driver 12.4); 45589MB elsewhere.
    Card("L40S", "NVIDIA L40S", 47576711168, (8, 9), 142),
    # deviceQuery "22516 MBytes (23609475072 bytes)" (driver 12.2), the "total capacty of
    # 21.99 GiB" of a Lambda A10 OOM (zai-org/CogVLM#236); 22599 MiB on driver 12.8.
    Card("A10 24GB", "NVIDIA A10", 23609475072, (8, 6), 72),
    # deviceQuery "22518 MBytes (23612293120 bytes)" (driver 12.0).
    Card("L4", "NVIDIA L4", 23612293120, (8, 9), 58),
    # deviceQuery "24564 MBytes (25756696576 bytes)" (Linux, driver 12.1); torch prints
    # 24563MB; Windows/WSL drivers keep more back (23028-24081 MiB).
    Card("RTX 4090", "NVIDIA GeForce RTX 4090", 25756696576, (8, 9), 128),
    # deviceQuery "24268 MBytes (25447170048 bytes)" (driver 11.8), torch's 24268MB.
    Card("RTX 3090", "NVIDIA GeForce RTX 3090", 25447170048, (8, 6), 82),
    # deviceQuery "16160 MBytes (16945512448 bytes)", torch's 16160MB ("15.78 GiB").
    Card("V100 16GB", "Tesla V100-SXM2-16GB", 16945512448, (7, 0), 80),
    # deviceQuery "15110 MBytes (15843721216 bytes)"; torch 15109MB on Colab
    # ("14.75 GiB total capacity"), 15079-15102MB elsewhere.
    Card("T4", "Tesla T4", 15843721216, (7, 5), 40),
)

DEFAULT_CARD = CARDS[0]

# Names people type that the card's own name does not already give.
_ALIASES = {
    "H100 80GB": ("h100", "h100sxm", "h100sxm5", "h100sxm80gb", "h100sxm580gb", "h10080gbhbm3"),
    "H200": ("h200sxm", "h200141gb", "h200sxm141gb", "h200sxm5141gb"),
    "H100 NVL 94GB": ("h100nvl", "h100nvl94gb", "h10094gb"),
    "A100 80GB": ("a100", "a100sxm480gb", "a100sxm80gb", "a10080gbpcie"),
    "A100 40GB": ("a100sxm440gb", "a100pcie40gb", "a100sxm40gb"),
    "L40S": ("l40s48gb",),
    "A10 24GB": ("a10",),
    "L4": ("l424gb",),
    "RTX 4090": ("4090",),
    "RTX 3090": ("3090",),
    "V100 16GB": ("v100", "v100sxm216gb", "v100pcie16gb"),
    "T4": ("t416gb",),
}


def _key(text: str) -> str:
    key = re.sub(r"[^a-z0-9]", "", text.lower())
    key = re.sub(r"^(nvidia|tesla|geforce)+", "", key)
    return key.replace("gib", "gb")


_BY_KEY = {
    key: card
    for card in CARDS
    for key in (_key(card.name), _key(card.device_name), *_ALIASES.get(card.name, ()))
}


def card_names() -> str:
    """The card table's names, for messages: ``'H100 80GB, H100 NVL 94GB, ...'``."""
    return ", ".join(card.name for card in CARDS)


def parse_spec(text: str) -> Card:
    """The card a ``--virtual-gpu`` spec names: ``'a100-40gb'``, ``'H100'``, ``'24GiB'``.

    A size gives a card of that total memory with the default card's capability and
    context. Raise ValueError with a one-line message that lists the cards otherwise.
    """
    card = _BY_KEY.get(_key(text))
    if card is not None:
        return card
    try:
        total = parse_size(text)
    except ValueError:
        total = None
    if total is None or total <= DEFAULT_CARD.context_bytes:
        raise ValueError(
            f"unknown virtual GPU {describe(text)}: give a card ({card_names()}) "
            f"or a memory size above the {DEFAULT_CARD.context_bytes // _MIB} MiB "
            "CUDA context, such as 24GiB"
        )
    return Card(
        name=f"GPU with {total / (1 << 30):.4g} GiB",
        device_name="memprof virtual GPU",
        total_bytes=total,
        capability=DEFAULT_CARD.capability,
        sm_count=DEFAULT_CARD.sm_count,
    )


def recorded_card(virtual: dict[str, object]) -> Card:
    """The card a report's ``run.virtual_gpu`` names: by its spec, or by its memory where
    the run was given a size ("GPU with 6 GiB"). ValueError where it is neither."""
    spec, total = virtual.get("spec"), virtual.get("total_bytes")
    try:
        return parse_spec(str(spec))
    except ValueError:
        if not str(spec).startswith("GPU with ") or type(total) is not int:
            raise
        return parse_spec(str(total))


def card_args(card: Card) -> list[str]:
    """The ``memprof run`` options that name ``card``: ``--virtual-gpu`` with its table name
    (and ``--virtual-gpu-memory`` where its memory was changed), or with its size."""
    try:
        named = parse_spec(card.name)
    except ValueError:  # "GPU with 24 GiB": a size
        return ["--virtual-gpu", str(card.total_bytes)]
    if named.total_bytes != card.total_bytes:
        return ["--virtual-gpu", card.name, "--virtual-gpu-memory", str(card.total_bytes)]
    return ["--virtual-gpu", card.name]
