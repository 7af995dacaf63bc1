"""Facts about the script's forward passes and gradient zeroing, for ``memprof suggest``.

While installed: a stack of the modules whose forward is running (``before`` and
``after``, called by the role hooks' global forward hooks), and wrappers around
``Optimizer.zero_grad`` and ``Module.zero_grad`` that record the ``set_to_none`` the script
passes. ``tag`` says what a tensor autograd saves for backward is: quadratic attention
scores (a ``T x T`` output of a score op, ``score_ops.py``), a cross-entropy's
log-probabilities over a vocabulary, or an activation of a forward run in eval mode
(``model.eval()``) with grad enabled. The label hooks drop the eval tag
from tensors a backward reads, so what remains was saved by forwards that nothing
backpropagated (evaluation without ``no_grad``). It also notes the module classes the
script runs under activation checkpointing in training (``checkpointed.py``), and whether
it loads weights into a module (``load_state_dict``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from memprof.collect.frames import HIDDEN_CODES
from memprof.collect.hooks.checkpointed import is_checkpoint, module_caller, under_checkpoint
from memprof.collect.hooks.parallelism import model_class
from memprof.trace.model import ATTENTION_SCORES, EVAL_ACTIVATIONS, LOSS_LOGITS

_ZERO_GRADS: tuple[type, ...] = (torch.optim.Optimizer, torch.nn.Module)


# libraries that load a model's own state into it while wrapping it (accelerate's FSDP2
# preparation, torch.distributed's state-dict helpers): no weights from elsewhere
_RESHARDING_LOADS = ("/accelerate/", "/torch/distributed/")


class ForwardFacts:
    """The module stack, zero_grad's flag and the attention scores seen in a run."""

    def __init__(self) -> None:
        self.stack: list[torch.nn.Module] = []
        self.set_to_none: bool | None = None  # the last zero_grad's flag; None: never called
        self.score_shape: list[int] | None = None  # the largest score tensor saved
        self.score_dtype: str | None = None
        self.score_module: str | None = None  # the class whose forward computed it
        self.eval_module: str | None = None  # the outermost module of an eval forward
        self.trained_in_eval = False  # a backward read what an eval forward saved
        self.checkpointed: set[str] = set()  # classes the script runs under checkpointing
        self._largest = 0
        # the largest log-probabilities a cross-entropy saved: its shape and dtype
        self.loss: dict[str, Any] | None = None
        self._largest_loss = 0
        self.loaded_state_dict = False  # the script loaded weights into a module
        self._originals: list[tuple[type, str, Callable[..., Any]]] = []

    def install(self) -> None:
        """Wrap the zero_grad and load_state_dict methods."""
        for cls in _ZERO_GRADS:
            self._patch(cls, "zero_grad", self._wrap(cls.zero_grad))
        self._patch(torch.nn.Module, "load_state_dict",
                    self._wrap_load(torch.nn.Module.load_state_dict))

    def _patch(self, cls: type, name: str, wrapper: Callable[..., Any]) -> None:
        self._originals.append((cls, name, getattr(cls, name)))
        setattr(cls, name, wrapper)

    def remove(self) -> None:
        """Restore zero_grad and load_state_dict."""
        for cls, name, original in self._originals:
            setattr(cls, name, original)
        self._originals = []

    def before(self, module: torch.nn.Module) -> None:
        """A module's forward starts (called from the label hooks' pre-forward hook)."""
        self.stack.append(module)
        if not module.training:  # checkpointing matters in training alone: not looked for
            return
        name = model_class(module).__name__
        outer = model_class(self.stack[-2]).__name__ if len(self.stack) > 1 else None
        if name in self.checkpointed and (outer is None or outer in self.checkpointed):
            return
        caller = module_caller(sys._getframe(1))
        if is_checkpoint(caller):  # checkpoint(block, x)
            self.checkpointed.add(name)
        elif outer is not None and under_checkpoint(caller):  # the outer forward checkpoints
            self.checkpointed.add(outer)

    def tag(self, t: torch.Tensor, square_score: bool, logits_rows: int | None = None
            ) -> str | None:
        """What a tensor saved for backward is, if a savings model needs to know
        (``logits_rows``: it is a cross-entropy's log-probabilities, of a slice of logits
        that many rows long where the loss reads part of them)."""
        if self.stack and not self.stack[0].training:  # no_grad would save nothing at all
            self.eval_module = self.eval_module or type(self.stack[0]).__name__
            return EVAL_ACTIVATIONS
        if square_score:
            self._note_score(t)
            return ATTENTION_SCORES
        if logits_rows is not None:
            size = t.numel() * t.element_size()
            if size > self._largest_loss:
                self._largest_loss = size
                self.loss = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                             "logits_rows": logits_rows}
            return LOSS_LOGITS
        return None

    def facts(self, fused: bool) -> dict[str, Any]:
        """The ``run.model`` entries these facts fill (JSON-ready); ``fused``: a
        ``scaled_dot_product_attention`` kernel ran."""
        seen = fused or self.score_shape is not None
        return {
            "zero_grad_set_to_none": self.set_to_none,
            "attention": {"fused": fused, "score_shape": self.score_shape,
                          "score_dtype": self.score_dtype, "module": self.score_module}
            if seen else None,
            "eval_module": self.eval_module,
            "trained_in_eval": self.eval_module if self.trained_in_eval else None,
            "loss": self.loss,
            "checkpointed": sorted(self.checkpointed),
            "loaded_state_dict": self.loaded_state_dict,
        }

    def _note_score(self, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if size > self._largest:
            self._largest = size
            self.score_shape = list(t.shape)
            self.score_dtype = str(t.dtype).removeprefix("torch.")
            owner = next((m for m in reversed(self.stack)
                          if any(True for _ in m.parameters())), None)
            self.score_module = type(owner).__name__ if owner is not None else None

    def after(self, module: torch.nn.Module) -> None:
        """A module's forward has ended (called from the label hooks' forward hook)."""
        # a forward hook registered by the script may raise, so the stack is searched
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i] is module:
                del self.stack[i:]
                return

    def _wrap_load(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def load_state_dict(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            if not any(part in caller for part in _RESHARDING_LOADS):
                self.loaded_state_dict = True
            return original(module, *args, **kwargs)
        HIDDEN_CODES.add(load_state_dict.__code__)
        return load_state_dict

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def zero_grad(obj: object, set_to_none: bool = True) -> Any:
            self.set_to_none = bool(set_to_none)
            return original(obj, set_to_none)
        HIDDEN_CODES.add(zero_grad.__code__)
        return zero_grad
