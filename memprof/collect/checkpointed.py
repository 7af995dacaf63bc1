"""Whether a module call comes from ``torch.utils.checkpoint``: the script already runs that
module under activation checkpointing (its own ``checkpoint(block, x)``, ``checkpoint_
sequential``, Hugging Face's ``gradient_checkpointing_enable()``), reentrant or not.

Both kinds call the checkpointed function from a frame of ``torch/utils/checkpoint.py``, in
forward and again when backward recomputes it; the function is the module itself
(``Module.__call__``), or a partial of it, so that frame is the module call's caller.
"""

from __future__ import annotations

from types import FrameType

import torch
import torch.utils.checkpoint

_CALL_IMPL = torch.nn.Module._call_impl.__code__
_WRAPPED_CALL_IMPL = torch.nn.Module._wrapped_call_impl.__code__
_CHECKPOINT_FILE = torch.utils.checkpoint.__file__
_HOOK_DEPTH = 8  # frames from a hook (or a forward) to the module call that runs it


def called_by_checkpoint(frame: FrameType | None) -> bool:
    """Whether the module call that runs ``frame`` (a forward hook's, or the forward's
    own) was made by ``torch.utils.checkpoint``."""
    for _ in range(_HOOK_DEPTH):
        if frame is None or frame.f_code is _CALL_IMPL:
            break
        frame = frame.f_back
    else:
        return False
    caller = frame.f_back if frame is not None else None
    while caller is not None and caller.f_code is _WRAPPED_CALL_IMPL:
        caller = caller.f_back
    return caller is not None and caller.f_code.co_filename == _CHECKPOINT_FILE
