"""What checkpointing each block class would free, measured by ``memprof run``'s hooks
(``collect/hooks/block_saves.py``), against autograd's own saves written out by hand, and
the checkpointing remedy built from it (``advise/checkpointing.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memprof.advise.checkpointing import checkpoint_remedies
from memprof.advise.peak import Peak
from memprof.advise.remedies import Context
from memprof.collect.cpu.recorder import CpuRecorder
from memprof.trace.model import ACTIVATIONS, CATEGORIES

N, B, D = 4, 8, 16  # blocks, batch rows, width


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        # fc1 saves x, relu its output, fc2 that output again; * a float saves nothing
        return x + self.fc2(torch.relu(self.fc1(x))) * scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Mlp() for _ in range(N))
        self.head = nn.Linear(D, 1)  # saves the last block's output: outside every block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale=0.5)
        return self.head(x)


def _recorded(steps: int = 2) -> dict[str, Any]:
    with CpuRecorder() as recorder:
        model = Net()
        optimizer = torch.optim.SGD(model.parameters())
        for _ in range(steps):
            model(torch.randn(B, D)).sum().backward()
            optimizer.step()
    return recorder.snapshot()["memprof"]["model"]


def test_each_blocks_saves_inputs_and_call_are_measured():
    block = next(b for b in _recorded()["repeated_blocks"] if b["class"] == "Mlp")
    row, hidden = B * D * 4, B * 4 * D * 4  # fp32 bytes of a block's input and of relu's
    assert block["saved"] == {
        "inside_bytes": N * (row + hidden),  # each block's input and relu output
        "kept_inputs_bytes": N * row,  # every input is saved inside a block
        "largest_call_bytes": row + hidden,
        "forward_bytes": N * (row + hidden) + row,  # and the head's input
        "calls": N}  # the first forward only
    assert block["call"] == {"args": ["x"], "kwargs": ["scale"]}
    assert block["switch"] is None


def test_the_remedy_frees_what_was_measured_and_calls_the_block_as_the_run_did():
    model = _recorded()
    saved = model["repeated_blocks"][0]["saved"]
    freed = saved["inside_bytes"] - saved["kept_inputs_bytes"] - saved["largest_call_bytes"]
    for held in (saved["forward_bytes"] * 2, saved["forward_bytes"] // 2):
        at_peak = {**dict.fromkeys(CATEGORIES, 0), ACTIVATIONS: held}
        peak = Peak(at_peak, dict.fromkeys(CATEGORIES, 0), 0.0)
        (remedy,) = checkpoint_remedies(peak, Context(model))  # one input: no segments
        changed = remedy.change(peak)
        # all of the forward's saves at the peak, or half of them
        share = min(1.0, held / saved["forward_bytes"])
        assert held - changed.at_peak[ACTIVATIONS] == int(freed * share)
        # late in backward, with every gradient: one block recomputed
        assert changed.at_step[ACTIVATIONS] == saved["largest_call_bytes"]
        assert "x = checkpoint(block, x, scale=scale, use_reentrant=False)" in remedy.snippet
        assert remedy.verify == {"checkpoint": "Mlp"}
        compile(remedy.snippet, remedy.key, "exec")


def test_a_librarys_switch_frees_what_its_checkpointed_classes_free_together():
    model = _recorded()
    mlp = model["repeated_blocks"][0]
    saved = mlp["saved"]
    larger = {**saved, "largest_call_bytes": 2 * saved["largest_call_bytes"]}
    # diffusers' blocks checkpoint the resnets and transformer blocks they call
    facts = {**model, "repeated_blocks": [
        {**mlp, "class": "ResnetBlock2D", "module": "diffusers.models.resnet",
         "switch": "parent"},
        {**mlp, "class": "BasicTransformerBlock", "module": "diffusers.models.attention",
         "switch": "parent", "saved": larger},
        {**mlp, "class": "Attention", "module": "diffusers.models.attention_processor"}]}
    held = 2 * saved["forward_bytes"]
    peak = Peak({**dict.fromkeys(CATEGORIES, 0), ACTIVATIONS: held},
                dict.fromkeys(CATEGORIES, 0), 0.0)
    (remedy,) = checkpoint_remedies(peak, Context(facts))
    # both classes' saves less their inputs; the larger class's call recomputed at once
    freed = 2 * (saved["inside_bytes"] - saved["kept_inputs_bytes"]) \
        - larger["largest_call_bytes"]
    assert held - remedy.change(peak).at_peak[ACTIVATIONS] == freed
    assert remedy.snippet.startswith("model.enable_gradient_checkpointing()")
    assert remedy.verify == {"checkpoint": ["ResnetBlock2D", "BasicTransformerBlock"]}
    assert "Attention" not in remedy.title


def test_verify_checkpoints_every_class_it_is_given():
    from memprof.collect.launch.apply import applied

    with CpuRecorder() as recorder, applied({"checkpoint": ["Mlp", "Missing"]}):
        model = Net()
        optimizer = torch.optim.SGD(model.parameters())
        model(torch.randn(B, D)).sum().backward()
        optimizer.step()
    assert recorder.snapshot()["memprof"]["model"]["checkpointed"] == ["Mlp"]


def _saved_beside(given: torch.Tensor, compute: Callable[[], torch.Tensor]
                  ) -> tuple[torch.Tensor, list[int]]:
    """``compute()``, and the bytes of each storage autograd saved that is not ``given``'s."""
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() != given.untyped_storage().data_ptr():
            saved.append(t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return compute(), saved


def test_verify_chunks_a_vocabularys_cross_entropy_to_the_same_loss_and_gradients():
    """``{"chunked_loss": 8}`` (``suggest --verify``): the same loss and gradients, mean or
    sum, ignored rows included, with one chunk's log-probabilities saved at a time (the
    rest recomputed in backward); a loss over fewer classes runs as written."""
    import torch.nn.functional as F

    from memprof.collect.launch.apply import applied

    torch.manual_seed(0)
    rows, classes = 64, 2048
    target = torch.randint(0, classes, (rows,))
    target[::5] = -100  # ignored rows
    for reduction in ("mean", "sum"):
        logits = torch.randn(rows, classes, requires_grad=True)
        expected = F.cross_entropy(logits, target, reduction=reduction)
        (want,) = torch.autograd.grad(expected, logits)
        with applied({"chunked_loss": 8}):
            loss, saved = _saved_beside(logits, lambda: F.cross_entropy(
                logits, target, reduction=reduction))  # noqa: B023 (called at once)
        (got,) = torch.autograd.grad(loss, logits)
        assert torch.allclose(loss, expected, rtol=1e-5) and torch.allclose(got, want, atol=1e-7)
        # no N x V log-probabilities kept from the forward: the chunks keep views of their
        # input, and recompute one chunk's at a time in backward
        assert max(saved, default=0) < rows * classes * 4 // 8
    small = torch.randn(8, 10, requires_grad=True)
    with applied({"chunked_loss": 8}):
        assert F.cross_entropy(small, torch.zeros(8, dtype=torch.long)).grad_fn.name() \
            == "NllLossBackward0"  # as written


def test_what_autocast_would_keep_in_bf16_is_tagged_from_the_operators():
    """An fp32 run's activations that CUDA autocast would make in bf16, or save a bf16 copy
    of (its lists, ``autocast_ops.py``), are tagged: the layer norm's output the first
    linear casts, that linear's output, and GELU's output made from it alone; not the layer
    norm's input or its statistics, which autocast keeps fp32."""
    from memprof.trace.events import SIZE
    from memprof.trace.model import AUTOCAST_HALF

    rows = 8
    with CpuRecorder() as recorder:
        model = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.GELU(),
                              nn.Linear(4 * D, D))
        optimizer = torch.optim.SGD(model.parameters())
        model(torch.randn(rows, D)).sum().backward()
        optimizer.step()
    snapshot = recorder.snapshot()
    sizes = [event[SIZE] for event in snapshot["device_traces"][0]]
    tagged = [sizes[index] for index, tag in snapshot["memprof"]["tags"]
              if tag == AUTOCAST_HALF]
    # the layer norm's output (rows x D), the linear's output and GELU's (rows x 4D each)
    assert sorted(tagged) == sorted([4 * rows * D, 4 * rows * 4 * D, 4 * rows * 4 * D])
    assert snapshot["memprof"]["model"]["ops_traced"] is True


