"""DeepSpeed's gradient-reduction buckets, smaller: ``reduce_bucket_size`` elements each
(5e8 by default: 2 GB of fp32 per rank, whatever the model's size), one bucket, or two
under ZeRO-1/2's ``overlap_comm``. The gradients are views of one (``gradients``), the
other is a communication buffer (``analysis/categories.py``); both are alive from the
engine's start, so a smaller size saves at either moment of the peak. ``--verify`` sets
the smaller size in DeepSpeed's config as the engine reads it (``apply_distributed.py``).
"""

from __future__ import annotations

import json

from memprof.advise.peak import Peak
from memprof.advise.remedy import SEEDS, Context, Remedy
from memprof.trace.model import COMMUNICATION, GRADIENTS

SMALLER = 50_000_000  # elements: a tenth of DeepSpeed's default
BUCKET_SHARE = 0.05  # buckets under this share of the peak: not worth a config change


def bucket_remedies(peak: Peak, ctx: Context) -> list[Remedy]:
    """The remedies of this module that apply to the run."""
    buckets = (ctx.model.get("parallelism") or {}).get("deepspeed")
    stage = ctx.zero_stage
    if not buckets or not stage or buckets["reduce_bucket_size"] <= SMALLER:
        return []
    dtypes = ctx.model.get("dtypes") or {}
    itemsize = 2 if max(dtypes, key=lambda d: dtypes[d], default="float32") in (
        "bfloat16", "float16") else 4
    saved = (buckets["reduce_bucket_size"] - SMALLER) * itemsize  # each bucket
    double = stage <= 2 and buckets["overlap_comm"]
    held = peak.moment
    if held[GRADIENTS] < saved or (double and held[COMMUNICATION] < saved) \
            or saved * (2 if double else 1) < BUCKET_SHARE * peak.allocated:
        return []  # not the buckets memprof knows of: said nothing rather than guessed

    def smaller(p: Peak) -> Peak:
        p = p.with_state(GRADIENTS, -saved)
        return p.with_state(COMMUNICATION, -saved) if double else p

    size = buckets["reduce_bucket_size"]
    return [Remedy(
        "zero_buckets", f"DeepSpeed's reduce buckets of {SMALLER:,} elements instead of"
        f" {size:,}", "buckets", 1,
        "time: more, smaller reductions (overlapped with backward all the same)",
        SEEDS["000"],
        f"{'two buckets (overlap_comm)' if double else 'the bucket'} of {size:,} {itemsize}-byte"
        f" gradients shrink to {SMALLER:,} elements, {saved:,} bytes less each",
        smaller, _snippet(ctx, stage), {"zero_buckets": SMALLER})]


def _snippet(ctx: Context, stage: int) -> str:
    """The bucket sizes in the switches of the loop's library."""
    sizes = {"reduce_bucket_size": SMALLER,
             **({"allgather_bucket_size": SMALLER} if stage <= 2 else {})}
    if ctx.lightning:
        given = ", ".join(f"{k}={v:_}" for k, v in sizes.items())
        return (f"from {ctx.lightning[1]} import DeepSpeedStrategy\n\n"
                f"{ctx.lightning[0]}..., strategy=DeepSpeedStrategy(stage={stage}, {given}))")
    config = json.dumps({"zero_optimization": {"stage": stage, **sizes}})
    if ctx.trainer:
        return f"TrainingArguments(..., deepspeed={config})  # or in its ds_config.json"
    return f"ds_config = {config}  # the rest of your DeepSpeed config as it is"
