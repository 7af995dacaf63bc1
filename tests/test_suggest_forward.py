"""``memprof suggest``'s remedies from facts about the forward pass (fused attention, a
chunked cross-entropy, ``no_grad`` for evaluation, ``zero_grad(set_to_none=True)``), on runs
of ``tests/scripts/attention_train.py`` and the transformer sample on the virtual H100:
exact bytes at the peak, and absent where the script already does the right thing."""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest
import torch
from test_run_cli import SAMPLES, block, memprof_run
from test_suggest import advice_json

from memprof.advise.advice import advise
from memprof.advise.budget import parse_budget
from memprof.advise.checkpointing import checkpoint_remedies
from memprof.advise.forward_remedies import forward_remedies
from memprof.advise.peak import Peak
from memprof.advise.remedies import Context
from memprof.advise.source import load_run
from memprof.trace.model import (
    ACTIVATIONS,
    ATTENTION_SCORES,
    CATEGORIES,
    EVAL_ACTIVATIONS,
    GRADIENTS,
    LOSS_LOGITS,
    PARAMETERS,
)

SCRIPT = Path(__file__).parent / "scripts" / "attention_train.py"
KEYS = {"fused_attention", "no_grad_eval", "zero_grad_set_to_none"}


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("attention_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Careless habits ("bad") and careful ones ("good")."""
    where = tmp_path_factory.mktemp("forward")
    with ThreadPoolExecutor(max_workers=2) as pool:  # the two runs at once
        for result in pool.map(lambda run: memprof_run(where, "-o", run[0], SCRIPT, *run[1]),
                               (("bad", ("--set-to-none=0", "--eval=grad")),
                                ("good", ("--fused",)))):
            assert result.code == 0, result.stderr
    return where


def saved_bytes_of_one_eval_forward(s: ModuleType) -> int:
    """Blocks of the non-parameter storages one eval forward (batch 1) saves, on the CPU."""
    model = s.build(fused=False).eval()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(torch.randn(1, s.T, s.H * s.D))
    assert out.grad_fn is not None
    return sum(block(n) for n in saved.values())


def test_each_remedy_saves_exactly_what_is_alive_at_the_peak(runs: Path):
    s = script()
    run = load_run(runs / "bad")
    advice = advise(run, parse_budget("1MiB"))
    start = advice.start
    by_key = {r.remedy.key: r for r in advice.ranked}
    assert set(by_key) >= KEYS
    # the peak is the last step's training pass: its softmax output (B x H x T x T fp32)
    scores = s.B * s.H * s.T * s.T * 4
    assert start.tagged(ATTENTION_SCORES) == scores
    fused = by_key["fused_attention"].peak
    lse = s.B * s.H * s.T * 4  # SDPA's fp32 logsumexp per row
    assert start.at_peak[ACTIVATIONS] - fused.at_peak[ACTIVATIONS] == scores - lse
    # the evaluations of the first two steps are alive (their losses kept), not the third
    evals = 2 * saved_bytes_of_one_eval_forward(s)
    assert start.tagged(EVAL_ACTIVATIONS) == evals
    no_grad = by_key["no_grad_eval"].peak
    assert start.at_peak[ACTIVATIONS] - no_grad.at_peak[ACTIVATIONS] == evals
    # zeroed gradients of every parameter are held through the forward pass
    grads = sum(block(4 * n) for n in run.model["trainable_numels"])
    assert start.at_peak[GRADIENTS] == grads
    assert by_key["zero_grad_set_to_none"].peak.at_peak[GRADIENTS] == 0
    assert by_key["zero_grad_set_to_none"].peak.at_step == start.at_step


def test_the_facts_name_the_users_objects_and_the_snippets_compile(runs: Path):
    run = load_run(runs / "bad")
    assert run.model["zero_grad_set_to_none"] is False
    assert run.model["eval_module"] == "Sequential"
    assert run.model["attention"] == {"fused": False, "score_shape": [4, 2, 512, 512],
                                      "score_dtype": "float32", "module": "Attention"}
    advice = advise(run, parse_budget("1MiB"))
    remedies = forward_remedies(advice.start, advice.context)
    assert {r.key for r in remedies} == KEYS
    for remedy in remedies:
        compile(remedy.snippet, remedy.key, "exec")
        assert remedy.seed.startswith("seed 00") and remedy.assumptions
        assert not remedy.verify  # estimate only: memprof cannot apply them to the script
    fused = next(r for r in remedies if r.key == "fused_attention")
    assert "Attention" in fused.title and "Attention.forward" in fused.snippet
    assert "4x2x512x512 float32" in fused.assumptions


def test_none_is_offered_where_the_script_already_does_it(runs: Path):
    run = load_run(runs / "good")
    assert run.model["attention"]["fused"] is True
    assert run.model["zero_grad_set_to_none"] is True and run.model["eval_module"] is None
    tagged = run.device["tagged"]  # nothing the forward remedies shrink
    assert not any(tagged[tag]["at_peak_bytes"]
                   for tag in (ATTENTION_SCORES, EVAL_ACTIVATIONS, LOSS_LOGITS))
    advice = advise(run, parse_budget("1MiB"))
    assert not KEYS & {r.remedy.key for r in advice.ranked}


def test_json_lists_them_as_estimates(runs: Path):
    advice = advice_json(runs, "bad", "--budget", "1MB")
    by_key = {r["key"]: r for r in advice["remedies"]}
    assert set(by_key) >= KEYS
    assert all(by_key[k]["saved_bytes"] > 0 for k in KEYS)


def eval_tags(backward: bool) -> list[list[object]]:
    """The tags of a recording of one forward in eval mode with grad enabled."""
    from memprof.collect.cpu.recorder import CpuRecorder

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1)).eval()
    with CpuRecorder() as recorder:
        loss = model(torch.randn(32, 64)).sum()
        if backward:
            loss.backward()
    return recorder.snapshot()["memprof"]["tags"]


