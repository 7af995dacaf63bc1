"""Activation checkpointing: which blocks, what checkpointing them frees at the peak, and
the code that calls them the way the run did.

``memprof run`` measures, for each repeated block class, what its instances saved for
backward in the first training forward and nothing outside them saved, the inputs
checkpointing would keep, and the saves of its largest call (recomputed at once in
backward): ``run.model.repeated_blocks[].saved`` (``collect/hooks/block_saves.py``).
Checkpointing each block then frees ``inside - kept inputs - largest call`` at the
activation moment; late in backward, where every gradient is held (the optimizer step's
moment), the recomputed call's saves and backward's working memory are held too. The remedy
names the class that frees the most; a library's own switch (Hugging Face transformers'
checkpointing layers, diffusers' blocks) frees what its classes together do. The peak
holds the forward's saves in the share its activations have of them.

Reports written before these measurements get the older model: the activations inside
repeated blocks, evenly, with a block's input assumed ``BLOCK_INPUT_SHARE`` of its saves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from memprof.advise.peak import Peak
from memprof.advise.remedy import SEEDS, Context, Remedy
from memprof.report.units import format_bytes
from memprof.trace.model import ACTIVATIONS, TEMPORARIES

BLOCK_INPUT_SHARE = 0.06  # a transformer block's input against the activations it saves
# where each library's switch is (``block_saves._switch``): on the checkpointed class
# (transformers' GradientCheckpointingLayer), or on the module that calls it (diffusers)
LIBRARY_SWITCH = {"transformers": "self", "diffusers": "parent"}


def checkpoint_remedies(peak: Peak, ctx: Context) -> list[Remedy]:
    """Checkpointing of the repeated blocks, where activations are a share of the peak."""
    if not peak.busy:
        return []
    checkpointed = set(ctx.model.get("checkpointed") or [])
    blocks = [b for b in ctx.model.get("repeated_blocks") or []
              if b["class"] not in checkpointed]
    if not blocks:
        return []
    if not any(b.get("saved") for b in blocks):
        return [] if ctx.block is None or ctx.block["class"] in checkpointed \
            else _assumed(ctx, ctx.block)
    return _measured(ctx, [b for b in blocks if b.get("saved")])


def _recomputed(block: dict[str, Any], segments: int | None = None) -> int:
    """The saves one recomputation holds in backward: the largest block's, or a segment's."""
    saved = block["saved"]
    largest = saved["largest_call_bytes"]
    return largest if segments is None else max(largest, saved["inside_bytes"] // segments)


def _frees(block: dict[str, Any], segments: int | None = None) -> int:
    """What checkpointing each block of this class (in ``segments`` runs of blocks:
    the segments' first inputs kept, one segment recomputed) frees at the peak."""
    saved = block["saved"]
    kept = saved["kept_inputs_bytes"] if segments is None \
        else saved["kept_inputs_bytes"] * segments // block["count"]
    return saved["inside_bytes"] - kept - _recomputed(block, segments)


def _dropping(freed: int, recomputed: int, forward: int) -> Callable[[Peak], Peak]:
    """``freed`` bytes of the forward's saves (``forward`` in all) no longer held at the
    activation moment, in the share the peak's activations hold of the forward's saves.
    Late in backward every gradient is held with ``recomputed`` bytes and backward's working
    memory (taken as the recorded peak's temporaries): the optimizer step's moment grows
    by both."""
    def change(p: Peak) -> Peak:
        held = p.at_peak[ACTIVATIONS]
        if not held or freed <= 0:
            return p
        gone = min(held, int(freed * min(1.0, held / forward)) if forward else freed)
        step = {**p.at_step, ACTIVATIONS: p.at_step[ACTIVATIONS] + recomputed,
                TEMPORARIES: max(p.at_step[TEMPORARIES], p.at_peak[TEMPORARIES])}
        return replace(p.scaled({ACTIVATIONS: (held - gone) / held}, step_too=False),
                       at_step=step)
    return change


def _measured(ctx: Context, blocks: list[dict[str, Any]]) -> list[Remedy]:
    library = ctx.model_library
    switched = [b for b in blocks if b.get("switch") == LIBRARY_SWITCH.get(library or "")]
    if library and switched:
        return [_library_switch(ctx, switched)]
    best = max(blocks, key=_frees)
    if _frees(best) <= 0:
        return []
    n, name, saved = best["count"], best["class"], best["saved"]
    measured = (f"measured in the run's first training forward: the {n} {name} blocks saved"
                f" {format_bytes(saved['inside_bytes'])} for backward that nothing outside them"
                f" saved (of {format_bytes(saved['forward_bytes'])} the forward saved), and"
                " checkpointing keeps their inputs"
                f" ({format_bytes(saved['kept_inputs_bytes'])})")
    remedies = [_each_block(
        f"activation checkpointing of each {name} ({n} blocks)",
        f"{measured}; one block's saves are recomputed at a time (the largest:"
        f" {format_bytes(saved['largest_call_bytes'])})",
        _dropping(_frees(best), _recomputed(best), saved["forward_bytes"]),
        _library_snippet(ctx, name) if library else _checkpoint_snippet(best),
        {"checkpoint": name})]
    segments = round(math.sqrt(n))
    call = best.get("call") or {}
    single = len(call.get("args") or []) == 1 and not call.get("kwargs")
    if n >= 4 and segments < n and single and not library \
            and _frees(best, segments) > _frees(best):
        remedies.append(Remedy(
            "checkpoint_sqrt", f"checkpointing every {n // segments} {name} blocks"
            f" ({segments} segments, about sqrt({n}))", "checkpointing", 5,
            "compute: about one more forward pass in backward", SEEDS["004"],
            f"{measured}; one segment's saves are recomputed at a time, evenly",
            _dropping(_frees(best, segments), _recomputed(best, segments),
                      saved["forward_bytes"]),
            "from torch.utils.checkpoint import checkpoint_sequential\n\n"
            f"# the {n} {name} modules, run in sequence:\n"
            f"x = checkpoint_sequential(blocks, {segments}, x, use_reentrant=False)"))
    return remedies


def _library_switch(ctx: Context, blocks: list[dict[str, Any]]) -> Remedy:
    """The model library's own switch, freeing what its checkpointed classes do together."""
    recomputed = max(_recomputed(b) for b in blocks)
    freed = sum(max(0, b["saved"]["inside_bytes"] - b["saved"]["kept_inputs_bytes"])
                for b in blocks) - recomputed
    names = [b["class"] for b in blocks]
    inside = sum(b["saved"]["inside_bytes"] for b in blocks)
    listed = ", ".join(f"{b['count']} {b['class']}" for b in blocks)
    return _each_block(
        f"activation checkpointing of the model's blocks ({listed})",
        f"{ctx.model_library} checkpoints these classes (measured in the run's first"
        f" training forward: they saved {format_bytes(inside)}"
        " for backward that nothing outside them saved, of"
        f" {format_bytes(blocks[0]['saved']['forward_bytes'])}); checkpointing keeps their"
        " inputs and recomputes one block's saves at a time",
        _dropping(freed, recomputed, blocks[0]["saved"]["forward_bytes"]),
        _library_snippet(ctx, names[0] if len(names) == 1 else " and ".join(names)),
        {"checkpoint": names})


def _each_block(title: str, assumptions: str, change: Callable[[Peak], Peak], snippet: str,
                verify: dict[str, Any]) -> Remedy:
    """Checkpointing each block of some classes: one recomputation of each in backward."""
    return Remedy("checkpoint_blocks", title, "checkpointing", 6,
                  "compute: one more forward of each block in backward (~30%)", SEEDS["003"],
                  assumptions, change, snippet, verify)


def _library_snippet(ctx: Context, name: str) -> str:
    if ctx.transformers:
        return (_in_training(ctx) + "model.gradient_checkpointing_enable(\n"
                '    gradient_checkpointing_kwargs={"use_reentrant": False})'
                "  # or TrainingArguments(gradient_checkpointing=True)")
    return (_in_training(ctx) + "model.enable_gradient_checkpointing()  # the diffusers model"
            f" whose {name} blocks these are")


def _checkpoint_snippet(block: dict[str, Any]) -> str:
    """``checkpoint`` called with the arguments the run called the blocks with."""
    n, name = block["count"], block["class"]
    call = block.get("call") or {"args": ["x"], "kwargs": []}
    arguments = ["block", *call["args"], *(f"{k}={k}" for k in call["kwargs"]),
                 "use_reentrant=False"]
    out = call["args"][0] if call["args"] else "out"
    return ("from torch.utils.checkpoint import checkpoint\n\n"
            f"# where the model calls its {name} modules, e.g. in its forward:\n"
            f"for block in blocks:  # the {n} {name} modules\n"
            f"    {out} = checkpoint({', '.join(arguments)})")


def _assumed(ctx: Context, block: dict[str, Any]) -> list[Remedy]:
    """A report without the blocks' measurements: the older, assumed model."""
    n, name = block["count"], block["class"]
    shares = ctx.block_shares or {ACTIVATIONS: 1.0, TEMPORARIES: 1.0}

    def keeping(segments: int) -> Callable[[Peak], Peak]:
        kept = min(1.0, 1 / segments + BLOCK_INPUT_SHARE * segments / n)
        return lambda p: p.scaled({k: 1 - share * (1 - kept) for k, share in shares.items()},
                                  step_too=False)

    held = (f"{shares[ACTIVATIONS]:.0%} of the activations and {shares[TEMPORARIES]:.0%} of"
            " the temporaries at the peak (as memprof run attributed them to modules)"
            if ctx.block_shares else "the activations and temporaries at the peak")
    return [_each_block(
        f"activation checkpointing of each {name} ({n} blocks)",
        f"assumed (a report without the blocks' measurements): {held} are the"
        f" {n} {name} blocks', evenly; a block's input is {BLOCK_INPUT_SHARE:.0%} of what it"
        " saves; one block's activations are recomputed at a time",
        keeping(n),
        _library_snippet(ctx, name) if ctx.model_library else _checkpoint_snippet(block),
        {"checkpoint": name})]


def _in_training(ctx: Context) -> str:
    """A model trained in eval mode (``from_pretrained`` returns one) checkpoints nothing
    under Hugging Face's switch: it applies in training mode only."""
    model = ctx.model.get("trained_in_eval")
    return (f"model.train()  # the {model} trained in eval mode: Hugging Face models skip"
            " gradient checkpointing\n# (and dropout) then, whatever enables it\n"
            if model else "")
