"""The virtual GPU on the idioms third-party training code uses, in this process.

Each case names the idiom (timm's ``to(device=...)``, ``nn.MultiheadAttention``, FSDP2's
``untyped_storage().resize_``, ``torch.cuda.stream(stream=s)``) and the bytes a card
would hold, from the tensor sizes and the caching allocator's 512-byte rounding.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_run_cli import block
from torch import nn

from memprof.collect.cpu.storages import StorageTracker
from memprof.collect.virtual.cards import parse_spec
from memprof.collect.virtual.cuda_api import HistoryWindow, Stream, cuda_api
from memprof.collect.virtual.gpu import VirtualGpu
from memprof.collect.virtual.recorder import VirtualRecorder
from memprof.trace.events import ACTION, SIZE
from memprof.trace.model import WORKSPACE, AllocatorSettings

MiB = 1 << 20



def _linear() -> nn.Linear:
    return nn.Linear(64, 32)


LINEAR_BYTES = block(64 * 32 * 4) + block(32 * 4)
HOST = torch.ones(100)  # 400 bytes: one 512-byte block once on the card
# every way scripts put a module's parameters, or a tensor, on the card
MODULE_FORMS: dict[str, Callable[[nn.Module], nn.Module]] = {
    'to("cuda")': lambda m: m.to("cuda"),
    'to(device="cuda")': lambda m: m.to(device="cuda"),  # timm's train.py
    'to(torch.device("cuda"))': lambda m: m.to(torch.device("cuda")),
    'to(device=torch.device("cuda", 0))': lambda m: m.to(device=torch.device("cuda", 0)),
    "to(0)": lambda m: m.to(0),
    "to(device=0)": lambda m: m.to(device=0),
    'to(device="cuda:0", non_blocking=True)':
        lambda m: m.to(device="cuda:0", non_blocking=True),
    "cuda()": lambda m: m.cuda(),
    "cuda(0)": lambda m: m.cuda(0),
    "cuda(device=0)": lambda m: m.cuda(device=0),
    "to(cuda_tensor)": lambda m: m.to(torch.empty(0, device="cuda")),
}
TENSOR_FORMS: dict[str, Callable[[], torch.Tensor]] = {
    'to("cuda")': lambda: HOST.to("cuda"),
    'to(device="cuda")': lambda: HOST.to(device="cuda"),
    'to(torch.device("cuda"))': lambda: HOST.to(torch.device("cuda")),
    "to(0)": lambda: HOST.to(0),
    "to(device=0)": lambda: HOST.to(device=0),
    'to("cuda", non_blocking=True)': lambda: HOST.to("cuda", non_blocking=True),
    'to(device="cuda", copy=True)': lambda: HOST.to(device="cuda", copy=True),
    "cuda()": lambda: HOST.cuda(),
    'cuda(device="cuda:0")': lambda: HOST.cuda(device="cuda:0"),
    'zeros(device="cuda")': lambda: torch.zeros(100, device="cuda"),
    "zeros(device=0)": lambda: torch.zeros(100, device=0),
    'randn(device=torch.device("cuda"))': lambda: torch.randn(100, device=torch.device("cuda")),
    'tensor(list, device="cuda:0")': lambda: torch.tensor([0.0] * 100, device="cuda:0"),
    'empty_like(host, device="cuda")': lambda: torch.empty_like(HOST, device="cuda"),
    'host.new_zeros(device="cuda")': lambda: HOST.new_zeros(100, device="cuda"),
    'with torch.device("cuda")': lambda: _inside_device_context(),
    'set_default_device("cuda")': lambda: _with_default_device(),
}


def _inside_device_context() -> torch.Tensor:
    with torch.device("cuda"):
        return torch.zeros(100)


def _with_default_device() -> torch.Tensor:
    torch.set_default_device("cuda")
    try:
        return torch.zeros(100)
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("form", MODULE_FORMS)
def test_every_way_to_move_a_module_puts_its_parameters_on_the_card(
        gpu: VirtualGpu, form: str) -> None:
    model = _linear()
    before = torch.cuda.memory_allocated()
    moved = MODULE_FORMS[form](model)
    assert moved is model
    assert {p.device for p in model.parameters()} == {torch.device("cuda", 0)}
    assert torch.cuda.memory_allocated() - before == LINEAR_BYTES


@pytest.mark.parametrize("form", TENSOR_FORMS)
def test_every_way_to_make_a_cuda_tensor_gives_one(gpu: VirtualGpu, form: str) -> None:
    before = torch.cuda.memory_allocated()
    made = TENSOR_FORMS[form]()
    assert made.is_cuda and made.device == torch.device("cuda", 0)
    assert torch.cuda.memory_allocated() - before == block(100 * 4)


def test_a_cuda_tensors_address_is_its_blocks_while_it_holds_one(gpu: VirtualGpu) -> None:
    """``data_ptr()`` as on a card: non-zero and 512-byte aligned while the storage holds
    bytes (FSDP checks a storage is allocated by it; libraries tell storages apart by it),
    a view's its storage's plus its offset, and 0 once the storage is freed by a resize."""
    a, b = torch.empty(100, device="cuda"), torch.empty(100, device="cuda")
    assert a.data_ptr() and b.data_ptr() and a.data_ptr() != b.data_ptr()
    assert a.untyped_storage().data_ptr() % 512 == 0
    assert a[10:].data_ptr() == a.data_ptr() + 10 * a.element_size()
    a.untyped_storage().resize_(0)
    assert a.untyped_storage().data_ptr() == 0 and torch.empty(3).data_ptr()  # host: its own


def test_module_to_keeps_the_dtype_it_is_given(gpu: VirtualGpu) -> None:
    for move in (lambda m: m.to("cuda", torch.float16),
                 lambda m: m.to(dtype=torch.float16, device="cuda:0")):
        model = move(_linear())
        assert (model.weight.device.type, model.weight.dtype) == ("cuda", torch.float16)


def test_a_parameter_a_library_references_weakly_moves_to_the_card(gpu: VirtualGpu) -> None:
    # DeepSpeed names each parameter through weakref.finalize before moving the model
    model = _linear()
    weight = model.weight
    gone: list[str] = []
    finalizer = weakref.finalize(weight, gone.append, "collected")
    before = torch.cuda.memory_allocated()
    model.to("cuda")
    assert model.weight is weight and weight.is_cuda  # the same object, now on the card
    assert finalizer.alive and not gone and weakref.getweakrefs(weight)
    assert torch.cuda.memory_allocated() - before == block(weight.nbytes) + block(
        model.bias.nbytes)


def _large_blocks(recorder: VirtualRecorder, at_least: int) -> list[int]:
    """The blocks of ``at_least`` bytes the script's tensors got (not cuBLAS workspaces)."""
    return [e[SIZE] for e in recorder.events if e[ACTION] == "alloc" and e[SIZE] >= at_least
            and recorder.known.get(id(e)) != WORKSPACE]


