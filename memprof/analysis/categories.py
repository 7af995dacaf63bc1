"""Infer what an allocation was (parameter, gradient, ...) from its stacks and lifetime.

Used for snapshots recorded elsewhere, where memprof never saw the objects; the
report marks these categories as inferred. ``memprof run`` labels exactly instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from memprof.trace.model import (
    CATEGORIES,
    COMMUNICATION,
    COMMUNICATION_OVERRIDES,
    GATHERED_OVERRIDES,
    Frames,
)

__all__ = ["CATEGORIES", "Phase", "communication_call", "communication_overrides",
           "infer_category", "phase_of"]

# the code of torch.distributed that allocates a collective's buffers: FSDP's gathered
# parameters and reduce-scatter inputs, c10d's flattened lists, DTensor's redistributions,
# DDP's buckets (made by its reducer, called from its constructor)
_COMMUNICATION_FILES = ("/torch/distributed/fsdp/", "/torch/distributed/_composable/fsdp/",
                        "/torch/distributed/distributed_c10d.py",
                        "/torch/distributed/_functional_collectives",
                        "/torch/distributed/tensor/_redistribute.py",
                        "/torch/distributed/tensor/_collective_utils.py",
                        "/torch/nn/parallel/distributed.py")
# the flat copy DDP broadcasts the module state in, a pipeline stage's receive buffers
# (each microbatch's activations from the stage before, gradients from the one after)
_PIPELINE_STAGE = "/torch/distributed/pipelining/stage.py"
_COMMUNICATION_CALLS = {("/torch/distributed/utils.py", "_sync_params_and_buffers")} | {
    (_PIPELINE_STAGE, name) for name in (
        "create_recv_tensor", "_create_grad_recv_info", "_setup_forward_recv_info")} | {
    # DeepSpeed ZeRO-1/2's gradient-reduction buckets (its overlap_comm double buffer), as
    # DDP's: the one the gradients are views of stays gradients
    ("/deepspeed/runtime/zero/stage_1_and_2.py", "setup_buckets")}
# and not DDP's forward: _DDPSink's clones of the model's outputs (find_unused_parameters,
# a static graph) are the model's tensors, not a collective's
_MODEL_CALLS = {("/torch/nn/parallel/distributed.py", "forward")}
# where FSDP2 gathers: its all-gather and copy-out (``_fsdp_collectives.py``; its
# reduce-scatter's output is the sharded gradient, a gradient still), and the unsharded
# parameters' storage (``_fsdp_param.py``), registered on the module while gathered; and
# FSDP1's unsharded flat parameter (``_alloc_storage``), whose views the module holds
_GATHERING_FILES = ("/fsdp/_fully_shard/_fsdp_collectives.py",)
_GATHERING_CALLS = {("/fsdp/_fully_shard/_fsdp_param.py", name) for name in (
    "alloc_storage", "init_all_gather_outputs", "init_unsharded_param",
    "alloc_all_gather_outputs")} | {("/torch/distributed/utils.py", "_alloc_storage")}
# decorators between a function and the op it calls (torch._disable_dynamo, no_grad),
# TypedStorage's methods over the untyped storage's (FSDP1 resizes through them), a
# comprehension's frame of its own (before Python 3.12), which its function's stands for,
# and the pipeline's tensor from metadata, which its caller's does
_WRAPPER_FILES = ("/torch/_dynamo/eval_frame.py", "/torch/_compile.py",
                  "/torch/utils/_contextlib.py", "/torch/storage.py")
_WRAPPER_CALLS = {("/torch/distributed/pipelining/_utils.py", "_make_tensor_from_meta")}
_COMPREHENSIONS = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}


class Phase(Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    UNKNOWN = "unknown"


_PARAMETER_CALLS = {"_apply", "to", "cuda", "convert", "reset_parameters", "_load_from_state_dict",
                    "load_state_dict", "from_pretrained", "_load_state_dict_into_meta_model",
                    "set_module_tensor_to_device", "load_model_dict_into_meta"}


def phase_of(frames: Frames, has_python_stacks: bool) -> Phase:
    """The training phase an event happened in, judged from its stack."""
    python = [f for f in frames if f.is_python]
    if not python:
        # the autograd engine runs backward on its own thread, with no Python stack
        return Phase.BACKWARD if has_python_stacks and frames else Phase.UNKNOWN
    for f in python:
        path = f.filename.replace("\\", "/")
        if "/torch/optim/" in path or "/bitsandbytes/optim/" in path or f.name == "zero_grad":
            return Phase.OPTIMIZER
        if f.name in ("backward", "_engine_run_backward", "run_backward"):
            return Phase.BACKWARD
    return Phase.FORWARD


def communication_call(filename: str, name: str) -> tuple[str, ...] | None:
    """The categories a block gives up to ``communication`` when this Python frame, the
    innermost of its stack, allocated it: none where it is not torch.distributed making a
    collective's buffer; None for a decorator's frame (ask its caller)."""
    path = filename.replace("\\", "/")
    if path.endswith(_WRAPPER_FILES) or name in _COMPREHENSIONS or any(
            path.endswith(f) and name == n for f, n in _WRAPPER_CALLS):
        return None
    if any(path.endswith(f) and name == n for f, n in _MODEL_CALLS):
        return ()
    if path.endswith(_GATHERING_FILES) or any(
            path.endswith(f) and name == n for f, n in _GATHERING_CALLS):
        return GATHERED_OVERRIDES
    if any(f in path for f in _COMMUNICATION_FILES) or any(
            path.endswith(f) and name == n for f, n in _COMMUNICATION_CALLS):
        return COMMUNICATION_OVERRIDES
    return ()


def communication_overrides(calls: Iterable[tuple[str, str]]) -> tuple[str, ...]:
    """What a block gives up to ``communication`` (``communication_call``), from its stack:
    its Python frames' ``(filename, name)``, innermost first."""
    for filename, name in calls:
        verdict = communication_call(filename, name)
        if verdict is not None:
            return verdict
    return ()


def is_parameter_stack(frames: Frames) -> bool:
    """Stacks that create or move model weights (module construction, .to(), loading)."""
    for f in frames:
        path = f.filename.replace("\\", "/")
        if f.name in _PARAMETER_CALLS or path.endswith("nn/parameter.py"):
            return True
        if f.name == "__init__" and "/torch/nn/modules/" in path:
            return True
    return False


def infer_category(alloc_frames: Frames, alloc_phase: Phase, free_phase: Phase | None) -> str:
    """Category of one allocation; ``free_phase`` is None when it outlived the recording."""
    category = _by_phase(alloc_frames, alloc_phase, free_phase)
    if category in communication_overrides(
            (f.filename, f.name) for f in alloc_frames if f.is_python):
        return COMMUNICATION
    return category


def _by_phase(alloc_frames: Frames, alloc_phase: Phase, free_phase: Phase | None) -> str:
    if is_parameter_stack(alloc_frames):
        return "parameters"
    if alloc_phase is Phase.OPTIMIZER:
        return "temporaries" if free_phase is Phase.OPTIMIZER else "optimizer_state"
    if alloc_phase is Phase.BACKWARD:
        return "temporaries" if free_phase is Phase.BACKWARD else "gradients"
    if alloc_phase is Phase.FORWARD:
        if free_phase is Phase.BACKWARD:
            return "activations"
        if free_phase is not None:
            return "temporaries"
    return "other"