def test_a_backpropagated_eval_mode_forward_is_not_an_evaluation():
    # the input and the ReLU's output are saved; a frozen module in eval mode that training
    # backpropagates through (a teacher, a frozen encoder) keeps its graph for a reason
    assert [tag for _, tag in eval_tags(backward=False)
            if tag == EVAL_ACTIVATIONS] == [EVAL_ACTIVATIONS] * 2
    assert EVAL_ACTIVATIONS not in {tag for _, tag in eval_tags(backward=True)}


def test_sdpa_on_the_cpus_math_fallback_counts_as_fused_attention():
    # with dropout, the CPU runs scaled_dot_product_attention as softmax(q @ k^T) @ v: the
    # scores are saved, but the script already calls the kernel CUDA runs fused
    from memprof.collect.cpu.recorder import CpuRecorder

    class Attention(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(
                x, x, x, dropout_p=0.1, is_causal=True)

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), Attention())
    optimizer = torch.optim.SGD(model.parameters())
    with CpuRecorder() as recorder:
        model(torch.randn(2, 4, 64, 16)).sum().backward()
        optimizer.step()
    attention = recorder.snapshot()["memprof"]["model"]["attention"]
    assert attention["fused"] is True and attention["score_shape"] == [2, 4, 64, 64]


def test_a_cross_entropy_over_a_vocabulary_is_offered_in_chunks(tmp_path: Path) -> None:
    vocab, rows = 8192, 4 * 64  # batch x seq rows of log-probabilities
    sizes = ("--steps", "2", "--batch", "4", "--seq", "64")
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda run: memprof_run(tmp_path, "-o", *run), (
            ("wide", SAMPLES / "transformer_lm.py", *sizes, "--vocab", str(vocab)),
            ("narrow", SAMPLES / "transformer_lm.py", *sizes, "--vocab", "256"))))
    assert all(r.code == 0 for r in results), [r.stderr for r in results]
    advice = advise(load_run(tmp_path / "wide"), parse_budget("1MiB"))
    start = advice.start
    log_probabilities = rows * vocab * 4  # fp32, saved by log_softmax for backward
    assert start.tagged(LOSS_LOGITS) == log_probabilities
    chunked = {r.remedy.key: r.remedy for r in advice.ranked}["chunked_loss"]
    # one chunk of rows of eight is kept at a time
    assert start.at_peak[ACTIVATIONS] - chunked.change(start).at_peak[ACTIVATIONS] == (
        log_probabilities - log_probabilities // 8)
    compile(chunked.snippet, "<snippet>", "exec")
    # under autocast the log-probabilities stay fp32 (log_softmax's list): at most the
    # rest halves, and the weights' bf16 copies are added
    autocast = {r.remedy.key: r.remedy for r in advice.ranked}["autocast"].change(start)
    others = start.at_peak[ACTIVATIONS] - log_probabilities
    saved = start.at_peak[ACTIVATIONS] + start.at_peak[PARAMETERS] // 2 \
        - autocast.at_peak[ACTIVATIONS]
    assert 0 < saved <= others // 2
    assert autocast.tagged(LOSS_LOGITS) == log_probabilities
    # a classifier's few classes are no vocabulary: nothing to chunk
    narrow = advise(load_run(tmp_path / "narrow"), parse_budget("1MiB"))
    assert "chunked_loss" not in {r.remedy.key for r in narrow.ranked}


def _run_both_ways(where: Path, name: str, source: str, ways: tuple[str, str]) -> None:
    """Write the script ``source`` as ``name`` and run it under memprof once per way (its
    argument, and the run folder's name), both at once."""
    (where / name).write_text(source)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda how: memprof_run(
            where, "-o", how, "--no-timeline", name, how), ways))
    assert all(r.code == 0 for r in results), [r.stderr for r in results]


