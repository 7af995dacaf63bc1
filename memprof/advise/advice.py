"""The advice for one run and budget: the ranked remedies and the plan."""

from __future__ import annotations

from dataclasses import dataclass

from memprof.advise.budget import Budget
from memprof.advise.peak import Peak, peak_of
from memprof.advise.plan import Plan, Ranked, plan, rank
from memprof.advise.remedies import Context, catalogue
from memprof.advise.source import Run
from memprof.analysis.findings import WhatIf
from memprof.trace.model import ACTIVATIONS, AUTOCAST_HALF, PARAMETERS, TEMPORARIES


@dataclass(frozen=True)
class Advice:
    """What ``memprof suggest`` answers."""

    run: Run
    budget: Budget
    start: Peak
    ranked: list[Ranked]
    plan: Plan
    context: Context
    excluded: tuple[str, ...] = ()  # remedies --verify measured saving nothing or failed
    # the estimated plan, where --verify measured it over the budget and made the plan again
    # from the measured peaks (one remedy measured to fit alone)
    discarded: Plan | None = None
    # the run's trace replayed with the budget as the device's memory, where the run
    # reserved more than the budget only after its allocation peak (its cache grew)
    under_budget: WhatIf | None = None

    @property
    def reserved_most(self) -> int:
        """The most the run reserved, at its allocation peak or later (a cache that grew)."""
        return max(self.start.reserved, int(self.run.device["peak"]["reserved_bytes"]))

    @property
    def fits_now(self) -> bool:
        """Whether the run as it is fits the budget: it never reserved more, or replayed
        under the budget no request fails (an out-of-memory run's peak, a lower bound,
        never fits: what it needs is unknown)."""
        if self.run.lower_bound or self.start.reserved > self.budget.bytes:
            return False
        return self.reserved_most <= self.budget.bytes or (
            self.under_budget is not None and self.under_budget.oom_event_index is None)


def advise(run: Run, budget: Budget, gpus: int = 1) -> Advice:
    """Rank the remedies that apply to ``run`` and plan a fit under ``budget``."""
    start = peak_of(run.device)
    ctx = Context(run.model, gpus, int(run.facts.get("world_size") or 1),
                  _expandable_ratio(run, start), run.device.get("leak"), _block_shares(run),
                  _autocast_share(run),
                  int((run.device.get("category_peaks") or {}).get(PARAMETERS, 0)),
                  _capability(run) >= (8, 0))
    remedies = catalogue(start, ctx)
    later = start.reserved <= budget.bytes < int(run.device["peak"]["reserved_bytes"])
    return Advice(run, budget, start, rank(start, remedies), plan(start, remedies, budget.bytes),
                  ctx, under_budget=_replayed(run, budget.bytes) if later else None)


def _capability(run: Run) -> tuple[int, int]:
    """The compute capability of the card the run ran on: the virtual card's, a GPU's
    that memprof's card table knows by name; (8, 0) where unknown (bf16 taken as native)."""
    from memprof.collect.virtual.cards import parse_spec

    virtual, cuda = run.facts.get("virtual_gpu"), run.facts.get("cuda")
    known = virtual.get("capability") if isinstance(virtual, dict) else None
    if isinstance(known, list) and len(known) == 2 and all(type(v) is int for v in known):
        return known[0], known[1]
    try:
        return parse_spec(str(cuda["name"])).capability if isinstance(cuda, dict) else (8, 0)
    except (KeyError, ValueError):
        return 8, 0


def _block_shares(run: Run) -> dict[str, float] | None:
    """The share of the peak's activations and temporaries that repeated blocks held."""
    held, inside = run.device.get("categories") or {}, run.device.get("categories_in_blocks")
    if not isinstance(inside, dict):
        return None
    return {k: inside.get(k, 0) / held[k] if held.get(k) else 1.0
            for k in (ACTIVATIONS, TEMPORARIES)}


def _autocast_share(run: Run) -> float | None:
    """Of the activations at their own peak, the share autocast would keep in bf16 (None
    where the run's operators were not traced)."""
    half = (run.device.get("tagged") or {}).get(AUTOCAST_HALF)
    peak = (run.device.get("category_peaks") or {}).get(ACTIVATIONS)
    if not run.model.get("ops_traced") or not half or not peak:
        return None
    return min(1.0, half["at_activations_peak_bytes"] / peak)


def _replayed(run: Run, limit: int) -> WhatIf | None:
    """The run's trace replayed with ``limit`` bytes for PyTorch (None without a trace)."""
    if run.snapshot is None:
        return None
    from memprof.analysis.explain import explain
    from memprof.trace.load import load_snapshot

    findings = explain(load_snapshot(run.snapshot), str(run.snapshot), top=1,
                       device_memory=limit)
    device = next((d for d in findings.devices if d.device == run.device["device"]), None)
    what_ifs = device.replay.what_if if device is not None and device.replay else []
    return what_ifs[0] if what_ifs else None


def _expandable_ratio(run: Run, start: Peak) -> float | None:
    """The cache per allocated byte at the peak if the run's trace is replayed with
    expandable segments (None when the run has no trace or uses them already)."""
    conf = str(run.report.get("source", {}).get("allocator_conf") or "")
    if run.snapshot is None or "expandable_segments:true" in conf.lower().replace(" ", ""):
        return None
    from memprof.analysis.explain import explain
    from memprof.analysis.settings import parse_alloc_conf
    from memprof.trace.load import load_snapshot

    settings = parse_alloc_conf(",".join(filter(None, (conf, "expandable_segments:True"))))
    findings = explain(load_snapshot(run.snapshot), str(run.snapshot), top=1,
                       what_ifs=[settings])
    device = next((d for d in findings.devices if d.device == run.device["device"]), None)
    what_ifs = device.replay.what_if if device is not None and device.replay else []
    if not what_ifs or not what_ifs[-1].peak_allocated_bytes:
        return None
    w = what_ifs[-1]
    return max(0.0, w.peak_reserved_bytes / w.peak_allocated_bytes - 1)