def _activations_peak(context_fn: Callable[[], Any] | None) -> int:
    """The most bytes labelled activations while a checkpointed stack of 4 Linear(256, 256)
    layers over 512 rows runs forward and backward, ``context_fn`` its checkpoint's."""
    from torch.utils.checkpoint import checkpoint

    from memprof.analysis.explain import explain
    from memprof.collect.recording import predict_cuda_layout
    from memprof.trace.model import AllocatorSettings
    from memprof.trace.normalize import normalize

    layers = [nn.Linear(256, 256) for _ in range(4)]

    def stack(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = torch.relu(layer(x))
        return x

    kwargs = {} if context_fn is None else {"context_fn": context_fn}
    with CpuRecorder() as recorder:
        x = torch.randn(512, 256, requires_grad=True)
        checkpoint(stack, x, use_reentrant=False, **kwargs).sum().backward()
    snapshot, _ = predict_cuda_layout(recorder.snapshot(), AllocatorSettings())
    timeline = explain(normalize(snapshot)).devices[0].category_timeline
    return int(timeline[ACTIVATIONS].max())


def test_what_selective_checkpointing_saves_is_activations():
    """Selective activation checkpointing keeps the outputs its policy saves (here every
    Linear's, 4 x 512 x 256 fp32) in a cache of its own, not through saved-tensor hooks:
    they are activations, which full checkpointing (the input alone) does not hold."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return (CheckpointPolicy.MUST_SAVE if func is torch.ops.aten.addmm.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    outputs = 4 * 512 * 256 * 4
    assert _activations_peak(partial(create_selective_checkpoint_contexts, policy)) >= outputs
    assert _activations_peak(None) < outputs / 2


def test_verifys_autocast_wraps_forwards_but_not_torch_exports_trace():
    """``--verify``'s autocast around each outermost forward is not entered while
    ``torch.export`` traces the model (pipelining's ``pipeline()`` splits it so): the
    graph is the model's own, and the stages' forwards are wrapped when they run."""
    from torch import nn

    from memprof.collect.launch.apply import applied

    model = nn.Linear(8, 8)
    with applied({"autocast": "bfloat16", "autocast_device": "cpu"}):
        exported = torch.export.export(model, (torch.ones(2, 8),))
        ran = model(torch.ones(2, 8))
    ops = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert not any("autocast" in op or "_to_copy" in op for op in ops), ops
    assert ran.dtype == torch.bfloat16
