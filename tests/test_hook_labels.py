"""The CUDA path's labeller: role hooks that note storage addresses, matched to a trace.

On a GPU the allocator's history is the trace; here the CPU recorder's storage tracker
makes one with real data pointers. Each sample runs twice, once under the exact CPU
recorder (a dispatch mode that sees every storage) and once under the tracker for the
trace and the hooks-only labeller for the categories and modules; every alloc must get
the same category in both, and the same module but in backward (see below).
"""

from __future__ import annotations

import socket
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_run_cli import LEAK, MLP, flags, load_sample

from memprof.collect.cpu.recorder import CpuRecorder
from memprof.collect.cpu.storages import StorageTracker
from memprof.collect.hooks.labeller import HookLabeller
from memprof.collect.hooks.trace_labels import (
    label_trace,
    sequence_clock,
    sequence_times,
    step_ends,
)
from memprof.trace.events import as_snapshot_events


def _alloc(addr: int, size: int, t: int) -> dict[str, Any]:
    return {"action": "alloc", "addr": addr, "size": size, "time_us": t}


def _free(addr: int, size: int, t: int) -> list[dict[str, Any]]:
    return [{"action": a, "addr": addr, "size": size, "time_us": t}
            for a in ("free_requested", "free_completed")]


# --- the matching, on hand-made traces ------------------------------------------------

def test_a_reused_address_labels_the_alloc_live_when_seen() -> None:
    trace = [_alloc(0x1000, 512, 10), *_free(0x1000, 512, 20), _alloc(0x1000, 512, 30)]
    sightings = [(35, 0x1000, 400, "activations")]
    assert label_trace(trace, sightings) == [[0, "temporaries"], [3, "activations"]]
    assert label_trace(trace, [(15, 0x1000, 400, "gradients")]) == [
        [0, "gradients"], [3, "other"]]


def test_the_latest_alloc_wins_a_tie_and_a_freed_one_yields_to_the_next() -> None:
    # freed and reallocated within one microsecond, seen in it: the new block
    trace = [_alloc(0x1000, 512, 10), *_free(0x1000, 512, 30), _alloc(0x1000, 512, 30)]
    assert label_trace(trace, [(30, 0x1000, 512, "activations")])[1] == [
        3, "activations"]
    # the hook's clock reads 29 for a block the allocator stamped 30: the live one is next
    trace = [_alloc(0x1000, 512, 10), *_free(0x1000, 512, 20), _alloc(0x1000, 512, 30)]
    assert label_trace(trace, [(29, 0x1000, 512, "parameters")])[1] == [
        3, "parameters"]


FSDP = "/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py"


def _made_by(event: dict[str, Any], *calls: tuple[str, str]) -> dict[str, Any]:
    """``event`` with a stack of C++ frames then ``calls`` (filename, name), innermost
    first, as PyTorch's history records it."""
    return {**event, "frames": [{"filename": "??", "line": 0, "name": "c10::alloc"}] + [
        {"filename": f, "line": 7, "name": n} for f, n in calls]}


def test_what_a_collective_made_is_a_communication_buffer_unless_it_is_model_state() -> None:
    user = ("/u/train.py", "main")
    gathered = _made_by(_alloc(0x1000, 512, 10), (FSDP, "foreach_all_gather"), user)
    behind_a_decorator = _made_by(
        _alloc(0x2000, 512, 11), ("/x/torch/_dynamo/eval_frame.py", "_fn"),
        ("/x/torch/_compile.py", "inner"), ("/x/torch/nn/parallel/distributed.py", "_pre_forward"))
    sharded_gradient = _made_by(_alloc(0x3000, 512, 12), (FSDP, "foreach_reduce"), user)
    # a forward run from inside DDP's forward: its innermost frame is the model's
    forward = _made_by(_alloc(0x4000, 512, 13), ("/u/model.py", "forward"),
                       ("/x/torch/nn/parallel/distributed.py", "forward"))
    # DDP's _DDPSink cloning the model's outputs (find_unused_parameters): in DDP's file,
    # but the model's tensors
    sink = _made_by(_alloc(0x5000, 512, 16), ("/x/torch/nn/parallel/distributed.py",
                                               "forward"), ("/u/train.py", "main"))
    trace = [gathered, *_free(0x1000, 512, 14), behind_a_decorator, sharded_gradient, forward,
             *_free(0x4000, 512, 15), sink, *_free(0x5000, 512, 17)]
    # the gathered parameters saved for backward (as a Linear's weight is) stay gathered
    labels = label_trace(trace, [(10, 0x1000, 512, "activations"),
                                 (12, 0x3000, 512, "gradients")])
    assert labels == [[0, "communication"], [3, "communication"], [4, "gradients"],
                      [5, "temporaries"], [8, "temporaries"]]