@pytest.mark.parametrize("kind", ["MultiheadAttention", "TransformerEncoderLayer"])
def test_attention_inside_torch_modules_takes_the_cards_fused_kernel(
        gpu: VirtualGpu, kind: str) -> None:
    """``F.multi_head_attention_forward`` calls SDPA from inside a torch function: on an
    H100 that is cuDNN's fused kernel, and no [B, H, T, T] score matrix is ever made."""
    batch, heads, seq, width = 8, 8, 512, 256
    if kind == "MultiheadAttention":
        layer: nn.Module = nn.MultiheadAttention(width, heads, batch_first=True).cuda()
    else:
        layer = nn.TransformerEncoderLayer(width, heads, 1000, batch_first=True).cuda()
    x = torch.randn(batch, seq, width, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x, x, x, need_weights=False)[0] if kind == "MultiheadAttention" else layer(x)
    out.float().sum().backward()
    scores = batch * heads * seq * seq * torch.bfloat16.itemsize
    assert _large_blocks(gpu.recorder, scores) == []
    assert gpu.recorder.fused_attention


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_run_eagerly_materialises_its_scores_as_on_a_card(
        gpu: VirtualGpu) -> None:
    """flex_attention outside torch.compile is a higher-order operator PyTorch runs by its
    eager (math) kernels, on a card too: its [B, H, T, T] fp32 scores are made, and its
    gradients reach the inputs."""
    from torch.nn.attention.flex_attention import flex_attention

    batch, heads, seq, width = 2, 4, 256, 64
    q = torch.randn(batch, heads, seq, width, device="cuda", requires_grad=True)
    out = flex_attention(q, q, q)
    assert out.is_cuda and out.shape == q.shape
    out.sum().backward()
    assert q.grad is not None and q.grad.is_cuda and q.grad.shape == q.shape
    scores = batch * heads * seq * seq * 4
    assert len(_large_blocks(gpu.recorder, scores)) > 0


