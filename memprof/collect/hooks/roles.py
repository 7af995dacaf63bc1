"""Global hooks that see the script's real tensors in their roles, without a dispatch mode.

While installed, the hooks see every module call (its parameters and buffers), every
buffer registration, every gradient accumulation, every optimizer step (its gradients
and state) and every tensor autograd saves for backward; the user's script is not
touched. What a role is told goes to ``_mark``: the CPU recorder marks its storage
events (``labels.py``), the CUDA path notes the storage address (``labeller.py``).
"""

from __future__ import annotations

import os
import sys
import weakref
from types import FrameType
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.checkpoint import _VersionWrapper
from torch.utils.hooks import RemovableHandle

from memprof.collect.hooks.block_saves import BlockSaves
from memprof.collect.hooks.forward_facts import ForwardFacts
from memprof.collect.hooks.model_facts import model_facts, quantisation_state
from memprof.collect.hooks.parallelism import merged, parallelism, pipeline_of
from memprof.collect.hooks.step_pace import END, MOVE, StepPace
from memprof.collect.hooks.weak_ids import WeakIdMap
from memprof.collect.tensors import tensors_in
from memprof.trace.model import (
    ACTIVATIONS,
    BUFFERS,
    GRADIENTS,
    OPTIMIZER_STATE,
    PARAMETERS,
)

# the training loops that step the optimizer for the script, by a file of theirs on the
# step's stack: Hugging Face's Trainer, Lightning's Trainer, accelerate's wrapped optimizer
_LOOPS = ((os.path.join("transformers", "trainer.py"), "transformers"),
          (os.path.join("lightning", "pytorch", "loops"), "lightning"),
          (os.path.join("pytorch_lightning", "loops"), "lightning"),
          (os.path.join("lightning", "fabric", "wrappers.py"), "fabric"),
          (os.path.join("lightning_fabric", "wrappers.py"), "fabric"),
          (os.path.join("accelerate", "optimizer.py"), "accelerate"))


