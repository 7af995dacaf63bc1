"""Remedies for a pipeline-parallel run (``torch.distributed.pipelining``): the 1F1B
schedule instead of GPipe's. GPipe runs every microbatch's forward before any backward, so
a stage holds the activations of them all; 1F1B starts the backward passes once the
pipeline is full, and a stage holds those of the microbatches still in flight after it:
one per stage from it to the last. (Smaller microbatches save nothing under GPipe, at the
same batch: the micro-batch remedies are not offered on a pipeline.)
"""

from __future__ import annotations

from memprof.advise.peak import Peak
from memprof.advise.remedy import SEEDS, Context, Remedy
from memprof.trace.model import ACTIVATIONS


def pipeline_remedies(peak: Peak, ctx: Context) -> list[Remedy]:
    """The remedies of this module that apply to the run."""
    facts = ctx.pipeline
    if not facts or facts["schedule"] != "ScheduleGPipe":
        return []
    microbatches, stages, stage = facts["microbatches"], facts["stages"], facts["stage"]
    in_flight = min(microbatches, stages - stage)
    if microbatches < stages or in_flight >= microbatches or not peak.busy:
        return []  # 1F1B needs a microbatch per stage at least
    return [Remedy(
        "schedule_1f1b", f"the 1F1B pipeline schedule instead of GPipe's ({microbatches}"
        f" microbatches over {stages} stages)", "pipeline", 2,
        "none: the same microbatches and gradients; the schedule interleaves their"
        " forward and backward passes", SEEDS["001_pipeline"],
        f"stage {stage} holds the activations of {in_flight} of the {microbatches}"
        f" microbatches at once, where GPipe holds them all ({in_flight}/{microbatches} of"
        " the activations at the peak remain); each microbatch's receive buffers are kept"
        " either way",
        lambda p: p.scaled({ACTIVATIONS: in_flight / microbatches}, step_too=False),
        "from torch.distributed.pipelining import Schedule1F1B\n"
        f"schedule = Schedule1F1B(stage, {microbatches}, loss_fn=loss_fn)"
        "  # instead of ScheduleGPipe, the same arguments",
        {"schedule": "Schedule1F1B"})]
