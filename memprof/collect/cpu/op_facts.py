"""What the storage tracker needs to know of an operator, decided once per ``OpOverload``.

Whether an output's storage can be one of the inputs' storages: only if the schema gives a
return an alias annotation (views, in-place and ``out=`` ops), for the few aten ops that
alias without saying so (``_unsafe_view``), and for any op outside aten, whose schema is
not checked (c10d's collectives return their inputs unannotated); never for ``set_``, which
points its tensor at the storage it is given (``torch.load`` and safetensors make theirs
without an operator: a storage not tracked yet is new). Whether the op is a
view (autograd's ADInplaceOrView kernel, and returns that alias without writing): half of
a forward pass's operators, they make no storage, and the tracker skips them. The
annotation alone would not do: a composite op that may alias (``reshape``, ``to``,
``contiguous``) reaches the tracker whole under ``inference_mode`` and copies when it must.
And whether a new output can be attention scores or comes from a fused attention kernel
(``score_ops.py``), and how CUDA autocast would run the op (``autocast_ops.py``).

    facts = op_facts(torch.ops.aten.mm.default)
    facts & MAY_ALIAS  # 0: mm's output never shares an input's storage
"""

from __future__ import annotations

import torch

from memprof.collect.cpu.autocast_ops import FP32_OPS, LOWER_OPS
from memprof.collect.cpu.score_ops import FUSED_ATTENTION_OPS, LOSS_OPS, SCORE_OPS

MAY_ALIAS = 1  # an output may share an input's storage
SCORES = 2  # an output may be attention scores (SCORE_OPS)
FUSED = 4  # a fused attention kernel (FUSED_ATTENTION_OPS)
VIEW = 8  # every output is a view of an input: the op makes no storage
LOSS = 16  # an output may be a cross-entropy's log-probabilities (LOSS_OPS)
HALF = 32  # autocast runs it in half precision (autocast_ops.LOWER_OPS)
FP32 = 64  # autocast runs it in fp32 (autocast_ops.FP32_OPS)

# aten ops whose outputs share an input's storage though the schema does not say so
# (torch's SchemaCheckMode exempts the first ones; lift returns its input itself)
_UNANNOTATED = frozenset({"aten::_unsafe_view", "aten::unsafe_split",
                          "aten::unsafe_split_with_sizes", "aten::unsafe_chunk", "aten::lift"})
# id(op) -> its flags: an OpOverload hashes in Python, an id does not; the ops are kept
# (_SEEN), so that their ids are never reused
_FACTS: dict[int, int] = {}
_SEEN: list[object] = []


def op_facts(func: object) -> int:
    """The flags above that hold for ``func`` (an OpOverload; None: no operator)."""
    facts = _FACTS.get(id(func))
    if facts is None:
        facts = _FACTS[id(func)] = _decide(func)
        _SEEN.append(func)
    return facts


def _decide(func: object) -> int:
    schema = getattr(func, "_schema", None)
    aten = schema is not None and getattr(func, "namespace", None) == "aten"
    # set_ points its tensor at the storage it is given: one no operator made (torch.load's,
    # a memory-mapped file's) is new, however the schema annotates it
    sets = aten and schema.name == "aten::set_"
    aliases = not sets and (not aten or schema.name in _UNANNOTATED
                            or any(r.alias_info is not None for r in schema.returns))
    views = (aten and bool(schema.returns)
             and all(r.alias_info is not None and not r.alias_info.is_write
                     for r in schema.returns)
             and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "ADInplaceOrView"))
    packet = getattr(func, "overloadpacket", None)
    return ((MAY_ALIAS if aliases else 0) | (VIEW if views else 0)
            | (SCORES if packet in SCORE_OPS else 0)
            | (FUSED if packet in FUSED_ATTENTION_OPS else 0)
            | (LOSS if packet in LOSS_OPS else 0)
            | (HALF if packet in LOWER_OPS else 0) | (FP32 if packet in FP32_OPS else 0))
