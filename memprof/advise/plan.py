"""Rank the remedies, and plan the cheapest combination that fits a budget."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from memprof.advise.peak import Peak
from memprof.advise.remedy import Remedy


@dataclass(frozen=True)
class Ranked:
    """A remedy applied alone to the run's peak."""

    remedy: Remedy
    peak: Peak
    saved: int  # reserved bytes saved at the peak


@dataclass(frozen=True)
class Step:
    """One step of a plan and the peak once it (and the steps before it) are applied."""

    remedy: Remedy
    peak: Peak


@dataclass(frozen=True)
class Plan:
    """The steps, in order; ``fits`` says whether the last peak is within the budget."""

    steps: list[Step]
    fits: bool

    def final(self, start: Peak) -> Peak:
        return self.steps[-1].peak if self.steps else start


def rank(start: Peak, remedies: list[Remedy]) -> list[Ranked]:
    """Each remedy alone, most bytes saved first (remedies that save nothing are dropped)."""
    ranked = []
    for remedy in remedies:
        peak = remedy.change(start)
        if peak.reserved < start.reserved:
            ranked.append(Ranked(remedy, peak, start.reserved - peak.reserved))
    return sorted(ranked, key=lambda r: (-r.saved, r.remedy.cost))


def plan(start: Peak, remedies: list[Remedy], budget: int) -> Plan:
    """The cheapest set of remedies (at most one per group) whose peak fits ``budget``,
    applied cheapest first with the peak recomputed after each; when none fits, the set
    that reaches the smallest peak."""
    if start.reserved <= budget:
        return Plan([], True)
    groups: dict[str, list[Remedy | None]] = {}
    for remedy in remedies:
        groups.setdefault(remedy.group, [None]).append(remedy)
    best: tuple[tuple[int, int], list[Remedy]] | None = None
    smallest: tuple[int, int, list[Remedy]] | None = None
    for combo in itertools.product(*groups.values()):
        chosen = sorted((r for r in combo if r is not None), key=lambda r: r.cost)
        peak = _applied(start, chosen)
        score = (sum(r.cost for r in chosen), peak.reserved)
        if peak.reserved <= budget and (best is None or score < best[0]):
            best = (score, chosen)
        if smallest is None or (peak.reserved, score[0]) < smallest[:2]:
            smallest = (peak.reserved, score[0], chosen)
    chosen = best[1] if best is not None else smallest[2] if smallest else []
    steps, peak = [], start
    for remedy in chosen:
        peak = remedy.change(peak)
        steps.append(Step(remedy, peak))
    return Plan(steps, best is not None)


def _applied(start: Peak, remedies: list[Remedy]) -> Peak:
    peak = start
    for remedy in remedies:
        peak = remedy.change(peak)
    return peak
