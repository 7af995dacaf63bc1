"""`memprof run --virtual-gpu`: unmodified CUDA scripts on a machine without a GPU.

Each run is the real command line in a fresh process; the expected numbers come from
the model sizes and the CUDA caching allocator's block rounding, never from a run.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from test_run_cli import (
    F32,
    MLP,
    SAMPLES,
    Result,
    block,
    flags,
    load_sample,
    memprof_here,
    memprof_run,
    report,
    run_python,
)

from memprof.analysis.blocks import SMALL_BUFFER
from memprof.collect.virtual.cards import DEFAULT_CARD, parse_spec
from memprof.collect.virtual.workspaces import blas_workspace_sizes

BF16 = torch.bfloat16.itemsize
AMP_SIZES = (96, 80, 24, 20)
# 3.26B parameters: 61 GiB predicted, no GPU and a few hundred MiB of host memory
SCALE = ["--layers", "26", "--d-model", "3072", "--heads", "24", "--seq", "1024", "--batch",
         "1", "--vocab", "50257", "--amp", "bf16"]
ATTENTION = load_sample("transformer_lm").PRESETS["tiny"]

API = """\
from concurrent.futures import ThreadPoolExecutor
import torch
from torch import nn
props = torch.cuda.get_device_properties(0)
# a bare device index is CUDA's, as DDP scripts pass their local rank
assert torch.ones(2).to(0).is_cuda and nn.Linear(2, 2).to(0).weight.is_cuda
assert torch.ones(2).to(device=0).is_cuda
assert torch.device(0) == torch.device("cuda", 0)  # torch.device(local_rank)
assert torch.ones(2, device=torch.device(1)).is_cuda
torch.cuda.nvtx.range_push("step")
torch.cuda.nvtx.range_pop()
pinned = torch.ones(4).pin_memory()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record(); torch.cuda.synchronize(); end.record()
torch.set_default_device("cuda")
made = torch.zeros(8)
linear = nn.Linear(16, 32)
torch.set_default_device("cpu")
compiled = torch.compile(linear)(torch.ones(3, 16, device="cuda"))
decorated = torch.compile(mode="max-autotune")(lambda t: t * 2)(made)
torch.cuda.manual_seed(0)
rng = torch.cuda.get_rng_state()
tail = nn.Linear(4, 4).cuda()
tail(torch.ones(1, 4, device="cuda"))  # memprof hooks its parameters here
half = str(tail.half().weight.dtype)  # swaps tensor subclass parameters in place
del tail
with torch.inference_mode():  # a view of a tensor made outside it is a normal tensor
    inference = [made[1:].is_inference(), torch.ones(2, device="cuda")[1:].is_inference()]
with torch.cuda.device(0), torch.cuda.device_of(made):  # these swap the current device
    swapped = [torch.cuda.current_device(), torch.ones(2, device="cuda").is_cuda]
pinned_empty = torch.empty(4, pin_memory=True)
stats = torch.cuda.memory_stats()
summary = torch.cuda.memory_summary()
# a thread the script starts (transformers loads weights on a pool) makes CUDA tensors too;
# waited for here, so that its tensor is gone before memory_allocated() is read
threaded = ThreadPoolExecutor(1).submit(lambda: str(torch.ones(4, device="cuda").device)).result()
print(json.dumps({
    "available": torch.cuda.is_available(), "count": torch.cuda.device_count(),
    "current": torch.cuda.current_device(), "name": torch.cuda.get_device_name(0),
    "total": props.total_memory, "capability": [props.major, props.minor],
    "bf16": torch.cuda.is_bf16_supported(), "mem_get_info": list(torch.cuda.mem_get_info()),
    "pinned_on_host": pinned.device.type, "default_is_cuda": made.is_cuda,
    "linear": [linear.weight.device.type, list(linear.weight.shape)],
    "item": made.sum().item(), "tolist": made[:2].tolist(),
    "allocated": torch.cuda.memory_allocated(),
    "compiled": [list(compiled.shape), compiled.is_cuda, decorated.is_cuda],
    "inference": inference,
    "rng": [list(rng.shape), rng.device.type, torch.cuda.is_current_stream_capturing()],
    "half": half,
    "swapped": swapped, "pinned_empty": pinned_empty.device.type,
    "stats": [stats["allocation.all.current"],
              stats["allocated_bytes.all.allocated"] - stats["allocated_bytes.all.freed"]],
    "summary": summary.splitlines()[1].split()[:3], "threaded": threaded,
    "cuda_version": torch.version.cuda,
}))
"""

HOST_DATA = """\
import torch
from torch.utils.data import DataLoader, TensorDataset
data = torch.randn(64 << 20 >> 2)  # a 64 MiB dataset on the host
loader = DataLoader(TensorDataset(data[:1000]), batch_size=1000, num_workers=1,
                    pin_memory=True)
(batch,) = next(iter(loader))  # made in a worker, pinned on DataLoader's own thread
batch = batch.to("cuda", non_blocking=True)
print(torch.cuda.max_memory_allocated())
"""

# VmHWM, not ru_maxrss: ru_maxrss counts the peak of the process that started this one (it
# is kept across exec), the test suite's own under load
HOST_MODEL = """\
import re
import torch
model = torch.nn.Linear(23000, 23000)  # 2.1 GB of fp32 weights, built on the host
model.cuda()
with open("/proc/self/status") as status:
    peak = int(re.search(r"VmHWM:\\s*(\\d+) kB", status.read()).group(1)) << 10
