"""Staging buffers of CUDA global reductions against what real GPUs recorded.

The H200 run of ``sample_scripts/oom.py`` (torch 2.11.0+cu130, 132 SMs) doubles the batch
every step: its ``mse_loss`` mean and its bias-gradient sums (``sum_to`` over the batch)
pass from no global reduce to block-limited and SM-limited staging buffers. Each staging
buffer shows in the trace as two short-lived requests right after the reduction's
output (buffer, semaphores), freed in reverse order before the next request.
"""

from __future__ import annotations

import pickle
from functools import cache
from pathlib import Path

import pytest
import torch

from memprof.collect.virtual.reductions import max_threads_per_sm, reduction_staging
from tests.conftest import GPU_FIXTURES, GROUNDTRUTH_SNAPSHOTS

OOM = GPU_FIXTURES / "oom" / "oom-snapshot.pickle"
IN_FEATURES, HIDDEN, OUT_FEATURES, LAYERS = 1024, 2048, 10, 4  # oom.py's defaults
H200_SMS, H200_CAPABILITY = 132, (9, 0)  # the card that recorded it
FP32 = {"itemsize": 4, "out_itemsize": 4, "acc_itemsize": 4}

Event = tuple[str, int, int, str]  # action, addr, size, innermost frame's function


@cache
def _events(path: Path) -> tuple[Event, ...]:
    """Requests and frees (free_requested) of a snapshot's first device, in order."""
    with path.open("rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    return tuple((e["action"], e["addr"], e["size"], e["frames"][0]["name"] if e["frames"]
                  else "") for e in trace if e["action"] in ("alloc", "free_requested"))


def _pair(ev: tuple[Event, ...], i: int) -> list[int]:
    """[buffer, semaphores] if a staging pair starts at i: a, b requested, b, a freed,
    b a whole number of ints and smaller than a (4 bytes per output block)."""
    if i + 3 < len(ev) and ev[i][0] == ev[i + 1][0] == "alloc" \
            and ev[i + 2][:2] == ("free_requested", ev[i + 1][1]) \
            and ev[i + 3][:2] == ("free_requested", ev[i][1]) \
            and ev[i + 1][2] % 4 == 0 and ev[i + 1][2] < ev[i][2]:
        return [ev[i][2], ev[i + 1][2]]
    return []


def _next_alloc(ev: tuple[Event, ...], i: int) -> int:
    return next((j for j in range(i + 1, len(ev)) if ev[j][0] == "alloc"), len(ev))


