"""Whether the script already runs a module under activation checkpointing
(``torch.utils.checkpoint``), told from the frames around a module call.

Two ways are seen, reentrant or not: the module call is made by checkpoint itself
(``checkpoint(block, x)``, ``checkpoint_sequential``, transformers before 5), or a module's
own forward checkpoints what it runs (Hugging Face layers since transformers 5 checkpoint
``forward`` inside the call, so that module hooks stay outside): then the calls of its
submodules have a frame of ``torch/utils/checkpoint.py`` between them and its call.
"""

from __future__ import annotations

from types import FrameType

import torch
import torch.utils.checkpoint

_CALL_IMPL = torch.nn.Module._call_impl.__code__
_WRAPPED_CALL_IMPL = torch.nn.Module._wrapped_call_impl.__code__
_CHECKPOINT_FILE = torch.utils.checkpoint.__file__
_HOOK_DEPTH = 8  # frames from a hook (or a forward) to the module call that runs it
_FORWARD_DEPTH = 16  # frames from a module call out to the call of the module around it


def call_frame(frame: FrameType | None) -> FrameType | None:
    """The ``Module._call_impl`` frame running ``frame`` (a forward hook's, or the
    forward's own); None if none is found."""
    for _ in range(_HOOK_DEPTH):
        if frame is None or frame.f_code is _CALL_IMPL:
            return frame
        frame = frame.f_back
    return None


def module_caller(frame: FrameType | None) -> FrameType | None:
    """The frame that made the module call running ``frame`` (a forward hook's, or the
    forward's own), past ``Module.__call__``; None if none is found."""
    frame = call_frame(frame)
    caller = frame.f_back if frame is not None else None
    while caller is not None and caller.f_code is _WRAPPED_CALL_IMPL:
        caller = caller.f_back
    return caller


def is_checkpoint(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs torch.utils.checkpoint's code (a module call it makes)."""
    return frame is not None and frame.f_code.co_filename == _CHECKPOINT_FILE


def under_checkpoint(caller: FrameType | None) -> bool:
    """Whether checkpoint runs between ``caller`` (a module call's, ``module_caller``) and
    the call of the module around it: that module's forward is checkpointed."""
    frame = caller
    for _ in range(_FORWARD_DEPTH):
        if frame is None or frame.f_code is _CALL_IMPL:
            return False
        if frame.f_code.co_filename == _CHECKPOINT_FILE:
            return True
        frame = frame.f_back
    return False
