"""CPU recorder: exact category bytes on a real training run, and trace invariants."""

from __future__ import annotations

import gc
import importlib.util
import io
import pickle
import runpy
import sys
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

import memprof
from memprof.collect.cpu.recorder import CpuRecorder
from memprof.collect.cpu.storages import StorageTracker
from memprof.collect.frames import StackCapture
from memprof.trace.dump import dump_snapshot
from memprof.trace.events import as_snapshot_events
from memprof.trace.model import CATEGORIES

_THREAD_START = threading.Thread.start

SCRIPT = Path(__file__).resolve().parents[1] / "sample_scripts" / "mlp_adam.py"
BATCH = 16
STEPS = 3
ARGV = ["--hidden", "48", "--layers", "3", "--batch", str(BATCH), "--steps", str(STEPS)]
PACKAGE = Path(memprof.__file__).resolve().parent
F32 = torch.float32.itemsize  # bytes per element of the default dtype
EVENT_KEYS = {"action", "addr", "size", "stream", "time_us", "frames"}


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mlp_adam", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run() -> tuple[dict[str, Any], nn.Sequential, torch.optim.Optimizer]:
    script = _load_script()
    with CpuRecorder() as recorder:
        model, optimizer = script.main([*ARGV, "--device", "cpu"])
    return recorder.snapshot(), model, optimizer