def test_deepspeed_and_pipeline_buffers_are_communication_unless_model_state() -> None:
    """DeepSpeed ZeRO-1/2's double bucket (``setup_buckets``): the one the gradients are
    views of stays gradients, the other is a communication buffer, as DDP's; a pipeline
    stage's receive buffer, made through ``_make_tensor_from_meta``, is one too."""
    zero = ("/x/deepspeed/runtime/zero/stage_1_and_2.py", "setup_buckets")
    first = _made_by(_alloc(0x1000, 512, 10), zero, ("/u/train.py", "main"))
    second = _made_by(_alloc(0x2000, 512, 11), zero, ("/u/train.py", "main"))
    received = _made_by(_alloc(0x3000, 512, 12),
                        ("/x/torch/distributed/pipelining/_utils.py", "_make_tensor_from_meta"),
                        ("/x/torch/distributed/pipelining/stage.py", "create_recv_tensor"))
    made = _made_by(_alloc(0x4000, 512, 13),  # a shape inference's input: not received
                    ("/x/torch/distributed/pipelining/_utils.py", "_make_tensor_from_meta"),
                    ("/x/torch/distributed/pipelining/_utils.py", "to_tensor"))
    labels = label_trace([first, second, received, made], [(10, 0x1000, 512, "gradients")])
    assert labels == [[0, "gradients"], [1, "communication"], [2, "communication"],
                      [3, "other"]]


def test_a_block_too_small_for_the_storage_is_not_its_block() -> None:
    trace = [_alloc(0x1000, 512, 10)]
    assert label_trace(trace, [(11, 0x1000, 513, "parameters")]) == [[0, "other"]]


def test_the_first_category_in_order_wins_and_other_addresses_are_ignored() -> None:
    trace = [_alloc(0x1000, 1024, 10), _alloc(0x2000, 512, 11), *_free(0x2000, 512, 12)]
    sightings = [(11, 0x1000, 1024, "activations"),
                 (12, 0x1000, 1024, "parameters"),
                 (12, 0x9000, 512, "gradients")]
    assert label_trace(trace, sightings) == [[0, "parameters"], [1, "temporaries"]]


def test_unseen_blocks_that_live_on_are_blas_workspaces_by_size_and_call() -> None:
    cublas, lt = 32 << 20, 1 << 20
    linear = [{"filename": "linear.py", "line": 134, "name": "forward"}]
    batch = [{"filename": "train.py", "line": 9, "name": "main"}]
    trace = [_alloc(0, 512, 1), {**_alloc(1 << 30, cublas, 2), "frames": linear},
             {**_alloc(2 << 30, lt, 3), "frames": linear},  # the same call's Lt workspace
             {**_alloc(3 << 30, lt, 4), "frames": batch},  # a batch the script keeps
             {**_alloc(4 << 30, cublas, 5), "frames": []},  # the backward thread's
             {**_alloc(5 << 30, lt, 6), "frames": []}, *_free(5 << 30, lt, 7)]
    seen = [(1, 0, 512, "parameters")]
    assert label_trace(trace, seen, workspaces=(cublas, lt)) == [
        [0, "parameters"], [1, "workspace"], [2, "workspace"], [3, "other"],
        [4, "workspace"], [5, "temporaries"]]
    # without the sizes (a CPU recording), nothing is a workspace
    assert {c for _, c in label_trace(trace, seen)} == {"parameters", "other", "temporaries"}