HALF_LM = """\
import sys, torch, torch.nn.functional as F
from torch import nn
vocab, rows = 4096, 256
model = nn.Sequential(nn.Embedding(vocab, 64), nn.Linear(64, vocab)).cuda().bfloat16()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    tokens = torch.randint(0, vocab, (rows,), device="cuda")
    logits = model(tokens)
    loss = F.cross_entropy(logits.float() if sys.argv[1] == "upcast" else logits, tokens)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
"""


def test_a_half_precision_models_upcast_loss_is_offered_in_its_dtype(tmp_path: Path) -> None:
    """A bf16 model whose logits are upcast for the cross-entropy saves fp32
    log-probabilities: computing it in bf16 halves them. Without the upcast (or with a loss
    in bf16 already) it is not offered."""
    _run_both_ways(tmp_path, "half_lm.py", HALF_LM, ("upcast", "bf16"))
    upcast = advise(load_run(tmp_path / "upcast"), parse_budget("1MiB"))
    log_probabilities = 256 * 4096 * 4  # rows x vocab, fp32: what log_softmax saves
    assert upcast.start.tagged(LOSS_LOGITS) == log_probabilities
    remedies = {r.key: r for r in forward_remedies(upcast.start, upcast.context)}
    in_bf16 = remedies["loss_model_dtype"]
    assert in_bf16.title == "the cross-entropy in bfloat16, the model's dtype"
    assert upcast.start.at_peak[ACTIVATIONS] - in_bf16.change(upcast.start).at_peak[
        ACTIVATIONS] == log_probabilities // 2
    compile(in_bf16.snippet, "<snippet>", "exec")
    plain = advise(load_run(tmp_path / "bf16"), parse_budget("1MiB"))
    assert plain.start.tagged(LOSS_LOGITS) == log_probabilities // 2  # bf16 already
    assert "loss_model_dtype" not in {r.key for r in forward_remedies(plain.start,
                                                                      plain.context)}


