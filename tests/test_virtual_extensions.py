"""Libraries with CUDA kernels of their own on the virtual GPU (``extensions.py``,
``subclasses.py``).

bitsandbytes imports and runs: its 8-bit optimizers' state and its quantised layers'
weights are virtual tensors of the card's dtypes and shapes, and the bytes below are
written from bitsandbytes' layout (``optim/optimizer.py``, ``functional.py``) and the
caching allocator's 512-byte rounding, never from a run. The bitsandbytes cases skip where
it is not installed; the mechanisms under them (a library's parameter class quantised in
place, the first import seeing the machine, the one line naming a library the script died
in) are checked with classes and packages of the tests' own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_run_cli import block, run_python
from torch import nn

from memprof.collect.cpu.recorder import CpuRecorder
from memprof.collect.launch.script import Outcome
from memprof.collect.virtual.cards import parse_spec
from memprof.collect.virtual.extensions import extension_failure
from memprof.collect.virtual.gpu import VirtualGpu
from memprof.collect.virtual.tensor import HostVirtualTensor, VirtualTensor
from memprof.trace.model import AllocatorSettings

BNB_MISSING = "bitsandbytes is not installed (pip install bitsandbytes)"
MIN_8BIT = 4096  # elements: bitsandbytes keeps fp32 state below (min_8bit_size)
OPTIM_BLOCK = 256  # elements per fp32 absmax of 8-bit optimizer state (blocksize)
PAGED_FROM = 100_000  # elements: paged optimizers page state from this size (1e5)
QMAPS = 2  # 8-bit Adam's signed and unsigned 256-entry fp32 maps, once per optimizer



@pytest.fixture
def bnb(monkeypatch: pytest.MonkeyPatch) -> object:
    """bitsandbytes, its process-wide quantisation maps emptied (a GPU process makes each
    once, on its first use)."""
    module = pytest.importorskip("bitsandbytes", reason=BNB_MISSING)
    monkeypatch.setattr(module.functional, "name2qmap", {})
    return module


def adam_state(numel: int, paged: bool = False) -> int:
    """A 2-state (Adam) parameter's bitsandbytes state on the card: fp32 moments under
    ``MIN_8BIT`` elements, else uint8 moments (in CUDA managed memory, not the card's
    allocator, when paged) and an fp32 absmax per ``OPTIM_BLOCK`` elements for each."""
    if numel < MIN_8BIT:
        return 2 * block(4 * numel)
    absmax = 2 * block(4 * math.ceil(numel / OPTIM_BLOCK))
    return absmax + (0 if paged and numel >= PAGED_FROM else 2 * block(numel))


QMAP_BYTES = QMAPS * block(256 * 4)
# optimizer, parameter shapes, the state it holds on the card after its first step
OPTIMIZERS: dict[str, tuple[str, list[tuple[int, ...]], int]] = {
    "AdamW8bit: a bias keeps fp32 state": ("AdamW8bit", [(10,)], adam_state(10)),
    "AdamW8bit: one element under min_8bit_size": ("AdamW8bit", [(64, 63)], adam_state(4032)),
    "AdamW8bit: at min_8bit_size": ("AdamW8bit", [(64, 64)], adam_state(4096) + QMAP_BYTES),
    "Adam8bit: a layer and its bias": ("Adam8bit", [(1024, 1024), (1024,)],
                                       adam_state(1 << 20) + adam_state(1024) + QMAP_BYTES),
    "PagedAdamW8bit: under the paging size": ("PagedAdamW8bit", [(300, 300)],
                                              adam_state(90_000, paged=True) + QMAP_BYTES),
    "PagedAdamW8bit: paged moments are not the allocator's": (
        "PagedAdamW8bit", [(1000, 100)], adam_state(PAGED_FROM, paged=True) + QMAP_BYTES),
    "AdamW (32-bit)": ("AdamW", [(64, 64)], 2 * block(4 * 4096)),
}


@pytest.mark.parametrize("case", OPTIMIZERS)
def test_optimizer_state(gpu: VirtualGpu, bnb: object, case: str) -> None:
    name, shapes, expected = OPTIMIZERS[case]
    params = [nn.Parameter(torch.zeros(shape, device="cuda")) for shape in shapes]
    for p in params:
        p.grad = torch.zeros_like(p)
    before = torch.cuda.memory_allocated()
    optimizer = getattr(bnb.optim, name)(params, lr=1e-3)  # type: ignore[attr-defined]
    optimizer.step()
    assert torch.cuda.memory_allocated() - before == expected
    optimizer.step()  # the second step allocates nothing
    assert torch.cuda.memory_allocated() - before == expected


def test_8bit_state_dtypes_and_shapes(gpu: VirtualGpu, bnb: object) -> None:
    weight = nn.Parameter(torch.zeros(1000, 300, device="cuda"))
    weight.grad = torch.zeros_like(weight)
    optimizer = bnb.optim.AdamW8bit([weight])  # type: ignore[attr-defined]
    optimizer.step()
    state = optimizer.state[weight]
    for moment in ("state1", "state2"):
        assert type(state[moment]) is VirtualTensor
        assert (state[moment].dtype, state[moment].shape) == (torch.uint8, weight.shape)
    for absmax in ("absmax1", "absmax2"):
        assert (state[absmax].dtype, state[absmax].shape) == (torch.float32, (1172,))
    assert state["qmap1"].shape == state["qmap2"].shape == (256,)


def test_paged_state_is_host_memory(gpu: VirtualGpu, bnb: object) -> None:
    weight = nn.Parameter(torch.zeros(1000, 100, device="cuda"))
    weight.grad = torch.zeros_like(weight)
    optimizer = bnb.optim.PagedAdamW8bit([weight])  # type: ignore[attr-defined]
    optimizer.step()
    moment = optimizer.state[weight]["state1"]
    assert type(moment) is HostVirtualTensor and moment.is_paged
    assert (moment.dtype, moment.shape) == (torch.uint8, weight.shape)


def nested_statistics(numel: int, blocksize: int = 64) -> int:
    """A double-quantised 4-bit weight's statistics: a uint8 absmax per block, an fp32
    absmax per 256 of those, its own copy of the 256-entry map, and the scalar offset."""
    blocks = math.ceil(numel / blocksize)
    return (block(blocks) + block(4 * math.ceil(blocks / 256)) + block(256 * 4)
            + block(4))


IN, OUT = 512, 256
NF4_CODE = block(16 * 4)  # the 16-entry 4-bit code (nf4 or fp4), one per weight
DYNAMIC_MAP = block(256 * 4)  # the process's 8-bit map, made on its first use
# a layer, and what it holds on the card after .cuda()
LAYERS: dict[str, tuple[Callable[[object], nn.Module], int]] = {
    "Linear4bit nf4, fp32 absmax": (
        lambda b: b.nn.Linear4bit(IN, OUT, bias=False, quant_type="nf4",
                                  compress_statistics=False),
        block(IN * OUT // 2) + block(4 * IN * OUT // 64) + NF4_CODE),
    "Linear4bit fp4 with a bias, fp32 absmax": (
        lambda b: b.nn.Linear4bit(IN, OUT, quant_type="fp4", compress_statistics=False),
        block(IN * OUT // 2) + block(4 * IN * OUT // 64) + NF4_CODE + block(4 * OUT)),
    "Linear4bit nf4, double quantisation (the default; QLoRA's)": (
        lambda b: b.nn.Linear4bit(IN, OUT, bias=False, quant_type="nf4"),
        block(IN * OUT // 2) + nested_statistics(IN * OUT) + NF4_CODE + DYNAMIC_MAP),
    "Linear8bitLt": (lambda b: b.nn.Linear8bitLt(IN, OUT, has_fp16_weights=False),
                     block(IN * OUT) + block(4 * OUT) + block(4 * OUT)),  # + fp32 bias
}


@pytest.mark.parametrize("case", LAYERS)
def test_quantised_layer(gpu: VirtualGpu, bnb: object, case: str) -> None:
    make, expected = LAYERS[case]
    layer = make(bnb)
    cls = type(layer.weight)
    layer.cuda()
    assert torch.cuda.memory_allocated() == expected
    weight = layer.weight
    assert isinstance(weight, cls) and isinstance(weight, nn.Parameter) and weight.is_cuda
    dtype = torch.bfloat16 if "4bit" in case else torch.float16
    x = torch.randn(8, IN, device="cuda", dtype=dtype, requires_grad=True)
    y = layer(x)
    assert (y.shape, y.dtype, y.device) == ((8, OUT), dtype, x.device)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_a_4bit_weight_made_of_data_on_the_card_quantises_once(gpu: VirtualGpu,
                                                               bnb: object) -> None:
    """transformers 5 loads a QLoRA model's weights onto the card, then makes each a
    ``Params4bit`` of that data and moves it there again: ``.data`` of the class is a plain
    tensor, as on a card, so its ``.to()`` quantises once (it recursed without end)."""
    weight = torch.randn(OUT, IN, dtype=torch.bfloat16, device="cuda")
    params = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4",  # type: ignore
                               compress_statistics=False)
    assert type(params.data) is VirtualTensor
    held = torch.cuda.memory_allocated()
    quantised = params.to(weight.device)
    assert isinstance(quantised, type(params)) and quantised.quant_state is not None
    assert (quantised.dtype, quantised.numel()) == (torch.uint8, IN * OUT // 2)
    assert torch.cuda.memory_allocated() - held == (
        block(IN * OUT // 2) + block(4 * IN * OUT // 64) + NF4_CODE)


def test_a_4bit_weights_state_is_the_weights_and_it_counts_its_own_weights(
        gpu: VirtualGpu, bnb: object) -> None:
    """QLoRA's double-quantised NF4 weight: its scales, the scales' scales and the codes
    are part of the weight (roles.py marks them parameters), and the model counts IN x OUT
    weights, not the IN x OUT / 2 bytes they are packed in."""
    from memprof.collect.hooks.model_facts import model_facts, quantisation_state

    make, expected = LAYERS["Linear4bit nf4, double quantisation (the default; QLoRA's)"]
    layer = make(bnb).cuda()
    state = quantisation_state(layer.weight)
    assert sum(block(t.numel() * t.element_size()) for t in state) == \
        expected - block(IN * OUT // 2) - DYNAMIC_MAP  # the process's map is no weight's
    assert model_facts([layer], [], None, {})["parameters"] == IN * OUT


def test_outlier_columns_at_their_largest(gpu: VirtualGpu, bnb: object) -> None:
    a = torch.zeros(64, IN, device="cuda", dtype=torch.float16)  # too big to hold values
    _, _, outliers = bnb.functional.int8_vectorwise_quant(a, threshold=6.0)  # type: ignore
    assert outliers.shape == (IN,) and outliers.dtype == torch.int64


class Quantised(nn.Parameter):
    """A library's parameter class as bitsandbytes writes its own: made with
    ``_make_subclass``, quantised on ``.cuda()`` by assigning ``self.data``."""

    def __new__(cls, data: torch.Tensor, scale: torch.Tensor | None = None) -> Quantised:
        made = torch.Tensor._make_subclass(cls, data, False)
        made.scale = scale
        return made

    def cuda(self, device: object = None, non_blocking: bool = False) -> Quantised:
        full = self.data.to("cuda")
        self.scale = full.abs().amax(dim=1)
        self.data = full.to(torch.int8)
        return self


def test_parameter_class_quantised_in_place(gpu: VirtualGpu) -> None:
    layer = nn.Linear(64, 32, bias=False)
    layer.weight = Quantised(layer.weight.data)
    layer.cuda()
    weight = layer.weight
    assert isinstance(weight, Quantised) and isinstance(weight, nn.Parameter)
    assert (weight.device, weight.dtype, weight.shape) == (torch.device("cuda", 0),
                                                          torch.int8, (32, 64))
    assert weight.scale.is_cuda and weight.scale.shape == (32,)
    # the int8 weight and the fp32 scale; the fp32 copy and its abs() are freed
    assert torch.cuda.memory_allocated() == block(32 * 64) + block(32 * 4)
    again = Quantised(weight.t())  # of CUDA data: the class on the same storage
    assert isinstance(again, Quantised) and again.is_cuda
    assert torch.cuda.memory_allocated() == block(32 * 64) + block(32 * 4)


def test_data_assigned(gpu: VirtualGpu) -> None:
    host = torch.zeros(100)
    host.data = torch.ones(100, device="cuda")  # a host tensor given CUDA data
    assert host.is_cuda and type(host) is VirtualTensor
    assert torch.cuda.memory_allocated() == block(400)
    weight = nn.Parameter(torch.zeros(1000, device="cuda"))
    weight.data = weight.data.half()  # a CUDA tensor given another dtype (Linear4bit's bias)
    assert (weight * 2).dtype == torch.float16
    assert torch.cuda.memory_allocated() == block(400) + block(2000)


# how a script ended, and memprof's line about a library with CUDA kernels of its own
FAILURES: dict[str, tuple[Outcome, str | None]] = {
    "died inside flash-attn's import": (
        Outcome("raised", 1, "OSError: libcudart.so.12: cannot open shared object file",
                raised_in=("__main__", "importlib._bootstrap", "flash_attn",
                           "flash_attn.flash_attn_interface")),
        "memprof: the script failed inside flash-attn (flash_attn.flash_attn_interface)"),
    "a Triton kernel launched by liger-kernel": (
        Outcome("raised", 1, "RuntimeError: 0 active drivers ([]). There should only be 1.",
                raised_in=("__main__", "liger_kernel.ops.rms_norm", "triton.runtime.driver")),
        "memprof: the script failed inside triton (triton.runtime.driver)"),
    "a CUDA binding of PyTorch's CUDA build": (
        Outcome("raised", 1, "AttributeError: module 'torch._C' has no attribute"
                " '_cuda_getCurrentRawStream'",
                raised_in=("__main__", "xformers", "xformers.ops", "torch")),
        "memprof: xformers needs torch._C._cuda_getCurrentRawStream, which only a CUDA"
        " build of PyTorch has"),
    "the script's own error": (
        Outcome("raised", 1, "NameError: name 'x' is not defined", raised_in=("__main__",)),
        None),
    "memprof's own line already says why": (
        Outcome("raised", 1, "VirtualGpuUnsupported: memprof's virtual GPU cannot run ...",
                raised_in=("__main__", "flash_attn", "memprof.collect.virtual.tensor")),
        None),
    "completed": (Outcome("completed", 0), None),
}


@pytest.mark.parametrize("case", FAILURES)
def test_extension_failure_line(case: str) -> None:
    outcome, expected = FAILURES[case]
    line = extension_failure(outcome)
    if expected is None:
        assert line is None
    else:
        assert line is not None and line.startswith(expected)
        assert line.endswith("profile this script on a GPU, or its host tensors with"
                             " --device cpu")


def memprof_run(script: Path) -> tuple[int, list[str]]:
    """``memprof run --virtual-gpu H100 SCRIPT`` in a fresh process: its exit code, and
    its stdout and stderr lines."""
    done = run_python(["-m", "memprof", "run", "--virtual-gpu", "H100", "-o",
                       script.parent / "out", script], script.parent)
    return done.code, (done.stdout + done.stderr).splitlines()


def test_failure_inside_an_extension_is_named(tmp_path: Path) -> None:
    package = tmp_path / "flash_attn"  # an extension whose CUDA library cannot load here
    package.mkdir()
    (package / "__init__.py").write_text(
        'raise OSError("libcudart.so.12: cannot open shared object file")\n')
    (tmp_path / "train.py").write_text("import flash_attn\n")
    code, lines = memprof_run(tmp_path / "train.py")
    assert code == 1
    named = [line for line in lines if line.startswith("memprof: the script failed inside")]
    assert named == ["memprof: the script failed inside flash-attn (flash_attn), a library"
                     " with CUDA kernels of its own: the virtual GPU runs PyTorch's operators,"
                     " not those kernels; profile this script on a GPU, or its host tensors"
                     " with --device cpu"]
    assert not any("made no CUDA tensor" in line for line in lines)


def test_bitsandbytes_imports_as_on_this_machine(tmp_path: Path) -> None:
    package = tmp_path / "bitsandbytes"  # before the installed one: the script's folder
    package.mkdir()
    (package / "__init__.py").write_text("import torch\nSEEN = torch.cuda.is_available()\n")
    (tmp_path / "train.py").write_text(
        "import torch, bitsandbytes\nprint('seen', bitsandbytes.SEEN,"
        " torch.cuda.is_available())\n")
    code, lines = memprof_run(tmp_path / "train.py")
    assert code == 0
    assert f"seen {torch.cuda.is_available()} True" in lines


ADAMW8BIT = """\
import torch
import bitsandbytes as bnb
from torch import nn

