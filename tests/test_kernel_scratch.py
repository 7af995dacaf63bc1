"""The virtual GPU's kernels against an H200's, request by request.

``benchmarks/kernel_scratch_probe.py`` ran scaled_dot_product_attention (the backend
PyTorch picks, and cuDNN's, flash and memory-efficient attention forced; dtypes, sequence
lengths, head dims, causal, dropout, grouped-query heads, boolean and additive masks) and
the embedding's backward (vocabularies of 65 to 50,304) on the card, forward and
backward twice each, and kept the caching allocator's requests
(``tests/fixtures/gpu/kernel_scratch``: torch 2.11.0+cu130, cuDNN 9.19). The same script
runs here under ``memprof run --virtual-gpu H200``; every case must request the same
sizes and reach the same peak, but the kernels the model does not cover.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import GPU_FIXTURES, ROOT
from test_run_cli import run_python

from memprof.collect.virtual.attention import CUDNN, EFFICIENT, FLASH, choose_kernel
from memprof.collect.virtual.cards import parse_spec

PROBE = ROOT / "benchmarks" / "kernel_scratch_probe.py"
CARD = GPU_FIXTURES / "kernel_scratch"
GROUPS = ("unmasked", "masked", "embedding")


def card_cases(group: str) -> list[dict[str, Any]]:
    with gzip.open(CARD / f"{group}.json.gz", "rt") as f:
        return json.load(f)["cases"]


@pytest.fixture(scope="module")
def predicted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future[Path]]:
    """The probe's cases under the virtual H200, a group per run, two at a time."""
    def predict(group: str) -> Path:
        where = tmp_path_factory.mktemp(group)
        result = run_python(["-m", "memprof", "run", "--virtual-gpu", "H200", "--no-timeline",
                             "-o", where / "out", PROBE, where / "cases.json", "--only", group],
                            where)
        assert result.code == 0, result.stderr[-3000:]
        return where / "cases.json"
    with ThreadPoolExecutor(2) as pool:
        yield {group: pool.submit(predict, group) for group in GROUPS}


def _sizes(case: dict[str, Any]) -> Counter[int]:
    return Counter(size for action, size, _ in case["events"] if action == "alloc")


def _peak(case: dict[str, Any]) -> int:
    """The most bytes the case's requests held at once."""
    live: dict[int, int] = {}
    held = most = 0
    for action, size, index in case["events"]:
        if action == "alloc":
            live[index] = size
            held += size
        elif index in live:
            held -= live.pop(index)
        most = max(most, held)
    return most


def _unmodelled(case: dict[str, Any]) -> bool:
    """Memory-efficient attention's 16-bit kernels for heads above 128 (their dQ tiles)."""
    return case["op"] == "sdpa" and case["backend"] == "efficient" and case["dtype"] != "fp32" \
        and case["dim"] > 128


@pytest.mark.parametrize("group", GROUPS)
def test_every_kernel_requests_what_the_card_did(predicted: dict[str, Future[Path]], group: str
                                                 ) -> None:
    card = card_cases(group)
    virtual = json.loads(predicted[group].result().read_text())["cases"]
    assert len(virtual) == len(card)
    differ = [{k: v for k, v in c.items() if k != "events"}
              for c, v in zip(card, virtual, strict=True)
              if not _unmodelled(c) and (_sizes(c) != _sizes(v) or _peak(c) != _peak(v))]
    assert differ == []
    # the heads it does not model request less than the card's, never more
    short = [(c, v) for c, v in zip(card, virtual, strict=True) if _unmodelled(c)]
    assert len(short) == (24 if group == "unmasked" else 0)
    assert all(_peak(v) < _peak(c) for c, v in short)


def test_sm90_picks_cudnn_attention_as_the_card_did(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    q = torch.empty(2, 4, 1000, 64, dtype=torch.bfloat16, device="meta")
    h200, a100 = parse_spec("H200"), parse_spec("A100 80GB")
    picked = {c["picked"] for c in card_cases("unmasked") + card_cases("masked")
              if c["backend"] == "default" and c["dtype"] == "bf16"}
    assert picked == {"CUDNN_ATTENTION"}  # masks, dropout and grouped-query heads too
    assert choose_kernel(h200, q, q, q, None) == CUDNN
    assert choose_kernel(h200, q, q, q, torch.empty(1000, 1000, dtype=torch.bool,
                                                    device="meta")) == CUDNN
    assert choose_kernel(a100, q, q, q, None) == FLASH  # cuDNN goes first on sm90 and sm100
    assert choose_kernel(h200, q.float(), q.float(), q.float(), None) == EFFICIENT
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert choose_kernel(h200, q, q, q, None) == FLASH
