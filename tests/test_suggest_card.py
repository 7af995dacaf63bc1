"""Remedies that depend on the card and on what the allocator's cache is made of: fp16 with
loss scaling where the card has no bf16 tensor cores, and a cache that moves with the
activations, not with model state a remedy removes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from memprof.advise.advice import _capability
from memprof.advise.forward_remedies import LSE_BYTES, forward_remedies
from memprof.advise.peak import Peak
from memprof.advise.precision import precision_remedies
from memprof.advise.remedy import Context
from memprof.advise.source import Run
from memprof.trace.model import (
    ACTIVATIONS,
    ATTENTION_SCORES,
    CATEGORIES,
    OPTIMIZER_STATE,
    PARAMETERS,
    TEMPORARIES,
)

MiB = 1 << 20


def peak(cache_ratio: float = 0.0, **held: int) -> Peak:
    at = {**dict.fromkeys(CATEGORIES, 0), **held}
    allocated = sum(at.values())
    return Peak(at, dict(at), cache_ratio, allocated_base=allocated,
                transient_base=at[ACTIVATIONS] + at[TEMPORARIES])


def test_a_card_without_bf16_tensor_cores_is_offered_fp16_with_loss_scaling() -> None:
    busy = peak(**{PARAMETERS: 100 * MiB, ACTIVATIONS: 400 * MiB})
    model = {"dtypes": {"float32": 1000}}
    on_t4 = {r.key: r for r in precision_remedies(busy, Context(model, bf16_cores=False))}
    assert on_t4["autocast"].title == "fp16 autocast with loss scaling (mixed precision)"
    assert "GradScaler" in on_t4["autocast"].snippet
    assert on_t4["autocast"].verify == {"autocast": "float16"}
    on_a100 = {r.key: r for r in precision_remedies(busy, Context(model))}
    assert on_a100["autocast"].verify == {"autocast": "bfloat16"}
    # the same saving either way: both halves are 2 bytes
    assert on_t4["autocast"].change(busy) == on_a100["autocast"].change(busy)


def test_bf16_autocast_on_such_a_card_is_offered_fp16_s_fused_attention() -> None:
    b, h, t = 8, 4, 1024
    scores = b * h * t * t * 4  # SDPA's math path keeps them whole, in fp32 here
    start = replace_tags(peak(**{PARAMETERS: 10 * MiB, ACTIVATIONS: scores + 50 * MiB}),
                         scores)
    model = {"dtypes": {"float32": 1}, "autocast": "bfloat16",
             "attention": {"fused": True, "score_shape": [b, h, t, t], "score_dtype": "float32",
                           "module": "MultiheadAttention"}}
    remedies = {r.key: r for r in forward_remedies(start, Context(model, bf16_cores=False))}
    fp16 = remedies["fp16_autocast"]
    assert fp16.verify == {"autocast": "float16"}
    lse = b * h * t * LSE_BYTES
    assert start.at_peak[ACTIVATIONS] - fp16.change(start).at_peak[ACTIVATIONS] == scores - lse
    assert "fp16_autocast" not in {r.key for r in forward_remedies(start, Context(model))}


def replace_tags(p: Peak, scores: int) -> Peak:
    return replace(p, tags_at_peak={ATTENTION_SCORES: scores},
                   tags_at_step={ATTENTION_SCORES: scores})


def run_of(facts: dict[str, Any]) -> Run:
    return Run(Path("report.json"), {"run": facts}, {}, None, False)


def test_the_card_s_capability_comes_from_the_run() -> None:
    virtual = {"virtual_gpu": {"spec": "T4", "capability": [7, 5]}}
    assert _capability(run_of(virtual)) == (7, 5)
    assert _capability(run_of({"cuda": {"name": "Tesla T4"}})) == (7, 5)
    assert _capability(run_of({"cuda": {"name": "a card nobody knows"}})) == (8, 0)
    assert _capability(run_of({})) == (8, 0)


def test_removing_model_state_saves_its_bytes_and_the_cache_follows_activations() -> None:
    state, acts = 40 * MiB, 20 * MiB
    start = peak(0.5, **{PARAMETERS: 20 * MiB, OPTIMIZER_STATE: state, ACTIVATIONS: acts})
    assert start.reserved == int(80 * MiB * 1.5)
    offloaded = start.scaled({OPTIMIZER_STATE: 0.0})
    assert start.reserved - offloaded.reserved == state  # no more than it held
    # half the activations: the cache goes down with the whole (the larger share)
    halved = start.scaled({ACTIVATIONS: 0.5})
    assert halved.reserved == int(70 * MiB + 40 * MiB * 70 / 80)


def test_a_step_that_peaks_with_foreach_temporaries_is_offered_foreach_false() -> None:
    from memprof.advise.optimizer_step import step_remedies

    numels = [1000, 3000, 4000]  # the largest: half the parameters
    step = peak(**{PARAMETERS: 32_000, OPTIMIZER_STATE: 64_000, TEMPORARIES: 64_000})
    model = {"trainable_numels": numels, "optimizers": [{"class": "Adadelta", "foreach": None}]}
    (remedy,) = step_remedies(step, Context(model))
    assert remedy.verify == {"foreach": False}
    assert remedy.change(step).at_step[TEMPORARIES] == 64_000 * 4000 // 8000
    for opt in ({"class": "Adadelta", "foreach": False}, {"class": "Adam", "fused": True},
                {"class": "AdamW8bit"}):
        assert step_remedies(step, Context({**model, "optimizers": [opt]})) == []


def test_verify_applies_foreach_false_and_attention_without_weights() -> None:
    import torch

    from memprof.collect.launch.apply import applied

    weight = torch.nn.Parameter(torch.zeros(4))
    with applied({"foreach": False}):
        looped = torch.optim.Adam([weight])
        fused = torch.optim.Adam([weight], fused=True)
    assert looped.param_groups[0]["foreach"] is False
    assert fused.param_groups[0]["foreach"] is None  # fused: left as made
    assert torch.optim.Adam([weight]).param_groups[0]["foreach"] is None  # only while applied
    attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.ones(1, 3, 8)
    with applied({"attention_weights": False}):
        assert attention(x, x, x)[1] is None
        assert attention(x, x, x, None, True)[1] is None  # need_weights by position too
    assert attention(x, x, x)[1] is not None


def test_the_optimizer_advised_is_the_one_holding_the_state() -> None:
    """torchtitan's OptimizersContainer (no state of its own) is seen beside its AdamW."""
    optimizers = [{"class": "OptimizersContainer", "state_bytes": 0},
                  {"class": "AdamW", "state_bytes": 4096}]
    assert Context({"optimizers": optimizers}).optimizer["class"] == "AdamW"


def test_a_sharded_parameter_s_state_sizes_are_its_shard_s() -> None:
    import torch

    from memprof.collect.hooks.model_facts import model_facts

    layer = torch.nn.Linear(8, 8, bias=False)
    layer.weight._local_tensor = torch.zeros(4, 8)  # this rank's half, as a DTensor holds it
    facts = model_facts([layer], [], None, {})
    assert (facts["parameters"], facts["trainable_numels"]) == (64, [32])
