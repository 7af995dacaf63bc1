"""What a run's model and optimizers were, for savings models (``memprof suggest``).

Collected at the end of a recording from the modules and optimizers the label hooks saw:
parameter counts by dtype and trainability, the tensors small enough that bitsandbytes
keeps 32-bit state for them, the optimizers with the bytes of their state, the repeated
blocks (the unit of activation checkpointing) and whether CUDA autocast was on in forward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from memprof.collect.hooks.parallelism import is_wrapper, model_class
from memprof.collect.tensors import tensors_in

_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
SMALL_TENSOR = 4096  # bitsandbytes keeps 32-bit optimizer state below this many elements


def model_facts(modules: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer],
                autocast: str | None,
                blocks: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    """The ``model`` entry of a recording (JSON-ready); ``blocks``: what each block class
    saved for backward and how it was called (``BlockSaves.facts``), by module and name."""
    modules = list(modules)
    params = {id(p): p for m in modules for p in m.parameters(recurse=False)}
    held = set(params)
    for optimizer in optimizers:
        own = [p for group in optimizer.param_groups for p in group["params"]]
        if held and own and not any(id(p) in held for p in own):
            continue  # copies of the weights it steps (DeepSpeed's fp32 partitions)
        params.update((id(p), p) for p in own)
    dtypes: Counter[str] = Counter()
    for p in params.values():
        dtypes[str(p.dtype).removeprefix("torch.")] += _elements(p)
    return {
        "parameters": sum(_weights(p) for p in params.values()),
        "parameter_bytes": sum(_elements(p) * p.element_size() for p in params.values()),
        "trainable": sum(_elements(p) for p in params.values() if p.requires_grad),
        "dtypes": dict(dtypes),
        "small_tensor_elements": sum(_elements(p) for p in params.values()
                                     if _elements(p) < SMALL_TENSOR),
        # what this rank holds of each (a DTensor's shard): its optimizer state's sizes
        "trainable_numels": sorted(_held(p).numel() for p in params.values()
                                   if p.requires_grad and _held(p).numel()),
        "optimizers": [_optimizer(o) for o in optimizers],
        "repeated_blocks": _repeated_blocks(modules, blocks),
        "autocast": autocast,
        # a Hugging Face model from_pretrained loaded (from a config: an empty name)
        "pretrained": any(bool(getattr(getattr(m, "config", None), "_name_or_path", ""))
                          for m in modules),
    }


def quantisation_state(p: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of a quantised weight's state (bitsandbytes' ``Params4bit.quant_state``:
    its absmax scales, code, and their own nested state), none for another weight."""
    state = p.__dict__.get("quant_state")
    found: list[torch.Tensor] = []
    for value in vars(state).values() if hasattr(state, "__dict__") else ():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif type(value) is type(state):  # the double quantisation's nested state
            found += [v for v in vars(value).values() if isinstance(v, torch.Tensor)]
    return found


def _held(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local shard, else ``t``."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _elements(p: torch.Tensor) -> int:
    """The elements of parameter ``p``, whole: a DeepSpeed ZeRO-3 parameter's
    (``ds_numel``; its own tensor is empty between gathers), else its own."""
    whole = p.__dict__.get("ds_numel")
    return whole if isinstance(whole, int) else p.numel()


def _weights(p: torch.Tensor) -> int:
    """The weights ``p`` holds: its elements, or a packed 4-bit weight's own count (two to a
    byte, its ``quant_state.shape``)."""
    shape = getattr(p.__dict__.get("quant_state"), "shape", None)
    return int(torch.Size(shape).numel()) if isinstance(shape, (tuple, torch.Size)) \
        else _elements(p)


def _optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state = [_held(t) for s in optimizer.state.values() for t in tensors_in(tuple(s.values()))]
    defaults = optimizer.defaults
    return {
        "class": type(optimizer).__name__,
        "state_bytes": sum(t.numel() * t.element_size() for t in state if t.dim() > 0),
        "momentum": bool(defaults.get("momentum")),
        "fused": bool(defaults.get("fused")),
        "foreach": defaults.get("foreach"),
    }


def _repeated_blocks(modules: list[torch.nn.Module],
                     measured: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """Module classes with parameters that occur more than once (transformer blocks, ...),
    the largest first (by all their instances' parameters); containers, torch.distributed's
    wrappers and leaf layers are left out."""
    by_class: dict[type, list[torch.nn.Module]] = {}
    for m in modules:
        if isinstance(m, _CONTAINERS) or is_wrapper(m) or not any(True for _ in m.children()):
            continue
        by_class.setdefault(model_class(m), []).append(m)
    blocks = []
    for cls, instances in by_class.items():
        size = sum(p.numel() for m in instances for p in m.parameters())
        if len(instances) > 1 and size:
            blocks.append({"class": cls.__name__, "module": cls.__module__,
                           "count": len(instances), "parameters_each": size // len(instances),
                           **measured.get((cls.__module__, cls.__name__), {})})
    return sorted(blocks, key=lambda b: (-b["count"] * b["parameters_each"], b["class"]))