print(torch.cuda.memory_allocated(), peak)
"""

HOST_TRAINING = """\
import torch
from torch import nn
torch.manual_seed(1)
# 90 MiB of weights built and initialised twice on the host, then trained on the CPU
model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(22)), nn.Linear(1024, 1))
for m in model:
    nn.init.normal_(m.weight, 0.0, 0.02)
loss = model(torch.randn(4, 1024)).pow(2).mean()
loss.backward()
print(f"{loss.item():.6e} {sum(float(p.abs().sum()) for p in model.parameters()):.6e}")
"""

AUTOCAST = """\
import sys
import torch
from torch import nn
torch.cuda.memory._record_memory_history()
IN, HIDDEN, OUT, BATCH = {sizes}
model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT)).cuda()
x, y = torch.randn(BATCH, IN, device="cuda"), torch.randn(BATCH, OUT, device="cuda")
with torch.autocast("cuda", dtype=torch.bfloat16):
    out = model(x)
    loss = nn.functional.mse_loss(out, y)
print(out.dtype, loss.dtype)
loss.backward()
torch.optim.SGD(model.parameters(), lr=0.1).step()
torch.cuda.memory._dump_snapshot(sys.argv[1])
"""

Job = Callable[[Path], Any]
JOBS: dict[str, Job] = {}


def job(fn: Job) -> Job:
    JOBS[fn.__name__] = fn
    return fn


def virtual_run(where: Path, spec: str | None, script: Path | str, *args: str) -> Result:
    """``memprof run [--virtual-gpu SPEC] SCRIPT ARGS`` into ``where/out``."""
    chosen = ["--virtual-gpu", spec] if spec else []
    return run_python(["-m", "memprof", "run", "-o", where / "out", *chosen, script, *args],
                      where)


def inline(where: Path, spec: str | None, name: str, code: str, *args: str) -> Result:
    (where / f"{name}.py").write_text(("import json\n" if "json." in code else "") + code)
    return virtual_run(where, spec, f"{name}.py", *args)


@job
def mlp(where: Path) -> Result:
    return virtual_run(where, "H100", SAMPLES / "mlp_adam.py", *flags(MLP))


@job
def flash(where: Path) -> Result:
    return virtual_run(where, "H100", SAMPLES / "transformer_lm.py", "--amp", "bf16")


@job
def math_v100(where: Path) -> Result:
    return virtual_run(where, "V100", SAMPLES / "transformer_lm.py", "--amp", "bf16")


@job
def api(where: Path) -> Result:
    return inline(where, "A100 40GB", "api", API)


@job
def default_card(where: Path) -> Result:
    return inline(where, None, "host_data", HOST_DATA)


@job
def host_training(where: Path) -> Result:
    return inline(where, None, "host_training", HOST_TRAINING)


@job
def host_training_python(where: Path) -> Result:
    """The same script as python runs it."""
    (where / "host_training.py").write_text(HOST_TRAINING)
    return run_python([where / "host_training.py"], where)


@job
def host_model(where: Path) -> Result:
    return inline(where, "H100", "host_model", HOST_MODEL)


@job
def autocast(where: Path) -> Result:
    code = AUTOCAST.replace("{sizes}", ", ".join(map(str, AMP_SIZES)))
    return inline(where, "H100", "amp", code, str(where / "dumped.pickle"))


@job
def scale(where: Path) -> Result:
    return virtual_run(where, "H100", SAMPLES / "transformer_lm.py", *SCALE, "--steps", "1")


CHECKPOINTS = """
import os, shutil, sys
import torch
assert torch.accelerator.is_available()
device = torch.accelerator.current_accelerator()
model = torch.nn.Linear(256, 256, bias=False).to(device)
real = torch.load(sys.argv[1], map_location="cuda")  # saved by plain PyTorch: real weights
assert real["weight"].is_cuda and real.pop("step").item() == 7  # scalars keep their values
model.load_state_dict(real)
torch.save(model.state_dict(), "virtual.pt")
back = torch.load("virtual.pt")  # weights_only, as PyTorch 2.6+ loads by default
assert back["weight"].is_cuda and back["weight"].shape == (256, 256)
assert torch.load("virtual.pt", map_location="cpu")["weight"].device.type == "cpu"
torch.save(model.state_dict(), sys.argv[1])  # over the real checkpoint: it must survive
assert torch.load(sys.argv[1])["weight"].is_cuda  # this run reads its own save back
torch.save({"loss": 1.5}, "metrics.pt")  # no virtual tensor: written as python would
torch.save(model.state_dict(), "tmp.pt")  # an atomic save: a temporary file, renamed
os.replace("tmp.pt", sys.argv[1])  # over the real checkpoint again
shutil.copyfile(sys.argv[1], "best.pt")
assert os.path.exists("best.pt") and not os.path.exists("tmp.pt")
assert torch.load("best.pt")["weight"].is_cuda
os.remove("best.pt")
assert not os.path.exists("best.pt")
"""


@job
def checkpoints(where: Path) -> Result:
    torch.save({"weight": torch.ones(256, 256), "step": torch.tensor(7.0)}, where / "real.pt")
    return inline(where, None, "checkpoints", CHECKPOINTS, str(where / "real.pt"))


EMA = """\
import copy, torch
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024)).cuda()
ema = copy.deepcopy(model)  # timm's ModelEmaV3: never run in training, updated in place
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.ones(8, 1024, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for averaged, p in zip(ema.parameters(), model.parameters()):
            averaged.lerp_(p, 0.001)
"""


@job
def ema(where: Path) -> Result:
    return inline(where, "H100", "ema", EMA)


MASKED_ATTENTION = """\
import functools
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
mask = torch.ones(128, 128, dtype=torch.bool, device="cuda").tril()  # as Hugging Face passes
attend = functools.partial(F.scaled_dot_product_attention, attn_mask=mask)
# recomputed in backward, where it must pick the forward's kernel (or checkpoint raises)
checkpoint(attend, q, k, v, use_reentrant=False).sum().backward()
print(q.grad.shape)
"""


@job
def masked_attention(where: Path) -> Result:
    return inline(where, "H100", "masked", MASKED_ATTENTION)


DROPOUT = """\
import torch
from torch import nn
x = torch.randn(64, 256, 384, device="cuda", requires_grad=True)
y = nn.Dropout(0.2)(x) + nn.functional.dropout(x, 0.1) + torch.dropout(x, 0.1, True)
y.sum().backward()
nn.functional.dropout(x.detach().clone(), 0.1, inplace=True)  # in place: the unfused kernel
mlp = nn.Linear(384, 1536).cuda()
mlp(x.detach()).sum().backward()
nn.utils.clip_grad_norm_(mlp.parameters(), 1.0)  # foreach, as on a card
"""


@job
def dropout(where: Path) -> Result:
    return inline(where, "H100", "dropout", DROPOUT)


CPU_ONLY = """\
import torch
torch.manual_seed(0)
print(torch.nn.Linear(8, 8)(torch.ones(2, 8)).sum().item())
"""


@job
def no_cuda(where: Path) -> Result:
    return inline(where, None, "cpu_only", CPU_ONLY)


@job
def no_cuda_python(where: Path) -> Result:
    """The same script as python runs it."""
    (where / "cpu_only.py").write_text(CPU_ONLY)
    return run_python(["cpu_only.py"], where)


@job
def oom(where: Path) -> Result:
    return virtual_run(where, "1GiB", SAMPLES / "mlp_adam.py", "--hidden", "8192",
                       "--layers", "4")


GRADIENT_SUM = """\
import sys
import torch
x = torch.randn(1 << 20, device="cuda", requires_grad=True)  # 4 MiB
loss = (x * 2).sum() + (x * 3).sum() + (x * 4).sum()  # three gradients flow into x
torch.cuda.memory._record_memory_history()
loss.backward()
torch.cuda.memory._dump_snapshot(sys.argv[1])
print(torch.cuda.max_memory_allocated())
"""


@job
def gradient_sum(where: Path) -> Result:
    return inline(where, "H100", "gradient_sum", GRADIENT_SUM, str(where / "dumped.pickle"))


CAST_CACHE = """\
import torch
weight = torch.nn.Parameter(torch.randn(4096, 1024, device="cuda"))  # 8 MiB in bf16
x = torch.randn(4, 1024, device="cuda")
torch.nn.functional.linear(x, weight)  # the thread's cuBLAS workspace, before measuring
held = []
for mode in (torch.no_grad, torch.inference_mode):
    with mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        before = torch.cuda.memory_allocated()
        torch.nn.functional.linear(x, weight)  # its output freed at once
        held.append(torch.cuda.memory_allocated() - before)
print(held)
"""


@job
def cast_cache(where: Path) -> Result:
    return inline(where, "H100", "cast_cache", CAST_CACHE)


VALUES = """\
import torch
g = torch.Generator(device="cuda")  # a CPU build cannot make one: the card's stands in
g.manual_seed(1)
assert isinstance(g, torch.Generator) and isinstance(torch.default_generator, torch.Generator)
x = torch.randn(8192, 256, device="cuda", generator=g)
# more elements than the virtual GPU keeps values for: sizes set by them are unknown
labels = torch.randint(0, 100, (8192,), device="cuda", generator=g)
keep = labels != 7
before = torch.cuda.memory_allocated()
picked = x[keep]  # a boolean mask: as many rows as the values select
held = torch.cuda.memory_allocated() - before
print(g.device, tuple(picked.shape), tuple(torch.nonzero(keep).shape), held)
torch.unique(labels)
"""


@job
def values(where: Path) -> Result:
    return inline(where, "H100", "values", VALUES)


GRAPHS = """\
import json
import torch
reserved, allocated = torch.cuda.memory_reserved, torch.cuda.memory_allocated
model = torch.nn.Linear(256, 256).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(64, 256, device="cuda")
for _ in range(2):  # warm-up, eagerly
    opt.zero_grad(set_to_none=True)
    model(x).sum().backward()
    opt.step()
opt.zero_grad(set_to_none=True)
torch.cuda.empty_cache()
before = [allocated(), reserved()]
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    y = model(x).sum()
    y.backward()
    opt.step()
captured = [allocated(), reserved()]
for _ in range(3):
    g.replay()
replayed = [allocated(), reserved()]
shared = torch.cuda.CUDAGraph()  # a second graph in the first one's pool
with torch.cuda.graph(shared, pool=g.pool()):
    z = x * 2
sharing = [allocated(), reserved()]
pools = sorted({tuple(s["segment_pool_id"]) for s in torch.cuda.memory_snapshot()})
del y, z
opt.zero_grad(set_to_none=True)
torch.cuda.empty_cache()
kept = reserved()  # the graphs still use their pool
g.reset()
shared.reset()
torch.cuda.empty_cache()
released = reserved()
graphed = torch.cuda.make_graphed_callables(torch.nn.Linear(256, 8).cuda(), (x,))
out = graphed(x)
print(json.dumps({"before": before, "captured": captured, "replayed": replayed,
                  "sharing": sharing, "pools": pools, "kept": kept, "released": released,
                  "handle": list(torch.cuda.graph_pool_handle()),
                  "graphed": [list(out.shape), out.is_cuda],
                  "capturing": torch.cuda.is_current_stream_capturing()}))
"""


@job
def graphs(where: Path) -> Result:
    return inline(where, "H100", "graphs", GRAPHS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Any]]]:
    base = tmp_path_factory.mktemp("virtual")
    with ThreadPoolExecutor(max_workers=max(2, min(6, os.cpu_count() or 2))) as pool:
        futures = {}
        for name, fn in JOBS.items():
            (base / name).mkdir()
            futures[name] = pool.submit(lambda fn=fn, d=base / name: (fn(d), d))
        yield futures


def finished(runs: dict[str, Future[Any]], name: str, code: int = 0) -> tuple[Result, Path]:
    result, where = runs[name].result()
    assert result.code == code, result.stderr[-3000:]
    return result, where


def device_of(where: Path) -> dict[str, Any]:
    return report(where / "out")["devices"][0]


# --- model state and activations: exact bytes ------------------------------------------


def test_adam_state_is_exact_and_step_tensors_stay_on_the_host(runs: dict[str, Future[Any]]
                                                               ) -> None:
    _, where = finished(runs, "mlp")
    model = load_sample("mlp_adam").build_model(MLP["hidden"], MLP["layers"])
    param_bytes = sum(block(p.numel() * F32) for p in model.parameters())
    assert param_bytes != F32 * sum(p.numel() for p in model.parameters())
    # CUDA's Adam (foreach by default) keeps exp_avg and exp_avg_sq on the device and
    # `step` as a host tensor (neither capturable nor fused): not device memory
    expected = {"parameters": param_bytes, "gradients": param_bytes,
                "optimizer_state": 2 * param_bytes}
    device = device_of(where)
    assert {k: device["categories"][k] for k in expected} == expected
    assert {k: device["category_peaks"][k] for k in expected} == expected
    # the tensors' own bytes: 4P of weights, 4P of gradients, 8P of moments, as a hand count
    count = sum(p.numel() for p in model.parameters())
    assert {k: device["categories_requested"][k] for k in expected} == {
        "parameters": F32 * count, "gradients": F32 * count, "optimizer_state": 2 * F32 * count}
    data = report(where / "out")
    assert data["run"]["predicted"] is True
    card = parse_spec("H100")
    assert data["run"]["virtual_gpu"]["total_bytes"] == card.total_bytes
    assert data["run"]["virtual_gpu"]["context_bytes"] == card.context_bytes


def test_bf16_autocast_saves_what_cudas_policy_casts(runs: dict[str, Future[Any]]) -> None:
    result, where = finished(runs, "autocast")
    # linear runs in bf16, mse_loss in fp32 (autocast_mode.cpp)
    assert result.stdout.splitlines()[0] == "torch.bfloat16 torch.float32"
    inp, hidden, out, batch = AMP_SIZES
    # saved for backward: the bf16 casts of the input and of the second weight (the first
    # weight is not saved: the input needs no gradient), the bf16 ReLU output (which the
    # second linear saves too), mse_loss's fp32 cast of the bf16 output and its fp32 target
    expected = (block(batch * inp * BF16) + block(batch * hidden * BF16)
                + block(out * hidden * BF16) + block(batch * out * F32)
                + block(batch * out * F32))
    assert device_of(where)["category_peaks"]["activations"] == expected


# --- attention: the card's SDPA kernel --------------------------------------------------


def _attention_allocs(where: Path) -> list[int]:
    """Sizes allocated at the sample's scaled_dot_product_attention line (forward)."""
    lines = (SAMPLES / "transformer_lm.py").read_text().splitlines()
    line = 1 + next(i for i, text in enumerate(lines) if "scaled_dot_product_attention(" in text)
    snapshot = run_python(["-c", "import pickle, sys, json; s = pickle.load(open(sys.argv[1],"
                           " 'rb')); print(json.dumps([[e['size'], [(f['filename'], f['line'])"
                           " for f in e['frames']]] for e in s['device_traces'][0]"
                           " if e['action'] == 'alloc']))", where / "out" / "snapshot.pickle"],
                          where)
    sizes = []
    for size, frames in json.loads(snapshot.stdout):
        mine = [ln for name, ln in frames if name.endswith("transformer_lm.py")]
        if mine and mine[0] == line:
            sizes.append(size)
    return sizes


def test_autocast_caches_weight_casts_except_in_inference_mode(runs: dict[str, Future[Any]]
                                                               ) -> None:
    # the bf16 copy of a weight stays cached until autocast exits; in inference mode,
    # torch 2.11 and later (this one) cast it again at every use (2.6 cached it there too)
    result, _ = finished(runs, "cast_cache")
    assert result.stdout.strip() == f"[{4096 * 1024 * BF16}, 0]"


def test_h100_runs_cudnn_attention_with_its_logsumexp(runs: dict[str, Future[Any]]) -> None:
    # torch 2.11 and later try cuDNN's attention first on sm90 (tests/test_kernel_scratch.py)
    _, where = finished(runs, "flash")
    b, h, s, d = ATTENTION["batch"], ATTENTION["heads"], ATTENTION["seq"], \
        ATTENTION["d_model"] // ATTENTION["heads"]
    sizes = _attention_allocs(where)
    assert b * h * s * F32 in sizes  # the logsumexp, fp32 (B, H, S, 1)
    assert b * h * s * d * BF16 in sizes  # the output
    # each call's RNG seed and offset, and its plan's workspace
    assert 256 in sizes and sizes.count(8) == 2 * sizes.count(256)
    assert max(sizes) < b * h * s * s * BF16  # no attention matrix


def test_dropout_keeps_cudas_boolean_mask(runs: dict[str, Future[Any]]) -> None:
    # CUDA's fused dropout keeps a bool mask; the unfused one (in place, or on the CPU) keeps
    # noise of the input's dtype
    _, where = finished(runs, "dropout")
    snapshot = pickle.loads((where / "out" / "snapshot.pickle").read_bytes())
    sizes = Counter(e["size"] for e in snapshot["device_traces"][0] if e["action"] == "alloc")
    n = 64 * 256 * 384
    assert sizes[n] == 3  # the three out-of-place calls' masks
    # x, the outputs, the two sums, the three gradients, and the in-place call's copy and noise
    assert sizes[n * F32] == 1 + 3 + 2 + 3 + 1 + 1
    # clip_grad_norm_ takes _foreach_norm: each chunk of 65,536 elements stages a partial
    # norm, 9 chunks for the 589,824-element weight, for both tensors
    clipping = [e["size"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"
                and any(f["name"] == "_get_total_norm" for f in e["frames"])]
    assert clipping[0] == 2 * 9 * F32 and clipping[1:3] == [F32, F32]


def test_v100_falls_back_to_math_attention(runs: dict[str, Future[Any]]) -> None:
    # bf16 needs compute capability 8.0 for flash and memory-efficient attention
    _, where = finished(runs, "math_v100")
    b, h, s = ATTENTION["batch"], ATTENTION["heads"], ATTENTION["seq"]
    sizes = _attention_allocs(where)
    assert b * h * s * s * BF16 in sizes  # the attention matrix
    assert b * h * s * F32 not in sizes


def test_a_boolean_mask_becomes_the_efficient_kernels_bias(runs: dict[str, Future[Any]]
                                                          ) -> None:
    # flash takes no mask: memory-efficient attention gets it as a bf16 additive bias of the
    # mask's own shape, as sdp_utils' convert_boolean_attn_mask makes it, in the forward and
    # again in checkpointing's recomputation
    result, where = finished(runs, "masked_attention")
    assert result.stdout.strip() == "torch.Size([2, 4, 128, 64])"
    snapshot = pickle.loads((where / "out" / "snapshot.pickle").read_bytes())
    sizes = [e["size"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    assert sizes.count(128 * 128 * BF16) == 2


# --- what the script sees --------------------------------------------------------------


def test_the_scripts_own_peak_is_the_reports(runs: dict[str, Future[Any]]) -> None:
    result, where = finished(runs, "flash")
    printed = int(re.search(r"max_memory_allocated (\d+)", result.stdout).group(1))
    assert printed == device_of(where)["peak"]["allocated_bytes"]
    assert "predicted for H100 80GB" in result.stderr


def test_training_holds_a_cublas_workspace_per_thread(runs: dict[str, Future[Any]]) -> None:
    # the forward's first matmul and the backward's (autograd's own thread on a card); the
    # forward's first Linear (addmm with a bias) also makes its thread's cuBLASLt workspace
    # where this torch keeps it apart (2.11 and before)
    _, where = finished(runs, "flash")
    size, lt = blas_workspace_sizes(parse_spec("H100").capability, {})
    snapshot = run_python(["-c", "import pickle, sys; s = pickle.load(open(sys.argv[1], 'rb'));"
                           f" print(sum(e['action'] == 'alloc' and e['size'] == {size}"
                           " for e in s['device_traces'][0]))",
                           where / "out" / "snapshot.pickle"], where)
    assert int(snapshot.stdout) == 2
    # labelled as what they are, not "other"
    assert device_of(where)["categories"]["workspace"] == 2 * size + lt
    assert device_of(where)["categories"]["other"] == 0


def test_gradients_flowing_into_one_tensor_are_summed_in_place(runs: dict[str, Future[Any]]
                                                              ) -> None:
    # autograd adds each new gradient into the buffered one (InputBuffer::accumulate): three
    # 4 MiB gradients, never a fourth block for their sum; at most x and two of them live
    result, where = finished(runs, "gradient_sum")
    with open(where / "dumped.pickle", "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    assert sum(e["action"] == "alloc" and e["size"] == 4 << 20 for e in trace) == 3
    assert int(result.stdout) == 3 * (4 << 20) + 2 * 512  # and the loss, backward's ones


def test_a_dumped_snapshot_reads_back_in_explain(runs: dict[str, Future[Any]]) -> None:
    _, where = finished(runs, "autocast")
    explained = run_python(["-m", "memprof", "explain", "--json", "-o", "-",
                            where / "dumped.pickle"], where)
    assert explained.code == 0, explained.stderr
    dumped = json.loads(explained.stdout)["devices"][0]
    run = device_of(where)
    assert dumped["peak"] == run["peak"]
    assert dumped["categories_inferred"] is True


def test_torch_cuda_answers_as_the_card(runs: dict[str, Future[Any]]) -> None:
    result, _ = finished(runs, "api")
    card = parse_spec("A100 40GB")
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen == {
        "available": True, "count": 1, "current": 0, "name": card.device_name,
        "total": card.total_bytes, "capability": list(card.capability), "bf16": True,
        # one small segment (an Lt workspace fits in it), and a 20 MiB one for the cuBLAS
        # workspace of the first matmul
        "mem_get_info": [card.usable_bytes - (2 << 20) - (20 << 20), card.total_bytes],
        "pinned_on_host": "cpu", "default_is_cuda": True, "linear": ["cuda", [32, 16]],
        "item": 0.0, "tolist": [0.0, 0.0],
        "allocated": block(8 * F32) + block(32 * 16 * F32) + block(32 * F32)
        + block(3 * 16 * F32) + block(3 * 32 * F32) + block(8 * F32)
        + sum(blas_workspace_sizes(card.capability, {})),  # the Linear: cuBLAS's (and Lt's)
        "compiled": [[3, 32], True, True], "inference": [False, True],
        "rng": [[16], "cpu", False], "half": "torch.float16", "swapped": [0, True],
        "pinned_empty": "cpu",
        # the six tensors above and the workspaces; what was allocated less what was freed
        "stats": [6 + sum(size > 0 for size in blas_workspace_sizes(card.capability, {})),
                  seen["allocated"]], "summary": ["|", "PyTorch", "CUDA"],
        "threaded": "cuda:0", "cuda_version": "12.8"}
    assert "hold no values" not in result.stderr  # small tensors hold their real values
    # each thing compiled named once: the Linear, and the function a decorator factory took
    assert result.stderr.count("torch.compile ran Linear eagerly") == 1
    assert result.stderr.count("torch.compile ran <lambda> eagerly") == 1


def test_host_tensors_are_not_device_memory(runs: dict[str, Future[Any]]) -> None:
    result, where = finished(runs, "default_card")
    assert int(result.stdout) == block(1000 * F32)
    assert device_of(where)["peak"]["allocated_bytes"] == block(1000 * F32)
    assert f"virtual {DEFAULT_CARD.name}" in result.stderr.splitlines()[0]


def test_a_model_built_on_the_host_never_holds_its_weights(runs: dict[str, Future[Any]]
                                                            ) -> None:
    result, _ = finished(runs, "host_model")
    allocated, max_rss = map(int, result.stdout.split())
    # the weight gets a segment of its own, rounded up to 2 MiB; the remainder (under 1 MiB)
    # is not split off, so the whole segment is its block
    weight = -(-block(23000 * 23000 * F32) // (2 << 20)) * (2 << 20)
    assert weight - block(23000 * 23000 * F32) < 1 << 20
    assert allocated == weight + block(23000 * F32)
    assert max_rss < allocated // 2  # the weights never existed in host memory


def test_a_cpu_only_script_computes_what_python_computes(runs: dict[str, Future[Any]]
                                                         ) -> None:
    # 90 MiB of weights, each initialised twice: every weight is real and initialised
    result, _ = finished(runs, "host_training")
    plain, _ = runs["host_training_python"].result()
    assert plain.code == 0 and plain.stdout.split()[0] != "0.000000e+00"
    assert result.stdout == plain.stdout


def test_checkpoints_save_and_load_on_the_virtual_gpu(runs: dict[str, Future[Any]]) -> None:
    result, where = finished(runs, "checkpoints")
    assert "torch.save(virtual.pt) holds virtual tensors (no weights): it went to a scratch" \
        " file, the path is left as it was" in result.stderr
    # no file of placeholders anywhere, however the script moved and copied them
    assert not any((where / name).exists() for name in ("virtual.pt", "tmp.pt", "best.pt"))
    kept = torch.load(where / "real.pt")  # the real checkpoint, as it was
    assert kept["weight"].equal(torch.ones(256, 256)) and kept["step"].item() == 7
    assert torch.load(where / "metrics.pt") == {"loss": 1.5}
    with open(where / "out" / "snapshot.pickle", "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    weights = [e for e in trace if e["action"] == "alloc" and e["size"] == 256 * 256 * F32]
    # the parameter, the real checkpoint's weight mapped to CUDA, the virtual ones read
    # back on CUDA (virtual.pt, the save over real.pt, best.pt); the copy mapped to the
    # host is not device memory
    assert len(weights) == 5


def test_a_script_that_divides_by_a_placeholder_zero_is_told_why(tmp_path: Path) -> None:
    """pytorch/examples' super_resolution: ``10 * log10(1 / mse.item())``."""
    (tmp_path / "psnr.py").write_text(
        "import math, torch\n"
        "x = torch.ones(64, 4096, device='cuda')\n"
        "mse = torch.nn.functional.mse_loss(x, 2 * x)\n"
        "print(10 * math.log10(1 / mse.item()))\n")
    result = memprof_run(tmp_path, "--no-timeline", "-o", tmp_path / "out", "psnr.py")
    assert result.code == 1
    assert "memprof: the script died on a value (ZeroDivisionError) after reading the" \
        " placeholder zeros of large virtual tensors" in result.stderr


def test_folders_made_for_a_checkpoint_that_went_to_scratch_are_not_left_empty(
        tmp_path: Path) -> None:
    """pytorch/examples' FSDP2 example resumes from its newest checkpoint folder: one left
    empty would make its next run fail to load."""
    code = ("import os, pathlib, torch\n"
            "model = torch.nn.Linear(64, 64).cuda()\n"
            "os.makedirs('checkpoints/dtensor_api/1700000000')\n"
            "torch.save(model.state_dict(), 'checkpoints/dtensor_api/1700000000/model.pt')\n"
            "pathlib.Path('kept/here').mkdir(parents=True)\n"
            "torch.save(model.state_dict(), 'kept/here/model.pt')\n"
            "open('kept/here/log.txt', 'w').close()  # not empty: kept\n"
            "os.makedirs('logs')  # not on the way to a checkpoint: the script's\n"
            "os.makedirs('existing/new')\n"
            "torch.save(model.state_dict(), 'existing/new/model.pt')\n")
    (tmp_path / "existing").mkdir()  # made before the run: not the run's to remove
    (tmp_path / "ckpt.py").write_text(code)
    result = memprof_run(tmp_path, "--no-timeline", "-o", tmp_path / "out", "ckpt.py")
    assert result.code == 0, result.stderr
    assert not (tmp_path / "checkpoints").exists()
    assert sorted(p.name for p in (tmp_path / "kept" / "here").iterdir()) == ["log.txt"]
    assert (tmp_path / "logs").is_dir() and (tmp_path / "existing").is_dir()
    assert not (tmp_path / "existing" / "new").exists()


def test_a_deep_copy_of_a_model_on_the_card_holds_parameters_and_buffers(
        runs: dict[str, Future[Any]]) -> None:
    """The model and its EMA copy: twice (1024 x 1024 + 1024 + 2 x 1024) fp32 parameters,
    twice two fp32 running statistics and an int64 counter as buffers; nothing unlabelled."""
    finished(runs, "ema")
    held = device_of(runs["ema"].result()[1])["categories_requested"]
    assert held["parameters"] == 2 * F32 * (1024 * 1024 + 1024 + 2 * 1024)
    assert held["buffers"] == 2 * (2 * F32 * 1024 + 8)
    assert held["other"] == 0


def test_a_script_without_cuda_tensors_is_told_so(runs: dict[str, Future[Any]]) -> None:
    result, where = finished(runs, "no_cuda")
    # host model state stays real while small: the script computes what python computes
    assert result.stdout == runs["no_cuda_python"].result()[0].stdout
    assert float(result.stdout) != 0
    assert "made no CUDA tensor, so the virtual H100 80GB held nothing; --device cpu" \
        in result.stderr
    assert report(where / "out")["devices"] == []
    advice = memprof_here(where, "suggest", "out", "--budget", "1GB")
    assert advice.code == 2
    assert "the run made no CUDA tensor, so the virtual GPU held nothing to measure; run the" \
        " script with --device cpu" in advice.stderr


def test_sizes_set_by_values_are_their_largest_and_unique_is_refused(
        runs: dict[str, Future[Any]]) -> None:
    result, where = finished(runs, "values", code=1)
    # every row selected: 8192 x 256 fp32, the block the allocator rounds it to
    assert result.stdout.split() == ["cuda:0", "(8192,", "256)", "(8192,", "1)",
                                     str(block(8192 * 256 * 4))]
    assert "sizes that depend on values (nonzero, torch.where(mask), boolean-mask indexing)" \
        " are taken at their largest" in result.stderr
    last = result.stderr.split("memprof run values.py")[0].strip().splitlines()[-1]
    assert last.startswith("memprof.collect.virtual.unsupported.VirtualGpuUnsupported:"
                           " memprof's virtual GPU cannot run aten._unique2.default")
    assert "--device cpu" in last and "The above exception" not in result.stderr
    assert report(where / "out")["run"]["exit"]["status"] == "raised"


def test_a_sparse_tensor_on_the_card_is_refused_not_charged_as_dense(tmp_path: Path) -> None:
    """A graph's adjacency (10,000 x 10,000 with 50,000 entries) moved to the card: it
    would have been charged as 400 MB of dense floats."""
    code = ("import torch\n"
            "i = torch.randint(0, 10_000, (2, 50_000))\n"
            "adjacency = torch.sparse_coo_tensor(i, torch.rand(50_000), (10_000, 10_000))\n"
            "adjacency.to('cuda')\n")
    (tmp_path / "sparse.py").write_text(code)
    result = memprof_run(tmp_path, "--no-timeline", "-o", tmp_path / "out", "sparse.py")
    assert result.code == 1
    last = result.stderr.strip().splitlines()
    refused = next(line for line in last if "VirtualGpuUnsupported" in line)
    assert refused.endswith("memprof's virtual GPU cannot run sparse_coo tensors on CUDA (it"
                            " models strided tensors only, and would charge this one as"
                            " dense); keep it on the host, or profile the script on a GPU or"
                            " its host tensors with --device cpu")
    # the script's own line, not memprof's frames under it
    assert 'File "' + str(tmp_path / "sparse.py") in result.stderr
    assert "memprof/collect" not in result.stderr.split("Traceback")[1]


def test_cuda_graphs_capture_into_a_private_pool_and_replay_without_allocating(
        runs: dict[str, Future[Any]]) -> None:
    result, where = finished(runs, "graphs")
    out = json.loads(result.stdout)
    weight, bias, x = block(256 * 256 * F32), block(256 * F32), block(64 * 256 * F32)
    # the capture allocates the gradients and the loss in a pool of its own: a new small segment
    assert out["captured"][0] - out["before"][0] == weight + bias + block(F32)
    assert out["captured"][1] - out["before"][1] == SMALL_BUFFER
    assert out["replayed"] == out["captured"]
    # a graph capturing into another's pool reuses its free blocks
    assert out["sharing"] == [out["captured"][0] + x, out["captured"][1]]
    assert out["pools"] == [[0, 0], [1, 0]]
    # empty_cache() keeps a pool graphs use, and frees it once they are reset
    assert out["kept"] == out["captured"][1]
    assert out["released"] == out["kept"] - SMALL_BUFFER
    assert out["handle"] == [0, 2]  # make_graphed_callables took the first
    assert out["graphed"] == [[64, 8], True] and out["capturing"] is False
    assert report(where / "out")["run"]["exit"]["status"] == "completed"
    # explain's replay knows the pool of the graph's segment, freed before the end
    replay = device_of(where)["replay"]
    assert replay["decisions_matched"] == replay["decisions_total"]
    assert replay["reserved_bytes_predicted_peak"] == replay["reserved_bytes_recorded_peak"]


def test_out_of_memory_where_the_card_would(runs: dict[str, Future[Any]]) -> None:
    result, where = finished(runs, "oom", code=1)
    card = parse_spec("1GiB")
    hidden = 8192
    assert ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 256.00 MiB. GPU 0"
            " has a total capacity of 1024.00 MiB of which ") in result.stderr
    message = re.search(r"of which ([\d.]+) MiB is free\. Including non-PyTorch memory, this"
                        r" process has ([\d.]+) MiB memory in use\. Of the allocated memory"
                        r" ([\d.]+) MiB is allocated by PyTorch, and ([\d.]+) MiB is reserved"
                        r" by PyTorch but unallocated\. If reserved but unallocated memory is"
                        r" large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                        result.stderr)
    assert message is not None, result.stderr[-2000:]
    free, in_use, allocated, cached = (float(g) * (1 << 20) for g in message.groups())
    assert free + in_use == card.total_bytes
    # the first layer (128 -> 8192), the second's 8192 x 8192 weight and bias; the third's
    # weight does not fit
    held = block(8192 * 128 * F32) + block(8192 * F32) + block(hidden * hidden * F32) \
        + block(8192 * F32)
    assert allocated == pytest.approx(held, abs=0.01 * (1 << 20))
    data = report(where / "out")
    assert data["run"]["exit"]["status"] == "raised"
    assert data["devices"][0]["oom"]["requested_bytes"] == hidden * hidden * F32
    assert cached >= 0


def test_a_3b_parameter_model_runs_without_its_memory(runs: dict[str, Future[Any]]) -> None:
    _, where = finished(runs, "scale")
    transformer = load_sample("transformer_lm")
    with torch.device("meta"):
        model = transformer.build_model(transformer.parse_args(SCALE))
    params = list(model.parameters())
    assert sum(p.numel() for p in params) > 3_000_000_000
    param_bytes = sum(block(p.numel() * F32) for p in params)
    device = device_of(where)
    assert device["category_peaks"]["parameters"] == param_bytes
    assert device["category_peaks"]["gradients"] == param_bytes
    assert device["category_peaks"]["optimizer_state"] == 2 * param_bytes
    assert device["peak"]["allocated_bytes"] > 4 * param_bytes