def test_a_forward_marks_a_modules_parameters_again_only_when_they_moved() -> None:
    model = torch.nn.Linear(4, 4)
    with HookLabeller() as labeller:
        def parameters_seen() -> list[int]:
            return [addr for _, addr, _, category in labeller.sightings if category == "parameters"]
        model(torch.ones(2, 4))
        first = parameters_seen()
        model(torch.ones(2, 4))
        assert parameters_seen() == first  # the same storages: nothing new to see
        model.weight.data = torch.zeros(4, 4)  # a new storage, as model.half() makes
        model(torch.ones(2, 4))
    assert len(first) == 2 and model.bias.data_ptr() in first  # the weight and the bias
    assert parameters_seen()[len(first):] == [model.weight.data_ptr()]


def test_a_blas_workspace_belongs_to_no_module() -> None:
    # made inside the first Linear's call, as on a card, but the library's, not the
    # module's: the virtual GPU attributes it to none either
    cublas = 32 << 20
    model = torch.nn.Linear(4, 4)
    inside: list[int] = []
    model.register_forward_pre_hook(lambda *_: inside.append(labeller._clock()))
    with HookLabeller() as labeller:
        model(torch.ones(2, 4))
    trace = [{**_alloc(1 << 30, cublas, inside[0]), "frames": []},
             {**_alloc(2 << 30, 4096, inside[0]), "frames": []}]
    meta = labeller.labels(trace, workspaces=(cublas, 0))
    assert meta["labels"] == [[0, "workspace"], [1, "other"]]
    assert [i for i, _ in meta["modules"]] == [1]


def test_a_sequence_clock_and_step_ends() -> None:
    trace = [_alloc(0x1000, 8, 0), *_free(0x1000, 8, 0), _alloc(0x1000, 8, 0)]
    times = sequence_times(trace)
    position = sequence_clock(trace[:1])  # after the first event
    assert (times, position()) == ([1, 3, 5, 7], 2)
    assert label_trace(trace, [(2, 0x1000, 8, "gradients"),
                               (8, 0x1000, 8, "optimizer_state")], times) == [
        [0, "gradients"], [3, "optimizer_state"]]
    assert step_ends(times, [6, 8]) == [3, 4]
    assert step_ends([5, 7, 7, 9], [7, 8, 100]) == [3, 3, 4]


# --- the samples: hooks only vs the exact CPU recorder ----------------------------------

def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


SAMPLES: dict[str, list[str]] = {
    "mlp_adam": flags(MLP),
    "leak": flags({**LEAK, "steps": 4}),
    "cnn": ["--steps", "3"],
    "transformer_lm": ["--steps", "3"],
    "named_blocks": [],
    "ddp_gloo": ["--steps", "3"],
}