def _oom_cases() -> list[tuple[str, int, int, list[int]]]:
    """(reduction, batch, outputs, staging seen) for every mean and bias-gradient sum."""
    ev, cases, batch, backward = _events(OOM), [], 0, False
    for i, (action, _, size, frame) in enumerate(ev):
        if action != "alloc":
            continue
        j = _next_alloc(ev, i)
        if frame == "main" and j < len(ev) and ev[j][3] == "main" \
                and size == ev[j][2] // OUT_FEATURES * IN_FEATURES:  # inputs, then targets
            batch, backward = size // (4 * IN_FEATURES), False
        elif frame == "mse_loss" and not (cases and cases[-1][:2] == ("mean", batch)):
            while ev[j][3] == "mse_loss" and not _pair(ev, j):  # past the loss's tensors
                j = _next_alloc(ev, j)
            cases.append(("mean", batch, 1, _pair(ev, j) if ev[j][3] == "mse_loss" else []))
        elif frame == "_make_grads":  # backward starts: its requests have no Python frames
            backward = True
        elif backward and frame == "" and size in (4 * HIDDEN, 4 * OUT_FEATURES):
            cases.append(("bias", batch, size // 4, _pair(ev, i + 1)))
    return cases


def _predict(reduction: str, batch: int, outputs: int, sm_count: int, threads: int) -> list[int]:
    if reduction == "mean":  # mse_loss's mean over the [batch, 10] squared errors
        shape, reduced = [batch, OUT_FEATURES], []
    else:  # autograd's sum_to of the [batch, outputs] gradient to the bias
        shape, reduced = [batch, outputs], [0]
    return reduction_staging(shape, [shape[1], 1], reduced, sm_count=sm_count,
                             threads_per_sm=threads, **FP32).sizes()


def test_oom_trace_shows_every_reduction() -> None:
    cases = _oom_cases()
    batches = sorted({batch for _, batch, _, _ in cases})
    assert batches == [256 * 2**k for k in range(len(batches))] and len(batches) == 10
    for batch in batches:
        kinds = [(kind, n) for kind, b, n, _ in cases if b == batch]
        # backward runs from the head: its bias first; the last step ran out of memory there
        full = [("mean", 1), ("bias", OUT_FEATURES)] + [("bias", HIDDEN)] * LAYERS
        assert kinds == (full if batch != batches[-1] else full[:2])
    # every short-lived pair of the trace outside the optimizer (whose foreach kernels
    # make some) is one of these reductions' staging
    ev = _events(OOM)
    pairs = [i for i in range(len(ev)) if _pair(ev, i) and ev[i][3] != "_multi_tensor_adam"]
    assert len(pairs) == sum(1 for c in cases if c[3])


def test_every_oom_staging_buffer_is_reproduced() -> None:
    threads = max_threads_per_sm(H200_CAPABILITY)
    assert threads == 2048
    cases = _oom_cases()
    predicted = [_predict(kind, batch, n, H200_SMS, threads) for kind, batch, n, _ in cases]
    assert predicted == [seen for *_, seen in cases]
    # none at small batches, then limited by the rows, then by the SMs: 132 CTAs per output
    assert [] in predicted and [4 * HIDDEN * 132 * 128, 64] in predicted


def test_sm_count_sets_the_blocks_when_the_sms_are_few() -> None:
    # 65,536 rows x 2,048 outputs: 16 output blocks, split over div_up(sms x 16, 16) CTAs
    sizes = _predict("bias", 65536, HIDDEN, 108, 2048)
    assert sizes == [4 * HIDDEN * 108 * 128, 64]
    assert _predict("bias", 65536, HIDDEN, 128, 1536) == [4 * HIDDEN * 96 * 128, 64]


def test_layout_and_dims() -> None:
    kw = {"sm_count": 132, "threads_per_sm": 2048, **FP32}
    # reducing the leading dim of a transposed tensor is reducing its fastest dim
    direct = reduction_staging([2048, 65536], [65536, 1], [1], **kw).sizes()
    assert reduction_staging([65536, 2048], [1, 65536], [0], **kw).sizes() == direct
    # adjacent reduced dims coalesce: [10, 150, 512] summed over (0, 1) is 1,500 rows
    assert reduction_staging([10, 150, 512], [76800, 512, 1], [0, -2], **kw).sizes() == \
        reduction_staging([1500, 512], [512, 1], [0], **kw).sizes() == [6291456, 16]
    # nothing to reduce, or nothing at all
    assert reduction_staging([], [], [], **kw).sizes() == []
    assert reduction_staging([0, 512], [512, 1], [0], **kw).sizes() == []
    # past 2 GiB the iterator splits until 32-bit indexing works; each half stages alone
    big = reduction_staging([2**20, 1024], [1024, 1], [0], **kw)
    assert len(big.launches) == 2 and big.acc_buffer == 0
    half = reduction_staging([2**21, 1024], [1024, 1], [0], itemsize=2, out_itemsize=2,
                             acc_itemsize=4, sm_count=132, threads_per_sm=2048,
                             can_accumulate_in_output=False)
    assert half.acc_buffer == 1024 * 4 and half.sizes()[0] == 1024 * 4


# other cards (torch 2.6 and 2.11): norm-weight gradients, rows x d_model summed over rows
GROUNDTRUTH = [  # file name part, rows (batch x context), d_model, norms x steps recorded
    ("forward_and_backward_memory_snapshot_100.", 10 * 100, 512, 27),
    ("forward_and_backward_memory_snapshot_150.", 10 * 150, 512, 27),
    ("forward_and_backward_memory_snapshot_200.", 10 * 200, 512, 27),
    ("medium_128_training", 4 * 128, 1024, 49),
    ("medium_256_training", 4 * 256, 1024, 49),
    ("medium_512_training", 4 * 512, 1024, 49),
    ("medium_1024_training", 4 * 1024, 1024, 49),
    ("xl_ctx512_full_step_none", 4 * 512, 2560, 65),
]


@pytest.mark.parametrize(("name", "rows", "d_model", "count"), GROUNDTRUTH,
                         ids=[g[0].strip(".") for g in GROUNDTRUTH])
def test_other_cards_norm_weight_gradients(name: str, rows: int, d_model: int,
                                           count: int) -> None:
    paths = sorted(GROUNDTRUTH_SNAPSHOTS.glob(f"*{name}*")) \
        if GROUNDTRUTH_SNAPSHOTS.is_dir() else []
    if not paths:
        pytest.skip("shared ground-truth snapshots absent")
    ev = _events(paths[0])
    seen = [_pair(ev, i + 1) for i, e in enumerate(ev)
            if e[0] == "alloc" and e[2] == 4 * d_model and _pair(ev, i + 1)]
    # the cards are unknown: an A100, an RTX 4090 or an H100 NVL gives the same sizes (so
    # does any card with SMs x blocks per SM >= 505; not a T4's 40 x 8)
    for sms, capability in ((108, (8, 0)), (128, (8, 9)), (132, (9, 0))):
        sizes = reduction_staging([rows, d_model], [d_model, 1], [0], sm_count=sms,
                                  threads_per_sm=max_threads_per_sm(capability),
                                  **FP32).sizes()
        assert seen == ([sizes] * count if sizes else [])


def test_aten_reductions_reach_the_port_with_their_dims():
    from memprof.collect.virtual.cards import parse_spec
    from memprof.collect.virtual.kernel_memory import scratch

    h200, aten = parse_spec("H200"), torch.ops.aten
    grad = torch.empty(65536, 2048, device="meta")  # a bias gradient's input, as in oom.py
    bias = scratch(aten.sum.dim_IntList, (grad, [0], True), {}, h200)
    staged = reduction_staging([65536, 2048], [2048, 1], [0], sm_count=H200_SMS,
                               threads_per_sm=max_threads_per_sm(H200_CAPABILITY), **FP32)
    assert staged.acc_buffer == 0 and bias is not None
    assert bias.steps == tuple(staged.launches)
    # every dim: the default overloads, and var.default's second argument is not a dim
    whole = reduction_staging([65536, 2048], [2048, 1], [], sm_count=H200_SMS,
                              threads_per_sm=max_threads_per_sm(H200_CAPABILITY), **FP32)
    assert scratch(aten.sum.default, (grad,), {}, h200).steps == tuple(whole.launches)
    welford = scratch(aten.var.default, (grad, True), {}, h200)
    assert welford is not None
    assert sum(type(step) is tuple for step in welford.steps) == len(whole.launches)
    assert scratch(aten.relu.default, (grad,), {}, h200) is None  # not a reduction


def test_attention_backwards_request_their_scratch():
    from memprof.collect.virtual.cards import parse_spec
    from memprof.collect.virtual.kernel_memory import scratch

    h200, aten = parse_spec("H200"), torch.ops.aten
    # GPT-2 small's attention at batch 8: (B, H, S, D) = (8, 12, 1000, 80)
    q = torch.empty(8, 12, 1000, 80, device="meta", dtype=torch.bfloat16)
    flash = scratch(aten._scaled_dot_product_flash_attention_backward.default,
                    (q, q, q, q, q), {}, h200)
    # softmax_d over 1024 rows (1000 rounded to 128); dQ's accumulator with D rounded to 96
    assert flash.steps == (8 * 12 * 1024 * 4, (8 * 1024 * 12 * 96 * 4,))
    efficient = scratch(aten._scaled_dot_product_efficient_attention_backward.default,
                        (q, q, q, q, None, q), {}, h200)
    # 16-bit: delta; dQ's accumulator in 64 x 128 tiles (D = 80), 64 x 128 + 2 floats each,
    # as the H200 allocated it; a gradient laid out (B, H, S, D) is first copied to (B, S, H, D)
    assert efficient.steps == (8 * 12 * 1000 * 4, (8 * 12 * 16 * (64 * 128 + 2) * 4,))
    assert efficient.early == (8 * 12 * 1000 * 80 * 2,)
