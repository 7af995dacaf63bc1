"""Remedies memprof applies to an unmodified script, for ``memprof suggest --verify``.

``MEMPROF_APPLY`` (JSON) names them: ``{"autocast": "bfloat16"}`` runs each outermost
module call (the forward pass) under CUDA autocast (with ``"autocast_device": "cpu"``, the
CPU's: a CPU recording's tensors stand in for CUDA's); ``{"checkpoint": "Block"}`` (or a
list of class names) runs every module of class ``Block`` under activation checkpointing
(from its class's first forward on: the first call of the first instance runs as written,
and so do the calls the script checkpoints itself); ``{"chunked_loss": 8}`` computes each
``F.cross_entropy`` over ``MIN_CLASSES`` classes or more that backward will differentiate in
8 chunks of rows, each checkpointed, so that one chunk's log-probabilities are saved at a
time (the same loss: summed over the chunks, then divided as the reduction asks);
``{"foreach": false}`` makes every optimizer that takes ``foreach`` with ``foreach=False``;
``{"attention_weights": false}`` calls every ``nn.MultiheadAttention`` with
``need_weights=False``. The sharding remedies of a distributed script are
``apply_distributed.py``'s.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memprof.collect.hooks.checkpointed import is_checkpoint, module_caller
from memprof.collect.hooks.parallelism import model_class
from memprof.collect.launch.apply_distributed import distributed_applied

ENV = "MEMPROF_APPLY"
MIN_CLASSES = 1024  # a vocabulary: where a loss's log-probabilities weigh (run.model.loss)
MAX_CHUNKS = 1024


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
        chunks = asked.get("chunked_loss")
        if type(chunks) is int and 1 < chunks <= MAX_CHUNKS:
            stack.enter_context(_chunked_cross_entropy(chunks))
        blocks = asked.get("checkpoint")
        blocks = [blocks] if isinstance(blocks, str) else blocks
        if isinstance(blocks, list) and all(isinstance(b, str) for b in blocks):
            stack.enter_context(_checkpointing(frozenset(blocks)))
        if asked.get("foreach") is False:
            stack.enter_context(_one_parameter_at_a_time())
        if asked.get("attention_weights") is False:
            stack.enter_context(_without_attention_weights())
        stack.enter_context(distributed_applied(asked))
        yield


@contextlib.contextmanager
def _one_parameter_at_a_time() -> Iterator[None]:
    """Every optimizer that takes ``foreach`` made with ``foreach=False`` (unless fused)."""
    init = torch.optim.Optimizer.__init__

    @functools.wraps(init)
    def made(self: torch.optim.Optimizer, params: Any, defaults: dict[str, Any],
             *args: Any, **kwargs: Any) -> None:
        if "foreach" in defaults and not defaults.get("fused"):
            defaults = {**defaults, "foreach": False}
        init(self, params, defaults, *args, **kwargs)

    torch.optim.Optimizer.__init__ = made  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.optim.Optimizer.__init__ = init  # type: ignore[method-assign]


_NEED_WEIGHTS = 4  # nn.MultiheadAttention.forward's need_weights, by position


@contextlib.contextmanager
def _without_attention_weights() -> Iterator[None]:
    """``nn.MultiheadAttention`` called with ``need_weights=False``: its fused kernel."""
    forward = torch.nn.MultiheadAttention.forward

    @functools.wraps(forward)
    def fused(self: torch.nn.MultiheadAttention, *args: Any, **kwargs: Any) -> Any:
        if len(args) > _NEED_WEIGHTS:
            args = (*args[:_NEED_WEIGHTS], False, *args[_NEED_WEIGHTS + 1:])
        else:
            kwargs["need_weights"] = False
        return forward(self, *args, **kwargs)

    torch.nn.MultiheadAttention.forward = fused  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.MultiheadAttention.forward = forward  # type: ignore[method-assign]


@contextlib.contextmanager
def _autocast_forward(dtype: torch.dtype, device: str) -> Iterator[None]:
    """``device``'s autocast around each outermost module call (the forward pass), as the
    recipe has it: not around backward or the optimizer step."""
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    open_: list[tuple[torch.nn.Module, torch.autocast]] = []

    exporting = getattr(torch.compiler, "is_exporting", lambda: False)

    def enter(module: torch.nn.Module, args: object) -> None:
        # not while torch.export traces the model (pipelining's tracer splits it so): the
        # graph would hold the autocast, and the stages' modules would not
        if not open_ and torch.is_grad_enabled() and not exporting():
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
        if model_class(module).__name__ in class_names and cls not in patched:
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


@contextlib.contextmanager
def _chunked_cross_entropy(chunks: int) -> Iterator[None]:
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    original = F.cross_entropy
    # torch's own cross_entropy hands a tensor subclass's call back to the module's
    # cross_entropy, this one: inside a chunk, it is the original's
    chunk = threading.local()

    def cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: Any = None,
                      size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
                      reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
        plain = (weight, size_average, reduce) == (None, None, None) and not label_smoothing
        if getattr(chunk, "running", False) or not (
                plain and torch.is_grad_enabled() and input.requires_grad and input.dim() == 2
                and input.shape[1] >= MIN_CLASSES and reduction in ("mean", "sum")
                and target.dim() == 1 and target.dtype == torch.long):
            return original(input, target, weight, size_average, ignore_index, reduce,
                            reduction, label_smoothing)

        def summed(rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            chunk.running = True
            try:
                return original(rows, targets, ignore_index=ignore_index, reduction="sum")
            finally:
                chunk.running = False
        total = torch.stack([checkpoint(summed, rows, targets, use_reentrant=False)
                             for rows, targets in zip(input.chunk(chunks), target.chunk(chunks),
                                                      strict=True)]).sum()
        return total if reduction == "sum" else total / (target != ignore_index).sum()

    F.cross_entropy = cross_entropy
    try:
        yield
    finally:
        F.cross_entropy = original
