"""What activation checkpointing of each module class would free, measured in the run.

Checkpointing a block drops what its forward saved for backward, keeps the block's inputs
and recomputes one block's saves at a time in backward. So for every module class with
submodules (a candidate block), over the run's first training forward (up to its first
backward), this notes:

- the bytes saved for backward only inside the class's instances (a storage also saved
  outside them is held anyway; parameters and buffers are held anyway too);
- the bytes of its calls' inputs that checkpointing would keep: those saved inside, or
  saved nowhere (an input saved outside is held anyway);
- the bytes saved inside its largest single call (recomputed at once in backward);
- how it is called: the forward's positional parameters bound and the keywords passed,
  for a snippet that calls it the same way;
- whether the model's library switches checkpointing on for it (``switch``).

Storages are told apart by their C object: a saved storage lives until backward, so none
is freed and replaced by another in a forward.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from memprof.collect.hooks.checkpointed import call_frame
from memprof.collect.hooks.parallelism import model_class
from memprof.collect.tensors import storages_behind, tensors_in

_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
_Key = tuple[str, str]  # a class's module and name


@dataclass
class _Class:
    """One candidate class's tally."""

    call: dict[str, list[str]] | None  # its first call's argument names
    switch: str | None  # "self": it has a gradient_checkpointing switch; "parent": its caller
    calls: int = 0
    inputs: dict[int, int] = field(default_factory=dict)  # address -> bytes
    largest_call: int = 0


class BlockSaves:
    """Tallies of what each candidate block class saves in the first training forward."""

    def __init__(self) -> None:
        self.stopped = False
        self._classes: dict[_Key, _Class] = {}
        self._open: list[tuple[torch.nn.Module, _Key, dict[int, int]]] = []  # calls running
        # every saved storage: its bytes and the classes inside whose calls every save was
        self._saves: dict[int, tuple[int, set[_Key]]] = {}
        self._held: set[int] = set()  # the storages of the parameters and buffers seen
        self._facts: dict[_Key, dict[str, Any]] | None = None

    def enter(self, module: torch.nn.Module, args: object,
              parent: torch.nn.Module | None) -> None:
        """A module's forward starts (``parent``: the module whose forward calls it)."""
        if self.stopped or not torch.is_grad_enabled():
            return
        for t in (*module._parameters.values(), *module._buffers.values()):
            if t is not None:  # saved for backward too, but no checkpointing frees them
                self._held.update(st._cdata for st in storages_behind(t))
        if not module._modules or isinstance(module, _CONTAINERS) or not module.training:
            return
        cls = model_class(module)
        key = (cls.__module__, cls.__name__)
        call = call_frame(sys._getframe(1))
        kwargs = call.f_locals.get("kwargs") if call is not None else None
        kwargs = kwargs if isinstance(kwargs, dict) else {}
        tally = self._classes.get(key)
        if tally is None:
            tally = self._classes[key] = _Class(_call(module, args, kwargs),
                                                _switch(module, parent))
        tally.calls += 1
        for t in tensors_in((args, tuple(kwargs.values()))):
            for st in storages_behind(t):
                if st.nbytes():
                    tally.inputs[st._cdata] = st.nbytes()
        self._open.append((module, key, {}))

    def exit(self, module: torch.nn.Module) -> None:
        """A module's forward has ended."""
        for i in range(len(self._open) - 1, -1, -1):  # an exception may have skipped exits
            if self._open[i][0] is module:
                for _, key, saved in self._open[i:]:
                    tally = self._classes[key]
                    tally.largest_call = max(tally.largest_call, sum(saved.values()))
                del self._open[i:]
                return

    def saved(self, t: torch.Tensor) -> None:
        """Autograd saves ``t`` for backward."""
        if self.stopped:
            return
        if torch._C._current_autograd_node() is not None:  # a backward's own saves
            return
        inside = {key for _, key, _ in self._open}
        for st in storages_behind(t):
            nbytes, addr = st.nbytes(), st._cdata
            if not nbytes or addr in self._held:
                continue
            before = self._saves.get(addr)
            self._saves[addr] = (nbytes, inside if before is None else before[1] & inside)
            for _, _, call in self._open:
                call[addr] = nbytes

    def stop(self, backward: bool = True) -> None:
        """The first backward has started (``backward``: if one is running now; else the
        first optimizer step has ended): the forward is measured."""
        if not self.stopped and (not backward or torch._C._current_autograd_node() is not None):
            self.stopped = True
            self._open.clear()

    def facts(self) -> dict[_Key, dict[str, Any]]:
        """Per class (module, name): ``saved`` (``inside_bytes``, ``kept_inputs_bytes``,
        ``largest_call_bytes``, ``forward_bytes``: all the forward saved), ``call`` and
        ``switch`` (JSON-ready)."""
        if self._facts is not None:
            return self._facts
        everything = sum(nbytes for nbytes, _ in self._saves.values())
        out = {}
        for key, tally in self._classes.items():
            only_inside = {addr for addr, (_, inside) in self._saves.items() if key in inside}
            kept = sum(nbytes for addr, nbytes in tally.inputs.items()
                       if addr in only_inside or addr not in self._saves)
            out[key] = {
                "saved": {"inside_bytes": sum(self._saves[a][0] for a in only_inside),
                          "kept_inputs_bytes": kept,
                          "largest_call_bytes": tally.largest_call,
                          "forward_bytes": everything, "calls": tally.calls},
                "call": tally.call, "switch": tally.switch}
        if self.stopped:  # final: the tallies no longer change
            self._facts = out
        return out


def _call(module: torch.nn.Module, args: object, kwargs: dict[str, Any]
          ) -> dict[str, list[str]] | None:
    """The names of the forward's parameters its positional arguments bind, and of the
    keywords passed (None: unknown)."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    named = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    count = len(args) if isinstance(args, tuple) else 0
    positional = [named[i] if i < len(named) else f"arg{i}" for i in range(count)]
    return {"args": positional, "kwargs": sorted(kwargs)}


def _switch(module: torch.nn.Module, parent: torch.nn.Module | None) -> str | None:
    """Where a library's checkpointing switch for ``module`` is: on its class (Hugging Face
    transformers' checkpointing layers), on the module that calls it (diffusers' blocks
    checkpoint their resnets and transformer blocks), or nowhere."""
    if hasattr(module, "gradient_checkpointing"):
        return "self"
    if parent is not None and hasattr(parent, "gradient_checkpointing"):
        return "parent"
    return None
