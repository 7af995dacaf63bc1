"""``--verify``: measure what the remedies memprof can apply itself really save."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memprof.advise.advice import Advice
from memprof.advise.peak import Peak
from memprof.advise.remedies import Remedy
from memprof.advise.rerun import Rerun, value_of, with_arg

BASELINE = "baseline"
PLAN = "plan"


def verifiable(remedy: Remedy, batch_arg: str | None) -> bool:
    """Whether ``--verify`` can apply ``remedy`` (micro-batches need ``--batch-arg``)."""
    return bool(remedy.verify) and ("micro_batch" not in remedy.verify or batch_arg is not None)


def verify(advice: Advice, rerun: Rerun, batch_arg: str | None,
           progress: Callable[[str], None]) -> dict[str, Peak | None]:
    """Re-run the script as recorded (``baseline``), with each verifiable remedy of the
    ranking, and with the whole plan when memprof can apply all its steps (``plan``): their
    peaks (None where a run ran out of memory)."""
    measured: dict[str, Peak | None] = {}
    progress("the run as recorded")
    measured[BASELINE] = rerun.peak()
    for ranked in advice.ranked:
        if verifiable(ranked.remedy, batch_arg):
            progress(ranked.remedy.title)
            measured[ranked.remedy.key] = _run(rerun, [ranked.remedy.verify], batch_arg)
    steps = advice.plan.steps
    if steps and all(verifiable(s.remedy, batch_arg) for s in steps):
        progress("the whole plan")
        measured[PLAN] = _run(rerun, [s.remedy.verify for s in steps], batch_arg)
    return measured


def _run(rerun: Rerun, specs: list[dict[str, Any]], batch_arg: str | None) -> Peak | None:
    apply: dict[str, Any] = {}
    args, conf = None, None
    for spec in specs:
        apply.update({k: v for k, v in spec.items() if k in ("autocast", "checkpoint")})
        if "alloc_conf" in spec:
            conf = ",".join(filter(None, (rerun.alloc_conf, spec["alloc_conf"])))
        if "micro_batch" in spec and batch_arg is not None:
            batch = value_of(rerun.args, batch_arg)
            args = with_arg(rerun.args, batch_arg, max(1, batch // spec["micro_batch"]))
    return rerun.peak(args, apply, conf)