class RoleHooks:
    """Global module, optimizer and saved-tensor hooks that report each tensor's role.

    Subclasses say what a role means (``_mark``) and where in the run a step ends
    (``_position``).
    """

    def __init__(self) -> None:
        self.steps: list[int] = []  # the position (``_position``) at each step's end
        self._steps_seen = 0
        self.model: dict[str, Any] = {}  # model_facts(), filled by remove()
        self._autocast: str | None = None  # CUDA autocast dtype seen in a forward
        # the library whose loop steps the optimizer ("transformers", "lightning",
        # "fabric", "accelerate"; _LOOPS), or None for the script's own loop
        self._trainer: str | None = None
        # how the model was spread, as seen so far: a wrapper (the Trainer's DDP) may be
        # gone by the end of the script, when the facts are taken again
        self._parallelism: dict[str, Any] | None = None
        self._pipeline: dict[str, Any] | None = None  # the schedule that ran a forward
        self._pace = StepPace()
        self._forward = ForwardFacts()
        self._blocks = BlockSaves()
        self._modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        # each module's parameter and buffer addresses when its forward last marked them
        self._held: WeakIdMap[tuple[int, ...]] = WeakIdMap()
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        # no reference to the parameters, weak ones included: Module._apply (model.half())
        # swaps a tensor subclass's parameters in place, which a weak reference forbids
        self._grad_hooks: list[RemovableHandle] = []
        # gradient accumulation: the backward passes that reached one parameter (the first
        # whose gradient arrived, by id) before each optimizer step
        self._counted: int | None = None
        self._backwards = 0
        self._accumulation: int | None = None
        self._grad_hook = self._on_grad  # one bound method: found by identity in a param's hooks
        self._handles: list[RemovableHandle] = []
        # FSDP2's accumulated-gradient method, patched while recording (False: not yet)
        self._accumulating: Any = False
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def install(self) -> None:
        """Register the global module, optimizer and saved-tensor hooks."""
        self._handles = [
            register_module_forward_pre_hook(self._on_forward),
            register_module_forward_hook(self._on_exit, always_call=True),
            register_module_buffer_registration_hook(self._on_buffer),
            register_optimizer_step_pre_hook(self._on_step_pre),
            register_optimizer_step_post_hook(self._on_step_post),
        ]
        self._forward.install()
        self._saved.__enter__()
        self._sac_init = init = _VersionWrapper.__init__

        def cached(wrapper: _VersionWrapper, val: Any) -> None:
            # selective activation checkpointing keeps what its policy saves in a cache of
            # its own, not through saved-tensor hooks: activations too
            init(wrapper, val)
            if isinstance(val, torch.Tensor):
                self._pack(val)
        _VersionWrapper.__init__ = cached  # type: ignore[method-assign]
        self._apply_orig = apply = torch.nn.Module._apply

        def applied(module: torch.nn.Module, fn: Any, *args: Any, **kwargs: Any) -> Any:
            # model.cuda() / .to() / .half(): what the module holds now are its parameters
            # and buffers, even if they are gone before any forward sees them (FSDP1
            # flattens a model the script put on the card, and frees its tensors)
            out = apply(module, fn, *args, **kwargs)
            for p in module._parameters.values():
                if p is not None:
                    self._mark_param(p)
            self._mark_buffers(module)
            return out
        torch.nn.Module._apply = applied  # type: ignore[method-assign]
        self._setstate_orig = setstate = torch.nn.Module.__setstate__

        def restored(module: torch.nn.Module, state: dict[str, Any]) -> None:
            # a deep copy of a model (an EMA of its weights, a frozen reference model), or
            # one unpickled, holds parameters and buffers too, though its forward may never
            # run in training
            setstate(module, state)
            for p in module._parameters.values():
                if p is not None:
                    self._mark_param(p)
            self._mark_buffers(module)
        torch.nn.Module.__setstate__ = restored  # type: ignore[method-assign]

    def remove(self) -> None:
        """Mark what the seen modules and optimizers hold now, then remove every hook."""
        try:
            if len(self._modules):  # else the script's objects are gone: keep the last facts
                self.model = self._model_facts()
            if self.model:
                self.model.update(self._forward.facts(self._fused_attention()),
                                  ops_traced=self._traces_ops())
            # a seen module's submodules too: those whose forward never ran (a run that
            # ended early), made by to_empty from the meta device, were never marked
            marked: set[int] = set()
            for module in list(self._modules):
                for sub in module.modules():
                    if id(sub) not in marked:
                        marked.add(id(sub))
                        for p in [*sub._parameters.values(), *_fsdp_shards(sub)]:
                            if p is not None:
                                self._mark_param(p)
                        self._mark_buffers(sub)
                        for g in _zero_gradient_partitions(sub):
                            self._mark(g, GRADIENTS)
            for optimizer in list(self._optimizers):
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        self._mark_param(p)
                self._mark_state(optimizer)
        finally:
            self._saved.__exit__()
            _VersionWrapper.__init__ = self._sac_init  # type: ignore[method-assign]
            torch.nn.Module._apply = self._apply_orig  # type: ignore[method-assign]
            torch.nn.Module.__setstate__ = self._setstate_orig  # type: ignore[method-assign]
            self._forward.remove()
            if self._accumulating not in (False, None):
                sys.modules[_FSDP_PARAM].FSDPParam.to_accumulated_grad_if_needed = \
                    self._accumulating
            for handle in [*self._handles, *self._grad_hooks]:
                handle.remove()
            self._handles = []
            self._grad_hooks.clear()

    def _mark(self, t: torch.Tensor, category: str) -> None:
        """``t`` is seen in the role ``category`` now."""
        raise NotImplementedError

    def _position(self) -> int:
        """Where the run is now, as ``steps`` records it."""
        raise NotImplementedError

    def _end_step(self) -> None:
        """An optimizer step has just ended."""
        self.steps.append(self._position())

    def _move_step_end(self) -> None:
        """The last step ends now instead (another optimizer of its iteration stepped)."""
        self.steps[-1] = self._position()

    def _fused_attention(self) -> bool:
        """Whether a ``scaled_dot_product_attention`` kernel ran (unknown here: False)."""
        return False

    def _traces_ops(self) -> bool:
        """Whether the run's operators are seen, so that what they made is tagged (attention
        scores, log-probabilities, autocast's half precision): not here."""
        return False

    def _mark_param(self, p: torch.Tensor) -> None:
        self._mark(p, PARAMETERS)
        shard = p.__dict__.get("ds_tensor")  # DeepSpeed ZeRO-3's partition of it
        if isinstance(shard, torch.Tensor):
            self._mark(shard, PARAMETERS)
        for t in quantisation_state(p):  # a 4-bit weight's scales and code are the weight's
            self._mark(t, PARAMETERS)
        # a module's non-leaf "parameter" (FSDP's views in forward) has no gradient to read
        if (p.is_leaf or p.retains_grad) and p.grad is not None:
            self._mark(p.grad, GRADIENTS)

    def _mark_buffers(self, module: torch.nn.Module) -> None:
        for b in module._buffers.values():  # buffers(recurse=False) costs 2 µs a call
            if b is not None:
                self._mark(b, BUFFERS)

    def _watch_param(self, p: torch.Tensor) -> None:
        self._mark_param(p)
        # (FSDP with use_orig_params swaps views of its flat parameter in: not leaves)
        hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
        if p.requires_grad and p.is_leaf and self._grad_hook not in hooks.values():
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook))

    def _mark_state(self, optimizer: torch.optim.Optimizer) -> None:
        for state in optimizer.state.values():
            for t in tensors_in(tuple(state.values())):
                self._mark(t, OPTIMIZER_STATE)

    def _on_forward(self, module: torch.nn.Module, args: object) -> None:
        if not torch.compiler.is_compiling():  # traced into a compiled graph: left as it is
            self._see(module, args)

    def _on_exit(self, module: torch.nn.Module, args: object, output: object) -> None:
        if not torch.compiler.is_compiling():
            self._exit(module)

    def _exit(self, module: torch.nn.Module) -> None:
        """A module's forward has ended."""
        self._forward.after(module)
        self._blocks.exit(module)

    def _see(self, module: torch.nn.Module, args: object) -> None:
        """A module's forward starts: mark its parameters and buffers when they moved."""
        self._forward.before(module)
        stack = self._forward.stack
        self._blocks.enter(module, args, stack[-2] if len(stack) > 1 else None)
        if len(stack) == 1 and not self._steps_seen and not self._pipeline:
            # a pipeline schedule's microbatches are its backward passes, not the script's
            self._pipeline = pipeline_of(sys._getframe(2))
        if self._autocast is None and torch._C._is_any_autocast_enabled():
            self._autocast = _autocast_dtype(module)
        if self._accumulating is False and _FSDP_PARAM in sys.modules:
            self._accumulating = _marked_accumulation(self._mark)
        held = _addresses(module)
        if held is not None and self._held.get(module) == held:
            return  # the same storages as its last forward marked: nothing new to see
        self._modules.add(module)
        for p in module._parameters.values():
            if p is not None:
                self._watch_param(p)
        self._mark_buffers(module)
        if held is not None:
            self._held[module] = held

    def _on_buffer(self, module: torch.nn.Module, name: str, buffer: torch.Tensor | None) -> None:
        if buffer is not None:
            self._mark(buffer, BUFFERS)

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._mark(p.grad, GRADIENTS)
        if self._counted is None:
            self._counted = id(p)
        self._backwards += self._counted == id(p)

    def _model_facts(self) -> dict[str, Any]:
        self._parallelism = merged(merged(self._parallelism, parallelism(self._modules)),
                                   self._pipeline)
        return {**model_facts(self._modules, self._optimizers, self._autocast,
                              self._blocks.facts()),
                "trainer": self._trainer, "parallelism": self._parallelism,
                "accumulation": self._accumulation}

    def _on_step_pre(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if self._trainer is None and not self._optimizers:  # the first step says
            self._trainer = _loop_of(sys._getframe(1))
        self._optimizers.add(optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._watch_param(p)

    def _on_step_post(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        self._mark_state(optimizer)
        where = self._pace.at(optimizer)
        if where == MOVE:  # the iteration goes on with another optimizer (step_pace.py)
            self._move_step_end()
            return
        if where != END:
            return
        self._end_step()
        self._blocks.stop(backward=False)
        if self._backwards:
            self._accumulation = max(self._accumulation or 1, self._backwards)
        self._backwards = 0
        self._steps_seen += 1
        if self._steps_seen <= 2:  # the state exists after a step; the objects may not at exit
            self.model = self._model_facts()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._mark(t, ACTIVATIONS)
        self._blocks.saved(t)
        # the tensor itself would make a reference cycle through its grad_fn that keeps
        # a graph that is never backwarded alive; a detached view shares the storage
        return t.detach()

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        return t


_FSDP_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param"


def _marked_accumulation(mark: Any) -> Any:
    """Patch FSDP2's ``to_accumulated_grad_if_needed`` to ``mark`` the gradient it makes,
    an unsharded copy in the reduce dtype that FSDP accumulates into until its last
    microbatch's reduce-scatter (a pipeline's, or with gradient accumulation); return the
    original (None where FSDP has no such method)."""
    param = sys.modules[_FSDP_PARAM].FSDPParam
    original = getattr(param, "to_accumulated_grad_if_needed", None)
    if original is None:
        return None

    def accumulated(self: Any) -> None:
        original(self)
        grad = getattr(self, "unsharded_accumulated_grad", None)
        if isinstance(grad, torch.Tensor):
            mark(grad, GRADIENTS)

    param.to_accumulated_grad_if_needed = accumulated
    return original


def _fsdp_shards(module: torch.nn.Module) -> list[torch.Tensor]:
    """The shards of an FSDP2 unit's parameters: while it has gathered them (a run that
    ended inside its forward or backward), the module holds the gathered ones instead."""
    state = getattr(module, "_get_fsdp_state", None)
    try:
        group = state()._fsdp_param_group if state is not None else None
        return [] if group is None else [p.sharded_param for p in group.fsdp_params]
    except (AttributeError, AssertionError):  # another torch's FSDP2, or no state yet
        return []


def _zero_gradient_partitions(module: torch.nn.Module) -> list[torch.Tensor]:
    """A DeepSpeed ZeRO-3 engine's flat buffer of this rank's gradient partitions, which the
    optimizer steps on copies of; none for another module."""
    buffer = getattr(module.__dict__.get("optimizer"), "grad_partitions_flat_buffer", None)
    return [buffer] if isinstance(buffer, torch.Tensor) else []


def _addresses(module: torch.nn.Module) -> tuple[int, ...] | None:
    """Where a module's parameters and buffers are (a forward marks them only when this
    changes: most forwards of a training run see the same storages); None for tensors
    without a storage of their own (subclasses), which are always marked."""
    params, buffers = module._parameters, module._buffers
    if not params and not buffers:  # a module call's hot path: most modules hold nothing
        return ()
    try:
        return (*[p.data_ptr() for p in params.values() if p is not None],
                *[b.data_ptr() for b in buffers.values() if b is not None])
    except RuntimeError:
        return None


def _loop_of(frame: FrameType | None, depth: int = 32) -> str | None:
    """The library of ``_LOOPS`` that the ``depth`` frames from ``frame`` out run, the first
    in its order (Hugging Face's Trainer steps through accelerate's optimizer too)."""
    files = []
    for _ in range(depth):
        if frame is None:
            break
        files.append(frame.f_code.co_filename)
        frame = frame.f_back
    return next((library for part, library in _LOOPS if any(part in f for f in files)), None)


def _autocast_dtype(module: torch.nn.Module) -> str | None:
    """The dtype of the autocast a module's forward runs under: CUDA's, or the CPU's where
    the module's weights are on the CPU (a CPU recording stands in for CUDA); else None."""
    if torch.is_autocast_enabled("cuda"):
        device = "cuda"
    elif torch.is_autocast_enabled("cpu"):
        weight = next((p for p in module._parameters.values() if p is not None), None)
        if weight is None or weight.device.type != "cpu":
            return None
        device = "cpu"
    else:
        return None
    return str(torch.get_autocast_dtype(device)).removeprefix("torch.")