def _events(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    return as_snapshot_events(snapshot["device_traces"][0])


def _live_by_category(snapshot: dict[str, Any]) -> list[Counter[str]]:
    """Live bytes per category after each event."""
    labels = dict(snapshot["memprof"]["labels"])
    live: dict[int, tuple[str, int]] = {}
    totals: Counter[str] = Counter()
    timeline = []
    for index, event in enumerate(_events(snapshot)):
        if event["action"] == "alloc":
            live[event["addr"]] = (labels[index], event["size"])
            totals[labels[index]] += event["size"]
        elif event["action"] == "free_completed":
            category, size = live.pop(event["addr"])
            totals[category] -= size
        timeline.append(totals.copy())
    return timeline


def _saved_for_backward_bytes(model: nn.Sequential, batch: int) -> int:
    """What autograd saves in one step of Linear/ReLU blocks under an MSE loss.

    The first Linear saves its input (the batch); each ReLU saves its output, which the
    next Linear saves again (one storage); mse_loss saves the prediction and the target.
    Linear also saves its weight, but that storage is a parameter.
    """
    linears = [m for m in model if isinstance(m, nn.Linear)]
    elements = batch * linears[0].in_features
    width = 0
    for module in model:
        if isinstance(module, nn.Linear):
            width = module.out_features
        elif isinstance(module, nn.ReLU):
            elements += batch * width
    elements += 2 * batch * linears[-1].out_features
    return elements * linears[0].weight.element_size()


def test_snapshot_has_the_pytorch_shape(run) -> None:
    snapshot, _, _ = run
    assert snapshot["segments"] == []
    assert snapshot["allocator_settings"] is None
    assert snapshot["external_annotations"] == []
    assert len(snapshot["device_traces"]) == 1
    meta = snapshot["memprof"]
    assert (meta["version"], meta["recorder"], meta["complete"]) == (1, "cpu", True)
    events = _events(snapshot)
    assert events
    for event in events:
        assert set(event) == EVENT_KEYS
        assert event["action"] in {"alloc", "free_requested", "free_completed"}
        assert event["stream"] == 0
        assert isinstance(event["size"], int) and event["size"] >= 0
    times = [event["time_us"] for event in events]
    assert times == sorted(times)


def test_model_state_bytes_are_exact(run) -> None:
    snapshot, model, optimizer = run
    final = _live_by_category(snapshot)[-1]
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    assert all(p.dtype == torch.float32 for p in params)
    assert param_bytes == 4 * sum(p.numel() for p in params)
    step_tensors = [state["step"] for state in optimizer.state.values()]
    assert len(step_tensors) == len(params)
    step_bytes = sum(t.numel() * t.element_size() for t in step_tensors)
    assert final["parameters"] == param_bytes
    assert final["gradients"] == param_bytes
    assert final["optimizer_state"] == 2 * param_bytes + step_bytes


def test_activation_peak_of_each_step_is_what_autograd_saved(run) -> None:
    snapshot, model, _ = run
    expected = _saved_for_backward_bytes(model, BATCH)
    timeline = _live_by_category(snapshot)
    steps = snapshot["memprof"]["steps"]
    assert len(steps) == STEPS
    for start, end in zip([0, *steps[:-1]], steps, strict=True):
        assert max(totals["activations"] for totals in timeline[start:end]) == expected


def test_steps_are_increasing_event_indices(run) -> None:
    snapshot, _, _ = run
    steps = snapshot["memprof"]["steps"]
    assert steps == sorted(set(steps))
    assert steps[0] > 0
    assert steps[-1] <= len(_events(snapshot))


def test_frees_pair_up_with_one_live_alloc(run) -> None:
    snapshot, _, _ = run
    events = _events(snapshot)
    live: dict[int, int] = {}
    freed: Counter[int] = Counter()
    for index, event in enumerate(events):
        if event["action"] == "alloc":
            assert event["addr"] not in live, "address reused while alive"
            live[event["addr"]] = index
        elif event["action"] == "free_requested":
            done = events[index + 1]
            assert done["action"] == "free_completed"
            assert (done["addr"], done["size"]) == (event["addr"], event["size"])
            alloc = live.pop(event["addr"])
            assert events[alloc]["size"] == event["size"]
            freed[alloc] += 1
        else:
            assert events[index - 1]["action"] == "free_requested"
    assert max(freed.values()) == 1
    assert live, "model state outlives the run"


def test_frames_are_python_innermost_first_through_the_script(run) -> None:
    snapshot, _, _ = run
    for event in _events(snapshot):
        files = [frame["filename"] for frame in event["frames"]]
        assert all(set(frame) == {"filename", "line", "name"} for frame in event["frames"])
        assert all(isinstance(frame["line"], int) for frame in event["frames"])
        assert str(SCRIPT) in files
        assert files.index(str(SCRIPT)) < files.index(__file__)
        inner = files[: files.index(str(SCRIPT))]
        assert not any(Path(f).is_relative_to(PACKAGE) for f in inner)


def test_identical_frames_are_shared(run) -> None:
    snapshot, _, _ = run
    frames = [frame for event in _events(snapshot) for frame in event["frames"]]
    assert len({id(f) for f in frames}) == len({tuple(f.items()) for f in frames})


def test_the_collector_stops_tracking_the_recorded_events(run) -> None:
    # else every full collection the script triggers would walk a million events
    snapshot, _, _ = run
    events = snapshot["device_traces"][0]
    gc.collect()  # a pass may see an event before its stack, and untrack it on the next
    gc.collect()
    assert events and not any(gc.is_tracked(e) or gc.is_tracked(e[-1]) for e in events)


def test_labels_cover_every_alloc_once(run) -> None:
    snapshot, _, _ = run
    labels = snapshot["memprof"]["labels"]
    allocs = [i for i, e in enumerate(_events(snapshot)) if e["action"] == "alloc"]
    assert [index for index, _ in labels] == allocs
    assert {category for _, category in labels} <= set(CATEGORIES)
    assert {category for _, category in labels} >= {
        "parameters",
        "gradients",
        "optimizer_state",
        "activations",
        "temporaries",
    }


class _NoClasses(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"class reference {module}.{name}")


def test_snapshot_is_written_without_class_references(run) -> None:
    snapshot, _, _ = run
    f = io.BytesIO()
    dump_snapshot(snapshot, f)
    loaded = _NoClasses(io.BytesIO(f.getvalue())).load()
    trace = loaded["device_traces"][0]
    assert trace == as_snapshot_events(snapshot["device_traces"][0])
    assert {k: v for k, v in loaded.items() if k not in ("device_traces", "memprof")} == {
        k: v for k, v in snapshot.items() if k not in ("device_traces", "memprof")}
    stacks = loaded["memprof"].pop("stacks")
    assert loaded["memprof"] == snapshot["memprof"]
    # each stack is written once and shared by its events, as in PyTorch's own dumps
    assert {id(e["frames"]) for e in trace} == {id(s) for s in stacks}
    assert len(stacks) < len(trace) / 10


def _record(fn: Callable[[], object]) -> dict[str, Any]:
    with CpuRecorder() as recorder:
        fn()
    return recorder.snapshot()


def _actions(snapshot: dict[str, Any]) -> list[tuple[str, int]]:
    return [(event["action"], event["size"]) for event in _events(snapshot)]


def test_a_parameter_saved_for_backward_stays_a_parameter() -> None:
    n_in, n_out, batch = 3, 5, 2

    def body() -> None:  # the module dies before the recorder stops: no final look
        layer = nn.Linear(n_in, n_out)
        x = torch.randn(batch, n_in, requires_grad=True)  # so Linear saves its weight too
        layer(x).sum().backward()

    snapshot = _record(body)
    events = _events(snapshot)
    labels = dict(snapshot["memprof"]["labels"])
    weight, bias = n_out * n_in * F32, n_out * F32
    assert [(events[i]["size"], labels[i]) for i in (0, 1, 2)] == [
        (weight, "parameters"),
        (bias, "parameters"),
        (batch * n_in * F32, "activations"),
    ]
    gradients = [events[i]["size"] for i, category in labels.items() if category == "gradients"]
    assert sorted(gradients) == sorted([weight, bias])


def test_a_storage_counts_once_and_is_freed_when_its_last_view_dies() -> None:
    def body() -> None:
        base = torch.empty(10)
        view = base.view(2, 5)
        tail = base[1:]
        del base, view
        marker = torch.empty(1)  # allocated after two of the three views died
        del tail
        del marker

    snapshot = _record(body)
    assert _actions(snapshot) == [
        ("alloc", 10 * F32),
        ("alloc", F32),
        ("free_requested", 10 * F32),
        ("free_completed", 10 * F32),
        ("free_requested", F32),
        ("free_completed", F32),
    ]
    assert snapshot["memprof"]["labels"] == [[0, "temporaries"], [1, "temporaries"]]


def test_storages_from_before_the_run_are_not_recorded() -> None:
    before = torch.zeros(8)

    def body() -> None:
        nonlocal before
        before.add_(1)
        before.view(2, 4).mul_(2)
        before = None

    assert _events(_record(body)) == []


def test_zero_size_storages_are_no_allocation() -> None:
    # neither the CPU allocator nor CUDA's caching allocator makes a block for 0 bytes
    kept = []
    snapshot = _record(lambda: kept.extend([torch.empty(0), torch.empty(0), torch.empty(3)]))
    assert [event["size"] for event in _events(snapshot)] == [3 * F32]
    assert snapshot["memprof"]["labels"] == [[0, "other"]]


def test_meta_tensors_are_recorded() -> None:
    kept = []
    snapshot = _record(lambda: kept.append(torch.empty(4, 4, device="meta") * 2))
    size = 4 * 4 * F32
    assert _actions(snapshot) == [
        ("alloc", size),
        ("alloc", size),
        ("free_requested", size),
        ("free_completed", size),
    ]


def test_an_out_argument_resized_in_place_is_a_new_block() -> None:
    kept = []

    def body() -> None:
        out = torch.empty(0)
        torch.add(torch.ones(3), 1, out=out)
        kept.append(out)

    size = 3 * F32
    assert _actions(_record(body)) == [
        ("alloc", size),  # ones(3); out's empty storage is no block
        ("alloc", size),  # out's storage grows: a new block
        ("free_requested", size),  # ones(3) dies
        ("free_completed", size),
    ]


def test_torch_tensor_literals_are_recorded() -> None:
    kept = []
    snapshot = _record(lambda: kept.append(torch.tensor([1.0, 2.0])))
    assert _actions(snapshot) == [("alloc", 2 * F32)]


def test_a_recorder_is_single_use() -> None:
    recorder = CpuRecorder()
    with pytest.raises(RuntimeError):
        recorder.snapshot()
    with recorder:
        pass
    with pytest.raises(RuntimeError):
        recorder.start()


def test_the_script_runs_as_main(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *ARGV, "--steps", "2", "--device", "cpu"])
    snapshot = _record(lambda: runpy.run_path(str(SCRIPT), run_name="__main__"))
    assert len(snapshot["memprof"]["steps"]) == 2
    assert {category for _, category in snapshot["memprof"]["labels"]} >= {
        "parameters",
        "gradients",
        "optimizer_state",
    }