RESIZED = 32 * MiB  # an FSDP2-style unsharded parameter: freed and gathered again


def _free_and_regather(device: str) -> list[int]:
    """``resize_(0)`` then ``resize_(n)`` as FSDP2 does, with another tensor between: the
    bytes allocated after each step."""
    held = []
    x = torch.empty(RESIZED // 4, device=device)
    storage = x.untyped_storage()
    held.append(sum_live())
    storage.resize_(0)
    held.append(sum_live())
    other = torch.empty(RESIZED // 4, device=device)
    held.append(sum_live())
    del other
    storage.resize_(RESIZED)
    held.append(sum_live())
    assert x.untyped_storage().nbytes() == RESIZED
    return held


sum_live: Callable[[], int]


def test_a_storage_shrunk_to_nothing_is_freed_on_the_virtual_gpu(gpu: VirtualGpu) -> None:
    global sum_live
    sum_live = torch.cuda.memory_allocated
    assert _free_and_regather("cuda") == [RESIZED, 0, RESIZED, RESIZED]
    assert torch.cuda.max_memory_allocated() == RESIZED


def test_a_storage_shrunk_to_nothing_is_freed_on_the_cpu_recorder() -> None:
    global sum_live
    tracker = StorageTracker()
    sum_live = lambda: tracker.live_bytes  # noqa: E731
    with tracker:
        assert _free_and_regather("cpu") == [RESIZED, 0, RESIZED, RESIZED]
    assert tracker.max_live_bytes == RESIZED


# a value for each parameter of torch.cuda's functions that has no default
_ARGUMENTS: dict[str, Any] = {
    "seed": 0, "stream": None, "fraction": 0.5, "msg": "step", "device": 0,
    "new_state": torch.zeros(16, dtype=torch.uint8), "new_states": [],
    "check_available": False, "device_index": 0}


def test_every_torch_cuda_stub_takes_the_arguments_torch_names(tmp_path: Any) -> None:
    """Each replacement accepts, by keyword, every parameter of the function it replaces."""
    card = parse_spec("H100")
    recorder = VirtualRecorder(card, AllocatorSettings())
    stubs = cuda_api(card, recorder, HistoryWindow(recorder, {}))
    refused = []
    for (module, name), stub in stubs.items():
        real = getattr(module, name)
        try:
            parameters = inspect.signature(real).parameters.values()
        except (TypeError, ValueError):
            continue  # a C function
        value = {p.name: p.default if p.default is not p.empty else _ARGUMENTS[p.name]
                 for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if name == "_dump_snapshot":
            value["filename"] = str(tmp_path / "dump.pickle")
        positional = [value[p.name] for p in parameters if p.kind == p.POSITIONAL_ONLY]
        named = {p.name: value[p.name] for p in parameters
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        try:
            stub(*positional, **named)
        except TypeError as error:
            refused.append(f"{module.__name__}.{name}: {error}")
    assert refused == []
    for real, ours in ((torch.cuda.Stream, Stream), (torch.cuda.Event, stubs[
            (torch.cuda, "Event")])):
        names = [p for p in inspect.signature(real.__new__).parameters if p != "cls"]
        assert set(names) <= set(inspect.signature(ours).parameters) | {"kwargs"}


def test_stream_context_by_keyword(gpu: VirtualGpu) -> None:
    side = torch.cuda.Stream()
    with torch.cuda.stream(stream=side):
        assert torch.zeros(4, device="cuda").is_cuda
    with pytest.raises(TypeError):
        torch.cuda.stream(strem=side)


def test_small_tensors_hold_the_values_that_decide_shapes(gpu: VirtualGpu) -> None:
    """A loader drawing its offsets on the card (nanoGPT's ``get_batch``) slices the host
    data with them: each batch is ``ctx`` long, as on the card, not empty."""
    data = torch.arange(10_000)
    ctx, batch = 128, 4
    torch.manual_seed(0)
    expected_host_draw = torch.rand(1)
    torch.manual_seed(0)
    offsets = torch.randint(len(data) - ctx, (batch,), device="cuda")
    rows = [data[i:i + ctx] for i in offsets]
    assert [len(r) for r in rows] == [ctx] * batch
    assert all(0 <= int(i) < len(data) - ctx for i in offsets)
    assert torch.rand(1) == expected_host_draw  # the script's host random stream is its own
    x = torch.stack(rows).to("cuda")
    assert x.is_cuda and x.shape == (batch, ctx)
    mask = torch.tensor([0, 1, 0, 1, 1], device="cuda")
    assert mask.nonzero().shape == (3, 1)  # sized by its values, not at its largest
    assert torch.where(mask > 0)[0].tolist() == [1, 3, 4]
    assert mask.unique().tolist() == [0, 1]  # no meta kernel: computed on the values
    counter = torch.zeros((), device="cuda")
    for _ in range(3):
        counter += 1
    assert counter.item() == 3 and repr(counter) == "tensor(3., device='cuda:0')"
    # an attention mask moved to the card as a card tensor's device says, cast at once
    # (transformers' masking_utils): its values follow, and decide a branch
    hidden = torch.zeros(4, 8, device="cuda")
    for moved in (mask.to(device=hidden.device, dtype=torch.bool),
                  mask.to(device="cuda", dtype=torch.bool), mask.to(hidden.device)):
        assert moved.is_cuda and moved.tolist() == [0, 1, 0, 1, 1] and not bool(moved.all())


def test_legacy_constructors_and_meta_twins_of_a_cuda_tensor(gpu: VirtualGpu) -> None:
    """``loss.new([x])`` (timm's distributed logging) and ``new_tensor`` are on the card with
    their values; ``new(*sizes)`` too; ``zeros_like(t, device="meta")`` and ``t.to("meta")``
    (DeepSpeed's partition shapes) are meta tensors, no card memory."""
    loss = torch.zeros((), device="cuda")
    made = [loss.new([1.5]), loss.new_tensor([2.0]), loss.new(64, 64)]
    assert all(t.is_cuda for t in made)
    assert made[0].item() == 1.5 and (made[1] / 2).item() == 1.0 and made[2].shape == (64, 64)
    before = torch.cuda.memory_allocated()
    weight = torch.empty(1024, 1024, device="cuda")
    shapes = [torch.zeros_like(weight, device="meta"), torch.empty_like(weight, device="meta"),
              weight.to("meta")]
    assert all(t.device.type == "meta" and t.shape == weight.shape for t in shapes)
    assert torch.cuda.memory_allocated() - before == 1024 * 1024 * 4  # the weight alone


def test_a_host_copy_of_a_cuda_tensor_takes_a_real_host_gradient(gpu: VirtualGpu) -> None:
    """DeepSpeed's ZeRO-Offload keeps fp32 partitions on the host and gives them host
    gradients (``partition.grad = buffer.to(...)``): no error, nothing on the card."""
    partition = torch.zeros(1 << 20, device="cuda").to("cpu")
    held = torch.cuda.memory_allocated()
    partition.grad = torch.zeros(1 << 20)
    assert partition.grad.shape == (1 << 20,) and partition.grad.device.type == "cpu"
    assert torch.cuda.memory_allocated() == held


def test_a_large_tensors_value_is_a_placeholder_named_by_the_line(
        gpu: VirtualGpu, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    from memprof.collect.virtual import tensor, values

    monkeypatch.setattr(tensor, "_told", False)
    big = torch.ones(values.SMALL + 1, device="cuda")
    line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    assert big.sum().item() == 0.0
    assert big.sum().value is None  # computed from a tensor without values
    said = capsys.readouterr().err
    assert f"{__file__}:{line} reads the values" in said


def _initialise(t: torch.Tensor) -> torch.Tensor:
    """As ``torch.nn.init.normal_`` is written: it dispatches under its module's name for
    itself, which a library has replaced by its wrapper (transformers' guarded init, over
    memprof's own host-state one)."""
    if torch.overrides.has_torch_function_variadic(t):
        return torch.overrides.handle_torch_function(_guarded, (t,), t)
    return t.add_(1)


def _guarded(t: torch.Tensor) -> torch.Tensor:
    """A wrapper that is a torch function of its own, calling the one it wraps."""
    if torch.overrides.has_torch_function_variadic(t):
        return torch.overrides.handle_torch_function(_guarded, (t,), t)
    return _initialise(t)


def test_a_wrapped_torch_function_that_dispatches_under_its_wrapper_ends(gpu: VirtualGpu
                                                                         ) -> None:
    assert _guarded(torch.zeros(3, device="cuda")).tolist() == [1.0, 1.0, 1.0]
