"""The advice on the console and as JSON (inside the one report schema)."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from memprof.advise.advice import Advice
from memprof.advise.peak import Peak
from memprof.advise.plan import Ranked
from memprof.advise.verify import BASELINE, DISCARDED, PLAN, Failed, Measured, idle_remedies
from memprof.report.console import CATEGORY_NAMES
from memprof.report.json import SCHEMA
from memprof.report.text import plain, visible
from memprof.report.units import format_bytes as fb


def render(advice: Advice, console: Console, measured: Measured | None = None,
           batch: dict[str, Any] | None = None) -> None:
    """Print the advice: where the run stands, the ranked remedies, the plan, and what
    ``--verify`` and ``--fit-batch`` measured."""
    start, budget = advice.start, advice.budget
    console.print(Text.assemble(("memprof suggest ", "bold"), visible(advice.run.path)))
    console.print(plain(f"Budget: {budget.read_as}"))
    for caveat in (advice.run.out_of_memory, advice.run.failed):
        if caveat:
            console.print(Text(visible(caveat), "bold"))
    where = "predicted for " + advice.run.facts["virtual_gpu"]["spec"] \
        if advice.run.facts.get("virtual_gpu") else advice.run.facts.get("device", "recorded")
    console.print(plain(f"Peak now: {fb(start.reserved)} reserved ({fb(start.allocated)}"
                        f" allocated; {visible(where)})"))
    if advice.run.inferred:
        console.print("Categories inferred from stacks (a snapshot without memprof's labels):"
                      " savings are rougher.")
    gap = start.reserved - budget.bytes
    if gap <= 0 and advice.run.lower_bound:
        ended = "ran out of memory" if advice.run.out_of_memory else "failed"
        console.print(Text(f"Within the budget up to where it {ended}; what it needs after is"
                           " unknown.", "bold red"))
    elif gap <= 0 and advice.reserved_most > budget.bytes:
        console.print(_cache_grew(advice))
    elif gap <= 0:
        console.print(Text(f"Already within the budget, with {fb(-gap)} to spare.", "green"))
    else:
        console.print(Text(f"Over the budget by {fb(gap)}.", "bold red"))
    if advice.ranked:
        console.print(_ranking(advice.ranked, measured,
                               {step.remedy.key for step in advice.plan.steps}))
    if measured is not None:
        console.print(_measured_note(advice, measured))
    if gap > 0:
        console.print(_plan(advice, measured or {}))
    if batch is not None:
        largest, unused = batch["largest"], batch.get("not_reproduced")
        console.print(Text(
            f"\nNo answer for --{batch['arg']}: {unused}" if unused else
            f"\nLargest --{batch['arg']} that fits: {largest}" if largest else
            f"\nNo --{batch['arg']} fits, not even 1", "bold"), f"({batch['runs']} runs)")


def _ranking(ranked: list[Ranked], measured: Measured | None, planned: set[str]) -> Table:
    t = Table(title="Remedies for this run, by bytes saved at the peak (each alone)",
              title_justify="left", header_style="bold", box=None)
    columns = ["remedy", "saves", "peak then", *(["measured peak"] if measured else []),
               "cost"]
    for name in columns:
        t.add_column(name, justify="left" if name in ("remedy", "cost") else "right")
    for r in ranked:
        if (r.remedy.group == "batch" and r.remedy.verify["micro_batch"] > 4
                and r.remedy.key not in planned and r.remedy.key not in (measured or {})):
            continue  # the table keeps to 1/2 and 1/4, what the plan uses and what was measured
        row = [r.remedy.title, fb(r.saved), fb(r.peak.reserved)]
        if measured is not None:
            row.append(_shown(measured, r.remedy.key))
        t.add_row(*row, r.remedy.cost_text.split(":")[0])
    return t


def _shown(measured: Measured, key: str) -> str:
    if key not in measured:
        return "estimate only"
    peak = measured[key]
    if isinstance(peak, Failed):
        return "failed"
    return "out of memory" if peak is None else fb(peak.reserved)


def _measured_note(advice: Advice, measured: Measured) -> Text:
    base = measured.get(BASELINE)
    text = "Measured by re-running the script"
    if isinstance(base, Peak):
        text += f" (as recorded, over the same steps: {fb(base.reserved)} reserved)"
    titles = {r.remedy.key: r.remedy.title for r in advice.ranked}
    failed = {key: m for key, m in measured.items() if isinstance(m, Failed)}
    if advice.plan.steps and PLAN not in measured:
        text += ("; the plan has steps memprof could not apply, so it is estimated only"
                 if any(s.remedy.key in failed for s in advice.plan.steps) else
                 "; the plan has steps memprof cannot apply itself, so it is estimated only")
    if PLAN in measured and advice.plan.steps:
        plan = measured[PLAN]
        text += (f"; the plan's remedies together: {_shown(measured, PLAN)}"
                 f" (estimated {fb(advice.plan.final(advice.start).reserved)})")
        if isinstance(plan, Peak) and isinstance(base, Peak):
            text += f", saving {fb(base.reserved - plan.reserved)}"
    idle = [key for key in idle_remedies(measured) if key in titles]
    left = " (left out of the plan)" if advice.excluded else ""
    worse = [key for key in idle if isinstance(base, Peak)
             and measured[key].reserved > base.reserved]  # type: ignore[union-attr]
    if worse:
        text += (f". The peak rose when memprof applied {', '.join(titles[k] for k in worse)}"
                 f"{left}: what it adds at the peak outweighs what it saves there")
    same = [titles[key] for key in idle if key not in worse]
    if same:
        text += (f". No measured saving when memprof applied {', '.join(same)}{left}: the"
                 " script may already do it or undo it, or what it frees stays in the"
                 " allocator's cache")
    for key, failure in failed.items():
        out = " (left out of the plan)" if key in advice.excluded else ""
        text += f". {titles.get(key, key)} failed{out}: {failure.reason}"
    return Text(text + ".", "dim")


def _cache_grew(advice: Advice) -> Text:
    """The verdict on a run within the budget at its allocation peak whose cache grew past
    the budget later: what its replay under the budget says."""
    grew = (f"the run reserved up to {fb(advice.reserved_most)} after its allocation peak"
            " (its cache grew)")
    replayed = advice.under_budget
    if replayed is None:
        return Text(f"Within the budget at the allocation peak, but {grew}; without a trace"
                    " to replay, whether the allocator frees enough of it is unknown.", "bold")
    if replayed.oom_event_index is None:
        return Text(f"Within the budget: {grew}, but replayed with the budget as the card's"
                    " memory, the allocator frees cached blocks and no request fails.", "green")
    asked = fb(replayed.oom_requested_bytes or 0)
    return Text(f"Over the budget: {grew}, and replayed with the budget as the card's memory"
                f" it runs out of memory asking for {asked} (event"
                f" {replayed.oom_event_index:,}).", "bold red")


def plan_fits(advice: Advice, measured: Measured) -> bool:
    """Whether the plan fits the budget: by its measured peak where ``--verify`` measured
    it (an estimate that fits is not a plan that fits), else by the estimate."""
    peak = measured.get(PLAN)
    if PLAN in measured:
        return isinstance(peak, Peak) and peak.reserved <= advice.budget.bytes
    return advice.plan.fits


def _measured_as(peak: Peak | Failed | None) -> str:
    """How a re-run measured: its peak, or that it ran out of memory or failed."""
    return f"measured at {fb(peak.reserved)}" if isinstance(peak, Peak) else \
        "out of memory when measured" if peak is None else "failed when measured"


def _made_again(advice: Advice, measured: Measured) -> Text:
    """The head of a plan made again from the measured peaks (``verify._replanned``, or
    ``verify._extended``: more remedies, measured in turn where memprof applies them)."""
    gone = " + ".join(s.remedy.title for s in advice.discarded.steps)  # type: ignore[union-attr]
    was = f"the estimated plan, {gone}, was {_measured_as(measured.get(DISCARDED))}"
    budget, steps = fb(advice.budget.bytes), len(advice.plan.steps)
    if PLAN not in measured:
        final = advice.plan.final(advice.start)
        return Text(f"Plan, made again from the measured peaks: {steps} step(s) to fit {budget},"
                    f" estimated at {fb(final.reserved)} ({was}; memprof cannot apply the steps"
                    " added itself, so they are estimated from that measurement)", "bold")
    if plan_fits(advice, measured):
        return Text(f"Plan, made again from the measured peaks: {steps} step(s) to fit {budget},"
                    f" measured at {fb(measured[PLAN].reserved)} ({was})", "bold")  # type: ignore[union-attr]
    return Text(f"The plan was estimated to fit {budget} but does not: {was}, and with more"
                f" remedies {_measured_as(measured[PLAN])}. The plan:", "bold red")


def _plan(advice: Advice, measured: Measured) -> Group:
    plan, parts = advice.plan, []
    if advice.discarded is not None:
        parts.append(_made_again(advice, measured))
    elif plan_fits(advice, measured):
        parts.append(Text(f"Plan: {len(plan.steps)} step(s) to fit {fb(advice.budget.bytes)}",
                          "bold"))
    elif plan.fits:  # estimated to fit, measured over, and nothing measured to fit alone
        parts.append(Text(f"The plan was estimated to fit {fb(advice.budget.bytes)} but"
                          f" {_measured_as(measured[PLAN])}: it does not fit, and no remedy"
                          " measured to fit on its own. The estimated plan:", "bold red"))
    else:
        final = plan.final(advice.start)
        moment = final.moment
        top = max(moment, key=lambda k: moment[k])
        parts.append(Text(
            f"Nothing fits: the smallest reachable peak is {fb(final.reserved)}, with"
            f" {CATEGORY_NAMES[top]} the largest part ({fb(moment[top])}). The steps that reach"
            " it:", "bold red"))
    for i, step in enumerate(plan.steps, 1):
        r = step.remedy
        parts.append(Text(f"\n{i}. {r.title}: peak {fb(step.peak.reserved)} reserved"
                          f" ({r.cost_text})", "bold"))
        parts.append(Text(f"   assumes: {r.assumptions}", "dim"))
        parts.append(Syntax(r.snippet, "python", theme="ansi_dark", background_color="default"))
    return Group(Text(""), *parts)


def as_json(advice: Advice, measured: Measured | None = None,
            batch: dict[str, Any] | None = None) -> dict[str, Any]:
    """The advice in the report schema: ``command: suggest`` and a ``suggest`` entry."""
    verified = measured or {}
    start = advice.start

    def peak(p: Peak | Failed | None) -> dict[str, int] | None:
        return {"reserved_bytes": p.reserved, "allocated_bytes": p.allocated} \
            if isinstance(p, Peak) else None

    def error(key: str) -> str | None:
        failure = verified.get(key)
        return failure.reason if isinstance(failure, Failed) else None

    return {
        "schema": SCHEMA,
        "command": "suggest",
        "source": {"path": str(advice.run.path), "categories_inferred": advice.run.inferred,
                   # a run that ran out of memory: advised from its re-run, or a lower bound
                   "out_of_memory": advice.run.out_of_memory,
                   # a run that raised otherwise: its peak, a lower bound
                   "failed": advice.run.failed, "lower_bound": advice.run.lower_bound},
        "units": "bytes",
        "suggest": {
            "budget": {"bytes": advice.budget.bytes, "read_as": advice.budget.read_as},
            "current": peak(start),
            "fits_now": advice.fits_now,
            "remedies": [{
                "key": r.remedy.key, "title": r.remedy.title, "saved_bytes": r.saved,
                "peak": peak(r.peak), "cost": r.remedy.cost_text, "seed": r.remedy.seed,
                "assumptions": r.remedy.assumptions, "snippet": r.remedy.snippet,
                "measured": peak(verified[r.remedy.key]) if r.remedy.key in verified else None,
                "verified": r.remedy.key in verified and not error(r.remedy.key),
                "verify_error": error(r.remedy.key),
            } for r in advice.ranked],
            "plan": {
                "fits": plan_fits(advice, verified),  # by the measured peak where measured
                "steps": [{"key": s.remedy.key, "peak": peak(s.peak)}
                          for s in advice.plan.steps],
                "peak": peak(advice.plan.final(start)),
                "measured": peak(verified.get(PLAN)),
                "excluded": list(advice.excluded),
                # the estimated plan --verify measured over the budget, made again from the
                # measured peaks; null where it was not
                "discarded": None if advice.discarded is None else {
                    "steps": [s.remedy.key for s in advice.discarded.steps],
                    "measured": peak(verified.get(DISCARDED))},
            },
            "baseline_measured": peak(verified.get(BASELINE)),
            "fit_batch": batch,
        },
    }