def test_wrapper_subclass_outputs_count_their_inner_storages() -> None:
    kept = []
    snapshot = _record(lambda: kept.append(TwoTensor(torch.randn(3), torch.randn(3)) * 2))
    size = 3 * F32
    # two inputs, the output's two inner tensors, then the inputs die with their wrapper
    assert (
        _actions(snapshot)
        == [("alloc", size)] * 4
        + [
            ("free_requested", size),
            ("free_completed", size),
        ]
        * 2
    )


def test_hooks_are_gone_after_the_run() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 2).sum()

    x = torch.randn(3)
    # Known limitation: torch.func refuses to run under saved-tensor hooks.
    with CpuRecorder(), pytest.raises(RuntimeError, match="saved tensor hooks"):
        torch.func.grad(f)(x)
    torch.testing.assert_close(torch.func.grad(f)(x), 2 * x.cos())


def test_batches_from_worker_processes_are_recorded_where_the_loop_takes_them() -> None:
    # a worker's batch arrives through shared memory, made by no operator of this process;
    # it is this process's memory all the same, as the batch num_workers=0 makes here is
    data = torch.utils.data.TensorDataset(torch.ones(64, 32))
    batches = {}
    for workers in (0, 2):
        with CpuRecorder() as recorder:
            for _ in torch.utils.data.DataLoader(data, batch_size=16, num_workers=workers):
                pass
        batches[workers] = [e for e in _events(recorder.snapshot())
                            if e["action"] == "alloc" and e["size"] == 16 * 32 * 4]
    assert len(batches[0]) == len(batches[2]) == 4
    here = sys._getframe().f_code.co_name
    assert all(any(f["name"] == here for f in e["frames"]) for e in batches[2])


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_views_make_nothing_and_a_reshape_that_copies_is_recorded(grad_mode) -> None:
    # under inference_mode reshape reaches the recorder whole: its schema says it may alias
    x = torch.randn(4, 16, 8, 8)
    with grad_mode(), StorageTracker() as tracker:
        t = x.permute(0, 2, 1, 3)[1:].transpose(0, 1)  # views alone
        y = x.permute(0, 2, 1, 3).reshape(4, 8, -1)  # a copy: not contiguous
    assert t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert [(e[0], e[2]) for e in tracker.events] == [("alloc", 4 * 16 * 8 * 8 * 4)]
    assert tracker.events[0][1] == y.untyped_storage().data_ptr()


