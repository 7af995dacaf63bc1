"""Remedies memprof applies to an unmodified script, for ``memprof suggest --verify``.

``MEMPROF_APPLY`` (JSON) names them: ``{"autocast": "bfloat16"}`` runs each outermost
module call (the forward pass) under CUDA autocast (with ``"autocast_device": "cpu"``, the
CPU's: a CPU recording's tensors stand in for CUDA's); ``{"checkpoint": "Block"}`` (or a
list of class names) runs every module of class ``Block`` under activation checkpointing
(from its class's first forward on: the first call of the first instance runs as written,
and so do the calls the script checkpoints itself).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memprof.collect.hooks.checkpointed import is_checkpoint, module_caller

ENV = "MEMPROF_APPLY"


def requested() -> dict[str, Any]:
    """The remedies ``MEMPROF_APPLY`` asks for (empty when unset)."""
    text = os.environ.get(ENV, "")
    try:
        asked = json.loads(text) if text else {}
    except ValueError:
        return {}
    return asked if isinstance(asked, dict) else {}


@contextlib.contextmanager
def applied(asked: dict[str, Any]) -> Iterator[None]:
    """Apply ``asked`` (see the module doc) for the duration of the block."""
    with contextlib.ExitStack() as stack:
        dtype = asked.get("autocast")
        device = asked.get("autocast_device", "cuda")
        if (isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)
                and device in ("cuda", "cpu")):
            stack.enter_context(_autocast_forward(getattr(torch, dtype), device))
        blocks = asked.get("checkpoint")
        blocks = [blocks] if isinstance(blocks, str) else blocks
        if isinstance(blocks, list) and all(isinstance(b, str) for b in blocks):
            stack.enter_context(_checkpointing(frozenset(blocks)))
        yield


@contextlib.contextmanager
def _autocast_forward(dtype: torch.dtype, device: str) -> Iterator[None]:
    """``device``'s autocast around each outermost module call (the forward pass), as the
    recipe has it: not around backward or the optimizer step."""
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    open_: list[tuple[torch.nn.Module, torch.autocast]] = []

    def enter(module: torch.nn.Module, args: object) -> None:
        if not open_ and torch.is_grad_enabled():
            context = torch.autocast(device, dtype=dtype)
            context.__enter__()
            open_.append((module, context))

    def leave(module: torch.nn.Module, args: object, output: object) -> None:
        if open_ and open_[-1][0] is module:
            open_.pop()[1].__exit__(None, None, None)

    # always_call: a forward that raises (checkpointing stops its recomputation early by
    # raising) still closes its autocast
    handles = [register_module_forward_pre_hook(enter),
               register_module_forward_hook(leave, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _checkpointing(class_names: frozenset[str]) -> Iterator[None]:
    patched: dict[type, Callable[..., Any]] = {}

    def on_forward(module: torch.nn.Module, args: object) -> None:
        cls = type(module)
        if cls.__name__ in class_names and cls not in patched:
            patched[cls] = cls.forward
            cls.forward = _checkpointed(cls.forward)  # type: ignore[method-assign]

    handle = torch.nn.modules.module.register_module_forward_pre_hook(on_forward)
    try:
        yield
    finally:
        handle.remove()
        for cls, forward in patched.items():
            cls.forward = forward  # type: ignore[method-assign]


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    def run(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        # checkpointed by the script already (a recomputation must save what its forward
        # saved): run as written
        if not torch.is_grad_enabled() or is_checkpoint(module_caller(sys._getframe(1))):
            return forward(self, *args, **kwargs)
        return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)
    return run
