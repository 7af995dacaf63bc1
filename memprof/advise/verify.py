"""``--verify``: measure what the remedies memprof can apply itself really save.

A remedy whose re-run fails is shown as failed, with why, and the others are still
measured; one that measurably saves nothing leaves the plan, which is made again without it.
A plan measured over the budget is made again from the measured peaks: the cheapest remedy
measured to fit alone, or else the plan with more remedies, estimated from its measured
peak (and measured in turn where memprof can apply them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from memprof.advise.advice import Advice
from memprof.advise.peak import Peak
from memprof.advise.plan import Plan, Step, plan
from memprof.advise.remedy import Remedy
from memprof.advise.rerun import Rerun
from memprof.errors import MemprofError

BASELINE = "baseline"
PLAN = "plan"
DISCARDED = "discarded_plan"  # the estimated plan, measured over the budget (_replanned)
REPRODUCED = 0.05  # a re-run as recorded within this share of the recorded peak reproduces it


@dataclass(frozen=True)
class Failed:
    """A re-run that did not finish: no measurement."""

    reason: str


# a peak, None where the re-run ran out of memory, or why it failed
Measured = dict[str, Peak | Failed | None]


def verifiable(remedy: Remedy, batch_arg: str | None) -> bool:
    """Whether ``--verify`` can apply ``remedy`` (micro-batches need ``--batch-arg``)."""
    return bool(remedy.verify) and ("micro_batch" not in remedy.verify or batch_arg is not None)


def verify(advice: Advice, rerun: Rerun, batch_arg: str | None,
           progress: Callable[[str], None]) -> tuple[Advice, Measured]:
    """Re-run the script as recorded (``baseline``; its failure is an error), with each
    verifiable remedy of the ranking, and with the whole plan when memprof can apply all
    its steps (``plan``). Returns the advice, its plan made again without the remedies
    that measured no saving or failed (``Advice.excluded``), and the measurements."""
    if batch_arg is not None:  # a flag neither set nor defaulted: one error, before any run
        advice = _within_batch(advice, rerun.value_of(batch_arg))
    measured: Measured = {}
    progress("the run as recorded")
    measured[BASELINE] = rerun.peak()
    for ranked in advice.ranked:
        if verifiable(ranked.remedy, batch_arg):
            progress(ranked.remedy.title)
            measured[ranked.remedy.key] = attempt(rerun, [ranked.remedy.verify], batch_arg)
    # what measured no saving, and what the script could not run with, is not planned
    idle = (*idle_remedies(measured), *(k for k, m in measured.items() if isinstance(m, Failed)))
    if any(step.remedy.key in idle for step in advice.plan.steps):
        kept = [r.remedy for r in advice.ranked if r.remedy.key not in idle]
        advice = replace(advice, plan=plan(advice.start, kept, advice.budget.bytes),
                         excluded=idle)
    if _applicable(advice.plan, measured, batch_arg):
        progress("the whole plan")
        measured[PLAN] = _whole(advice.plan, rerun, batch_arg)
    advice = _replanned(advice, measured)
    extended = _extended(advice, measured)
    if extended is not None:  # the measured plan and more remedies, estimated from it
        advice, measured[DISCARDED] = extended, measured.pop(PLAN)
        if _applicable(advice.plan, measured, batch_arg):
            progress("the plan with more remedies")
            measured[PLAN] = _whole(advice.plan, rerun, batch_arg)
    return advice, measured


def _applicable(planned: Plan, measured: Measured, batch_arg: str | None) -> bool:
    """Whether memprof can apply every step of ``planned`` (none failed alone)."""
    return bool(planned.steps) and all(
        verifiable(s.remedy, batch_arg) and not isinstance(measured.get(s.remedy.key), Failed)
        for s in planned.steps)


def _whole(planned: Plan, rerun: Rerun, batch_arg: str | None) -> Peak | Failed | None:
    return attempt(rerun, [s.remedy.verify for s in planned.steps], batch_arg)


def _extended(advice: Advice, measured: Measured) -> Advice | None:
    """``advice`` whose plan, measured over the budget with no remedy measured to fit
    alone, gets the remedies of the groups it lacks that fit the budget from its measured
    peak (those that measured no saving or failed left out); None where none do."""
    whole, budget = measured.get(PLAN), advice.budget.bytes
    if advice.discarded is not None or not isinstance(whole, Peak) or whole.reserved <= budget:
        return None
    groups = {s.remedy.group for s in advice.plan.steps}
    others = [r.remedy for r in advice.ranked if r.remedy.group not in groups
              and r.remedy.key not in advice.excluded
              and not isinstance(measured.get(r.remedy.key), Failed)]
    more = plan(whole, others, budget)
    if not more.fits or not more.steps:
        return None
    *before, last = advice.plan.steps  # the plan's last step as measured, then the rest
    return replace(advice, plan=Plan([*before, replace(last, peak=whole), *more.steps], True),
                   discarded=advice.plan)


def _replanned(advice: Advice, measured: Measured) -> Advice:
    """``advice`` whose plan, measured over the budget, is made again from the measured
    peaks: the cheapest remedy measured to fit alone (``measured[PLAN]`` then its peak,
    ``measured[DISCARDED]`` the estimated plan's); unchanged where none fits alone."""
    budget, whole = advice.budget.bytes, measured.get(PLAN)
    if PLAN not in measured or (isinstance(whole, Peak) and whole.reserved <= budget):
        return advice
    fitting = [(r, peak) for r in advice.ranked
               if isinstance(peak := measured.get(r.remedy.key), Peak) and peak.reserved <= budget]
    if not fitting:
        return advice
    chosen, peak = min(fitting, key=lambda pair: (pair[0].remedy.cost, pair[1].reserved))
    measured[DISCARDED], measured[PLAN] = whole, peak
    return replace(advice, plan=Plan([Step(chosen.remedy, chosen.peak)], True),
                   discarded=advice.plan)


def _within_batch(advice: Advice, batch: int) -> Advice:
    """``advice`` without the micro-batches smaller than one sample of a batch of
    ``batch``, its plan made again if it used one."""
    fewer = [r for r in advice.ranked if r.remedy.verify.get("micro_batch", 0) <= batch]
    if len(fewer) == len(advice.ranked):
        return advice
    return replace(advice, ranked=fewer, plan=plan(
        advice.start, [r.remedy for r in fewer], advice.budget.bytes))


def measure_remedies(remedies: list[Remedy], rerun: Rerun, progress: Callable[[str], None]
                     ) -> Measured:
    """Re-run with each of ``remedies`` alone (``--gpus N`` of a distributed run: the world
    of N ranks), without the rest of ``--verify``."""
    measured: Measured = {}
    for remedy in remedies:
        progress(remedy.title)
        measured[remedy.key] = attempt(rerun, [remedy.verify], None)
    return measured


def unreproduced(recorded: int, again: Peak | Failed | None, as_recorded: str) -> str | None:
    """Why the re-runs measure something else than the run (``again``: the re-run
    ``as_recorded``, of a recorded peak of ``recorded`` reserved bytes): its peak is not
    within ``REPRODUCED`` of the run's (a phase the re-runs do not reach, an environment
    a launcher gave the run). None when it reproduces the run, or could not say."""
    from memprof.report.units import format_bytes

    if not isinstance(again, Peak) or abs(again.reserved - recorded) <= REPRODUCED * recorded:
        return None
    return (f"the re-run {as_recorded} measured {format_bytes(again.reserved)} where the run"
            f" recorded {format_bytes(recorded)}: the re-runs do not reproduce the run (a"
            " phase they do not reach, or what its launcher set, such as accelerate"
            " launch's configuration)")


def idle_remedies(measured: Measured) -> list[str]:
    """The remedies whose measured peak is no lower than the baseline's."""
    base = measured.get(BASELINE)
    if not isinstance(base, Peak):
        return []
    return [key for key, peak in measured.items() if key not in (BASELINE, PLAN, DISCARDED)
            and isinstance(peak, Peak) and peak.reserved >= base.reserved]


def attempt(rerun: Rerun, specs: list[dict[str, Any]], batch_arg: str | None
            ) -> Peak | Failed | None:
    """The peak of a re-run with the remedies ``specs`` applied (none: as recorded), None
    where it ran out of memory, or why it failed."""
    try:
        return _run(rerun, specs, batch_arg)
    except MemprofError as exc:
        return Failed(exc.message)


def _run(rerun: Rerun, specs: list[dict[str, Any]], batch_arg: str | None) -> Peak | None:
    apply: dict[str, Any] = {}
    args, conf, world = None, None, None
    for spec in specs:
        apply.update({k: v for k, v in spec.items()
                      if k in ("autocast", "checkpoint", "chunked_loss", "bucket_view", "shard",
                               "units", "offload", "flat_mesh", "schedule", "zero_buckets",
                               "foreach", "attention_weights")})
        world = spec.get("world", world)
        if "alloc_conf" in spec:
            conf = ",".join(filter(None, (rerun.alloc_conf, spec["alloc_conf"])))
        if "micro_batch" in spec and batch_arg is not None:
            batch = rerun.value_of(batch_arg)
            args = rerun.with_value(batch_arg, batch // spec["micro_batch"])
    if "autocast" in apply and rerun.on_cpu:
        apply["autocast_device"] = "cpu"  # the recording's CPU tensors stand in for CUDA's
    return rerun.peak(args, apply, conf, world)