def test_stacks_inside_modules_are_those_a_full_walk_gives(monkeypatch) -> None:
    # each running module's call frame ends the walk of captures inside it: same stacks
    def record() -> list:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))
        with CpuRecorder() as recorder:
            for _ in range(2):
                model(torch.randn(3, 4)).sum().backward()
        return [e[-1] for e in recorder.snapshot()["device_traces"][0]]

    holds = Counter()  # not the frames: holding one would keep its tensors alive
    hold = StackCapture.hold
    monkeypatch.setattr(StackCapture, "hold", lambda self, f: holds.update(["held"])
                        or hold(self, f))
    stacks = []
    for walk_all in (False, True):  # one call site for both
        if walk_all:
            monkeypatch.setattr(StackCapture, "hold", lambda self, frame: None)
        stacks.append(record())
    assert holds["held"] == 2 * 5  # every module call
    frames = {frame for stack in stacks[0] for frame in stack}
    assert any(name == "forward" and file.endswith("linear.py") for name, file, _ in frames)
    assert stacks[0] == stacks[1]


@pytest.mark.parametrize("mmap", [False, True])
def test_state_loaded_from_a_checkpoint_is_recorded(tmp_path: Path, mmap: bool) -> None:
    # resuming: torch.load makes storages no operator made, and its tensors point at them
    # with set_; load_state_dict(assign=True) keeps them as the parameters and Adam as its
    # moments, so without them a resumed run had no parameters and no optimizer state
    model = nn.Linear(64, 32)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
               tmp_path / "ckpt.pt")
    kept = []

    def body() -> None:
        checkpoint = torch.load(tmp_path / "ckpt.pt", mmap=mmap)
        resumed = nn.Linear(64, 32, device="meta")
        resumed.load_state_dict(checkpoint["model"], assign=True)
        adam = torch.optim.Adam(resumed.parameters())
        adam.load_state_dict(checkpoint["optimizer"])
        resumed(torch.randn(4, 64)).sum().backward()
        adam.step()
        kept.append((resumed, adam))

    snapshot = _record(body)
    events = _events(snapshot)
    by_category = Counter()
    for i, category in snapshot["memprof"]["labels"]:
        by_category[category] += events[i]["size"]
    params = (64 * 32 + 32) * F32
    assert by_category["parameters"] == params
    assert by_category["gradients"] == params
    assert by_category["optimizer_state"] == 2 * params + 2 * F32  # moments, step counts