LAST_TOKEN = """\
import sys
import torch
from torch import nn
import torch.nn.functional as F
V, T, B = 4096, 64, 4
model = nn.Sequential(nn.Embedding(V, 32), nn.Linear(32, V)).cuda()
optimizer = torch.optim.SGD(model.parameters())
for _ in range(2):
    logits = model(torch.randint(0, V, (B, T), device="cuda"))  # (B, T, V): every position
    rows = logits[:, -1] if sys.argv[1] == "last" else logits.flatten(0, 1)
    F.cross_entropy(rows, torch.zeros(rows.shape[0], dtype=torch.long, device="cuda")).backward()
    optimizer.step()
    del logits, rows
"""


def test_a_loss_that_reads_the_last_positions_logits_is_offered_only_those(
        tmp_path: Path) -> None:
    """A generation-style loss over the last position of 4 x 64 positions of 4,096-class
    logits reads 4 of the 256 rows the model computes: the 252 others (and their zero
    gradient in backward, as large) need not be made. A loss over every row is not
    offered it."""
    _run_both_ways(tmp_path, "last_token.py", LAST_TOKEN, ("last", "all"))
    last = advise(load_run(tmp_path / "last"), parse_budget("1MiB"))
    assert last.run.model["loss"] == {"shape": [4, 4096], "dtype": "float32",
                                      "logits_rows": 4 * 64}
    keep = {r.key: r for r in forward_remedies(last.start, last.context)}["logits_to_keep"]
    assert keep.title == "logits for the 4 rows the loss reads, not all 256"
    unread = (256 - 4) * 4096 * 4
    assert f"({unread:,} bytes)" in keep.assumptions
    start, after = last.start, keep.change(last.start)
    moment = "at_step" if start.moment is start.at_step else "at_peak"
    assert getattr(start, moment)["temporaries"] - getattr(after, moment)["temporaries"] \
        == min(getattr(start, moment)["temporaries"], 2 * unread)
    compile(keep.snippet, "<snippet>", "exec")
    every = advise(load_run(tmp_path / "all"), parse_budget("1MiB"))
    assert every.run.model["loss"]["logits_rows"] == 256
    assert "logits_to_keep" not in {r.key for r in forward_remedies(every.start,
                                                                    every.context)}


TRAINED_IN_EVAL = """\
import torch
from torch import nn
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()
model.eval()  # as from_pretrained returns a model
optimizer = torch.optim.AdamW(model.parameters())
for _ in range(2):
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_a_model_trained_in_eval_mode_is_told_to_train_before_it_checkpoints(
        tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAINED_IN_EVAL)
    result = memprof_run(tmp_path, "-o", "run", "train.py")
    assert result.code == 0, result.stderr
    run = load_run(tmp_path / "run")
    assert run.model["trained_in_eval"] == "Sequential"
    assert run.model["eval_module"] == "Sequential"  # its forwards' tensors were read back
    hf = {**run.model, "repeated_blocks": [{
        "class": "LlamaDecoderLayer", "module": "transformers.models.llama.modeling_llama",
        "count": 4, "parameters_each": 1 << 20}]}
    # a peak the activations fill, for the checkpointing remedy to apply
    moment = {**dict.fromkeys(CATEGORIES, 0), ACTIVATIONS: 100 << 20}
    start = Peak(moment, dict.fromkeys(CATEGORIES, 0), 0.0)
    remedies = {r.key: r for r in checkpoint_remedies(start, Context(hf))}
    snippet = remedies["checkpoint_blocks"].snippet
    assert snippet.startswith("model.train()  # the Sequential trained in eval mode")
    compile(snippet, "<snippet>", "exec")
    trained = {**hf, "trained_in_eval": None}
    assert "model.train()" not in {r.key: r for r in checkpoint_remedies(
        start, Context(trained))}["checkpoint_blocks"].snippet