def _exact(main: Callable[[list[str]], object], argv: list[str]
           ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    with CpuRecorder() as recorder:
        main(argv)
    snapshot = recorder.snapshot()
    return as_snapshot_events(snapshot["device_traces"][0]), snapshot["memprof"]


def _hooks_only(main: Callable[[list[str]], object], argv: list[str]
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    tracker = StorageTracker()  # only for the trace: the labeller never asks it anything
    with HookLabeller(clock=sequence_clock(tracker.events)) as labeller, tracker:
        main(argv)
    trace = as_snapshot_events(tracker.take_trace())
    return trace, labeller.labels(trace, sequence_times(trace))


def at_peak(trace: list[dict[str, Any]], labels: list[list[Any]]) -> Counter[str]:
    """Live bytes per category when the most bytes were live."""
    category = dict(labels)
    live: dict[int, tuple[str, int]] = {}
    now: Counter[str] = Counter()
    best: Counter[str] = Counter()
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = (category[i], e["size"])
            now[category[i]] += e["size"]
        elif e["action"] == "free_completed":
            name, size = live.pop(e["addr"])
            now[name] -= size
        if now.total() > best.total():
            best = now.copy()
    return +best


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_hooks_only_labels_equal_the_exact_recorder(name: str, monkeypatch) -> None:
    if name == "ddp_gloo":  # a world of one on a port no other test uses; set here, so
        # that they are gone again after the test (the sample sets what is missing, and the
        # suite's other processes would be ranks of a world of one)
        for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                           ("MASTER_PORT", _free_port())):
            monkeypatch.setenv(var, value)
    main = load_sample(name).main
    argv = [*SAMPLES[name], "--device", "cpu"]
    torch.manual_seed(0)
    exact_trace, exact_meta = _exact(main, argv)
    torch.manual_seed(0)
    trace, meta = _hooks_only(main, argv)
    exact, hooked = exact_meta["labels"], meta["labels"]

    def sized(t: list[dict[str, Any]], labels: list[list[Any]]) -> list[tuple[int, str]]:
        return [(t[i]["size"], c) for i, c in labels]

    assert sized(trace, hooked) == sized(exact_trace, exact)
    assert meta["steps"] == exact_meta["steps"]
    peak = at_peak(trace, hooked)
    assert peak["parameters"] > 0 and peak["activations"] > 0
    if name != "ddp_gloo":  # DDP's gloo threads free buffers at times that vary by run
        assert [e["action"] for e in trace] == [e["action"] for e in exact_trace]
        assert peak == at_peak(exact_trace, exact)
    assert meta["model_files"] == exact_meta["model_files"]
    modules, exact_modules = by_alloc(trace, meta), by_alloc(exact_trace, exact_meta)
    assert any(path for _, path, _ in modules)
    # forward and the rest: the same module; in backward, a node that saved no tensor marks
    # nothing, so what it allocates goes to the module of the backward before it
    before = None
    for (size, path, backward), (exact_size, exact_path, _) in zip(
            modules, exact_modules, strict=True):
        assert size == exact_size
        assert path == exact_path or (backward and path == before)
        before = exact_path if backward else before


def by_alloc(trace: list[dict[str, Any]], meta: dict[str, Any]
             ) -> list[tuple[int, str | None, bool]]:
    """Each alloc's size, module path and whether autograd's backward made it."""
    paths = dict(meta["modules"])
    return [(e["size"], paths.get(i),
             bool(e["frames"]) and e["frames"][0]["name"] == "_engine_run_backward")
            for i, e in enumerate(trace) if e["action"] == "alloc"]


def test_a_compiled_model_compiles_whole_under_the_labeller() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # counted since the process started
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters())
    compiled = torch.compile(model, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning the script would see
        with HookLabeller() as labeller:
            for _ in range(2):
                compiled(torch.randn(5, 8)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    # PyTorch warns that global module hooks (memprof's) fire again for the compiled
    # wrapper: the script's output must not change
    assert not [w for w in caught if "global hooks" in str(w.message)]
    seen = Counter(category for *_, category in labeller.sightings)
    # 4 parameters (seen by the optimizer), their gradients each step, Adam's 3 tensors each
    assert seen == {"parameters": 4, "gradients": 8, "optimizer_state": 12,
                    "activations": seen["activations"]}
    assert seen["activations"] > 0


@pytest.mark.parametrize("backward", [False, True])
def test_an_evaluation_with_grad_is_tagged_as_by_the_exact_recorder(backward: bool) -> None:
    def evaluate(argv: list[str]) -> None:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 1)).eval()
        loss = model(torch.randn(32, 64)).sum()
        if backward:  # a frozen module that training backpropagates through
            loss.backward()

    exact_trace, exact_meta = _exact(evaluate, [])
    trace, meta = _hooks_only(evaluate, [])
    tags = [(trace[i]["size"], tag) for i, tag in meta["tags"]]
    # (autocast's precision is told from operators, which the hooks alone do not see)
    assert tags == [(exact_trace[i]["size"], tag) for i, tag in exact_meta["tags"]
                    if not tag.startswith("autocast_half")]
    # the input and the ReLU's output; nothing once a backward read them
    assert tags == ([] if backward else [(32 * 64 * 4, "eval_activations")] * 2)