def test_tensors_made_on_threads_the_script_starts_are_recorded() -> None:
    # PyTorch gives a new thread none of the starting thread's modes (transformers'
    # from_pretrained loads its weights on a thread pool): memprof's are handed down
    kept = []
    late = ThreadPoolExecutor(1)  # its thread starts during the recording, outlives it

    def body() -> None:
        with ThreadPoolExecutor(2) as pool:
            kept.extend(pool.map(torch.empty, [1000, 2000]))
        thread = threading.Thread(target=lambda: kept.append(torch.empty(3000)))
        thread.start()
        thread.join()
        kept.append(late.submit(torch.empty, 4000).result())

    snapshot = _record(body)
    allocs = sorted((e for e in _events(snapshot) if e["action"] == "alloc"),
                    key=lambda e: e["size"])
    assert [e["size"] for e in allocs] == [n * F32 for n in (1000, 2000, 3000, 4000)]
    for event in allocs:  # where the thread was started: body's line, not memprof's frames
        names = [(Path(f["filename"]).name, f["name"]) for f in event["frames"]]
        assert (Path(__file__).name, "body") in names, names
        assert not [f for f in event["frames"] if "memprof/collect" in f["filename"]]
        assert names[-1] != ("threading.py", "_bootstrap")
    assert late.submit(torch.ones, 5).result().sum() == 5  # the stopped recorder steps aside
    late.shutdown()
    assert threading.Thread.start is _THREAD_START  # and the patch is gone


