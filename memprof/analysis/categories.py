"""Infer what an allocation was (parameter, gradient, ...) from its stacks and lifetime.

Used for snapshots recorded elsewhere, where memprof never saw the objects; the
report marks these categories as inferred. ``memprof run`` labels exactly instead.
"""

from __future__ import annotations

from enum import Enum

from memprof.trace.model import CATEGORIES, Frames

__all__ = ["CATEGORIES", "Phase", "infer_category", "phase_of"]



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
