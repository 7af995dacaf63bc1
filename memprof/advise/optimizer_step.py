"""The optimizer step's own temporaries, fewer: ``foreach=False``.

PyTorch's optimizers take their ``foreach`` path on CUDA by default: each of its operators
makes a list of intermediates as large as every parameter it updates at once (Adadelta's,
Adam's square roots and quotients). With ``foreach=False`` the step loops over the
parameters, and what it makes at once is one parameter's: the largest. Offered where the
step is the peak and its temporaries weigh.
"""

from __future__ import annotations

from dataclasses import replace

from memprof.advise.peak import Peak
from memprof.advise.remedy import SEEDS, Context, Remedy
from memprof.trace.model import TEMPORARIES

STEP_SHARE = 0.05  # the step's temporaries under this share of the peak: not worth it
# torch.optim's optimizers that take foreach=
FOREACH_OPTIMIZERS = frozenset((
    "Adam", "AdamW", "SGD", "Adadelta", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop",
    "Rprop", "ASGD"))


def step_remedies(peak: Peak, ctx: Context) -> list[Remedy]:
    """The remedies of this module that apply to the run."""
    opt, numels = ctx.optimizer, ctx.model.get("trainable_numels") or []
    held = peak.at_step[TEMPORARIES]
    name = str(opt.get("class", ""))
    if name not in FOREACH_OPTIMIZERS or opt.get("fused") or opt.get("foreach") is False \
            or not numels or held < STEP_SHARE * peak.allocated:
        return []
    share = max(numels) / sum(numels)

    def looped(p: Peak) -> Peak:
        return replace(p, at_step={**p.at_step, TEMPORARIES: int(p.at_step[TEMPORARIES] * share)})

    made = f"torch.optim.{name}(model.parameters(), lr=lr, foreach=False)"
    return [Remedy(
        "foreach_off", f"{name} with foreach=False: its step one parameter at a time", "step",
        4, "time: a slower step (kernels per parameter, not per list)", SEEDS["003_stages"],
        f"the step's temporaries ({held:,} bytes at the peak) are made for one parameter at a"
        f" time, the largest: {share:.1%} of the trainable parameters",
        looped,
        f"# the Trainer builds the optimizer: give it one made so\nTrainer(...,"
        f" optimizers=({made}, None))" if ctx.trainer else f"optimizer = {made}",
        {"foreach": False})]