def test_a_modules_tensors_after_to_or_half_are_parameters_though_no_forward_sees_them():
    """``model.half()`` (or ``.cuda()``, ``.to()``) gives a module new tensors; FSDP1, wrapping
    a model the script put on the card, flattens them and frees them before any forward.
    Still the model's parameters and buffers: 256 x 256 + 256 fp16 weights, 256 fp16
    running means, not temporaries."""
    from memprof.analysis.explain import explain
    from memprof.collect.recording import predict_cuda_layout
    from memprof.trace.model import AllocatorSettings
    from memprof.trace.normalize import normalize

    model = nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256, affine=False))
    with CpuRecorder() as recorder:  # what the recording sees: the new fp16 tensors
        model.half()
        for t in (*model.parameters(), *model.buffers()):
            t.data = torch.empty(0, dtype=t.dtype)  # gone, as once flattened
    snapshot, _ = predict_cuda_layout(recorder.snapshot(), AllocatorSettings())
    timeline = explain(normalize(snapshot)).devices[0].category_timeline

    def block(n: int) -> int:
        return -(-n // 512) * 512

    assert int(timeline["parameters"].max()) == block(256 * 256 * 2) + block(256 * 2)
    assert int(timeline["buffers"].max()) == 2 * block(256 * 2)  # running mean, variance
    assert int(timeline["temporaries"].max()) == 0


def test_a_deep_copy_of_a_model_holds_parameters_though_its_forward_never_runs():
    """An exponential moving average of the weights (timm's ``ModelEmaV3``: a ``deepcopy``
    of the model, updated in place, never run in training): 2 x (256 x 256 + 256) fp32
    parameters, the model's and its copy's, not temporaries."""
    import copy

    from memprof.analysis.explain import explain
    from memprof.collect.recording import predict_cuda_layout
    from memprof.trace.model import AllocatorSettings
    from memprof.trace.normalize import normalize

    model = nn.Linear(256, 256)
    with CpuRecorder() as recorder:
        ema = copy.deepcopy(model)
        model(torch.ones(4, 256)).sum().backward()
        with torch.no_grad():
            for averaged, p in zip(ema.parameters(), model.parameters(), strict=True):
                averaged.lerp_(p, 0.001)
    snapshot, _ = predict_cuda_layout(recorder.snapshot(), AllocatorSettings())
    timeline = explain(normalize(snapshot)).devices[0].category_timeline
    assert int(timeline["parameters"].max()) == 256 * 256 * 4 + 1024  # the copy's
    assert int(timeline["temporaries"].max()) == 4 * 256 * 4 + 512  # the output, the loss


def test_a_deepspeed_zero_3_partition_of_a_parameter_is_the_parameters():
    """ZeRO-3 keeps each parameter's partition as ``param.ds_tensor`` (views of one flat
    buffer), the parameter itself emptied, and the gradients' partitions in a flat buffer
    of its optimizer's: parameters and gradients, not other."""
    from memprof.analysis.explain import explain
    from memprof.collect.recording import predict_cuda_layout
    from memprof.trace.model import AllocatorSettings
    from memprof.trace.normalize import normalize

    class ZeroOptimizer:  # DeepSpeed's ZeRO-3 optimizer, as the engine holds it
        grad_partitions_flat_buffer: torch.Tensor

    model = nn.Linear(256, 256, bias=False)
    with CpuRecorder() as recorder:
        flat = torch.empty(256 * 256 // 2)  # this rank's half, as defragment() makes it
        model.weight.ds_tensor = flat.narrow(0, 0, flat.numel())
        # the gradients' partitions: the optimizer steps on copies of them
        model.optimizer = ZeroOptimizer()
        model.optimizer.grad_partitions_flat_buffer = torch.zeros(256 * 256 // 2)
        model(torch.ones(4, 256))
    snapshot, _ = predict_cuda_layout(recorder.snapshot(), AllocatorSettings())
    timeline = explain(normalize(snapshot)).devices[0].category_timeline
    assert int(timeline["parameters"].max()) == 256 * 256 // 2 * 4
    assert int(timeline["gradients"].max()) == 256 * 256 // 2 * 4
    assert int(timeline["other"].max()) == 0
