"""The cards a virtual GPU can be: memory as the CUDA driver reports it, capability, context.

``total_bytes`` is what ``torch.cuda.get_device_properties(0).total_memory`` (the
driver's ``cudaMemGetInfo`` total) reports on that card, which is less than the
marketing size and less than nvidia-smi's total. It moves by a few MiB between driver
versions; the sources are given per card. ``_CudaDeviceProperties`` prints it in whole
MiB (truncated), OOM messages in GiB with two decimals.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memprof.sizes import parse_size

_MIB = 1 << 20

# The CUDA context (driver state, kernels loaded lazily, the cuBLAS handle) that a
# PyTorch process holds outside the caching allocator. No ground-truth run recorded
# nvidia-smi, so no card has a measured figure yet: this is the assumption, inside the
# 300-600 MiB that PyTorch processes with lazy module loading (CUDA 11.7+, the default
# since PyTorch 1.13) show beside memory_reserved() in nvidia-smi.
CONTEXT_ASSUMED_BYTES = 512 * _MIB


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
    # _CudaDeviceProperties total_memory=81089MB (torch 2.7, CUDA 12.8); also seen
    # 81082MB (torch 2.0.1+cu118), 81090MB, and "total capacity of 79.11 GiB" in a
    # 2025 vLLM OOM message (vllm-project/vllm#27508).
    Card("H100 80GB", "NVIDIA H100 80GB HBM3", 81089 * _MIB, (9, 0), 132),
    # gpu_total_bytes=99456909312 logged by torch 2.5.1+cu124 on an "NVIDIA H100 NVL";
    # an OOM on a RunPod H100 NVL says "total capacity of 93.00 GiB" (ali-vilab/VACE#56).
    Card("H100 NVL 94GB", "NVIDIA H100 NVL", 99456909312, (9, 0), 132),
    # "79.25 GiB total capacity" in an A100 80GB OOM message (levihsu/OOTDiffusion#235).
    Card("A100 80GB", "NVIDIA A100-SXM4-80GB", 81152 * _MIB, (8, 0), 108),
    # total_memory=40536MB for an A100-SXM4-40GB (the PCIe card reports 40326MB).
    Card("A100 40GB", "NVIDIA A100-SXM4-40GB", 40536 * _MIB, (8, 0), 108),
    # total_memory=45589MB, multi_processor_count=142.
    Card("L40S", "NVIDIA L40S", 45589 * _MIB, (8, 9), 142),
    # "total capacty of 21.99 GiB" on a Lambda A10 (zai-org/CogVLM#236, torch 2.0.1);
    # AWS's A10G reports total_memory=22587MB.
    Card("A10 24GB", "NVIDIA A10", 22517 * _MIB, (8, 6), 72),
    # No driver total found: nvidia-smi's 23034 MiB less the 470 MiB the driver keeps
    # back on an H100 (nvidia-smi 81559 MiB, torch 81089 MiB). An assumption.
    Card("L4", "NVIDIA L4", 22564 * _MIB, (8, 9), 58),
    # total_memory=24563MB, multi_processor_count=128.
    Card("RTX 4090", "NVIDIA GeForce RTX 4090", 24563 * _MIB, (8, 9), 128),
    # total_memory=24268MB, multi_processor_count=82 (Hugging Face docs, many logs).
    Card("RTX 3090", "NVIDIA GeForce RTX 3090", 24268 * _MIB, (8, 6), 82),
    # Tesla V100-SXM2-16GB total_memory=16160MB (many YOLO logs; "15.78 GiB total").
    Card("V100 16GB", "Tesla V100-SXM2-16GB", 16160 * _MIB, (7, 0), 80),
    # Tesla T4 total_memory=15109MB on Colab ("14.75 GiB total capacity"); 15079-15102MB
    # elsewhere.
    Card("T4", "Tesla T4", 15109 * _MIB, (7, 5), 40),
)

DEFAULT_CARD = CARDS[0]

# Names people type that the card's own name does not already give.
_ALIASES = {
    "H100 80GB": ("h100", "h100sxm", "h100sxm5", "h100sxm80gb", "h100sxm580gb", "h10080gbhbm3"),
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
            f"unknown virtual GPU {text!r}: give a card ({card_names()}) "
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