layer = nn.Linear(1024, 1024, bias=False).cuda()
layer.weight.grad = torch.zeros_like(layer.weight)
before = torch.cuda.memory_allocated()
optimizer = bnb.optim.AdamW8bit(layer.parameters())
optimizer.step()
state = optimizer.state[layer.weight]
print("state", torch.cuda.memory_allocated() - before, state["state1"].dtype)
"""


def test_bitsandbytes_script(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes", reason=BNB_MISSING)
    (tmp_path / "train.py").write_text(ADAMW8BIT)
    code, lines = memprof_run(tmp_path / "train.py")
    assert code == 0, "\n".join(lines[-20:])
    assert f"state {adam_state(1 << 20) + QMAP_BYTES} torch.uint8" in lines
    assert not any("torch.compile" in line or "Traceback" in line for line in lines)


def test_bitsandbytes_left_as_found(bnb: object) -> None:
    """Outside the virtual GPU bitsandbytes' functions and torch's are their own again."""
    functional = bnb.functional  # type: ignore[attr-defined]
    virtual = VirtualGpu(parse_spec("H100"), AllocatorSettings())
    with CpuRecorder(virtual.recorder), virtual:
        assert functional.get_paged.__module__ == "memprof.collect.virtual.extensions"
    assert functional.get_paged.__module__ == "bitsandbytes.functional"
    assert "_make_subclass" not in vars(torch.Tensor)
