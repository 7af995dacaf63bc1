"""A plan fits when its measured peak fits: ``--verify``'s figures overrule the estimate.

The advice is made on a real snapshot; the measurements are given as ``--verify`` records
them (a peak per remedy, ``plan`` for the whole plan), so each case is exact.
"""

from __future__ import annotations

import io

import pytest
from conftest import fixture

from memprof.advise.advice import Advice, advise
from memprof.advise.budget import parse_budget
from memprof.advise.peak import Peak
from memprof.advise.render import plan_fits
from memprof.advise.source import load_run
from memprof.advise.verify import BASELINE, PLAN


@pytest.fixture(scope="module")
def advice() -> Advice:
    run = load_run(fixture("MAGMA27"))
    # a budget the estimated plan reaches: half way between its final peak and the start
    planned = advise(run, parse_budget("1GiB"))
    start = planned.start
    budget = (planned.plan.final(start).reserved + start.reserved) // 2
    found = advise(run, parse_budget(str(budget)))
    assert found.plan.fits and found.plan.steps and found.ranked
    return found


PAGE = 2 << 20  # a peak's reserved bytes are whole 2 MiB segments at least


def _peak(reserved: int) -> Peak:
    peak = Peak({"other": reserved}, {"other": reserved}, 0.0)
    assert peak.reserved == reserved
    return peak


def _under(budget: int) -> int:
    """The largest whole number of segments within ``budget``."""
    return budget // PAGE * PAGE


def test_an_estimated_plan_measured_over_the_budget_does_not_fit(advice: Advice) -> None:
    budget = advice.budget.bytes
    assert plan_fits(advice, {}) is True  # not measured: the estimate stands
    assert plan_fits(advice, {PLAN: _peak(_under(budget))}) is True
    assert plan_fits(advice, {PLAN: _peak(_under(budget) + PAGE)}) is False
    assert plan_fits(advice, {PLAN: None}) is False  # ran out of memory when measured


def test_a_plan_measured_over_the_budget_is_made_again_from_the_measured_peaks(
        advice: Advice) -> None:
    """The estimated plan measured over the budget, two remedies measured alone, one within
    it: the plan is that remedy, fitting by its measured peak (exit 0), and says what the
    estimated plan measured; where none fits alone, the estimated plan stays, not fitting."""
    from rich.console import Console

    from memprof.advise.render import as_json, render
    from memprof.advise.verify import DISCARDED, _replanned

    budget = advice.budget.bytes
    first, second = (r.remedy for r in advice.ranked[:2])
    over, fits = _under(budget) + PAGE, _under(budget)
    measured = {BASELINE: _peak(2 * over), PLAN: _peak(over), first.key: _peak(over),
                second.key: _peak(fits)}
    again = _replanned(advice, measured)
    assert [s.remedy.key for s in again.plan.steps] == [second.key]
    assert again.discarded == advice.plan and measured[DISCARDED].reserved == over
    assert measured[PLAN].reserved == fits and plan_fits(again, measured)
    shown = io.StringIO()
    render(again, Console(file=shown, width=200), measured)
    assert "Plan, made again from the measured peaks: 1 step(s) to fit" in shown.getvalue()
    plan = as_json(again, measured)["suggest"]["plan"]
    assert plan["fits"] and plan["discarded"] == {
        "steps": [s.remedy.key for s in advice.plan.steps],
        "measured": {"reserved_bytes": over, "allocated_bytes": over}}
    # nothing measured within the budget: the estimated plan stays, and does not fit
    none_fit = {**{k: v for k, v in measured.items() if k != DISCARDED}, PLAN: _peak(over),
                second.key: _peak(over)}
    kept = _replanned(advice, none_fit)
    assert kept is advice and not plan_fits(kept, none_fit)


def test_a_batch_flag_left_at_its_default_is_read_from_the_scripts_parser(tmp_path) -> None:
    """``--batch-arg batch`` on a run whose command left ``--batch`` to argparse: its default,
    read from the source (the script is not run to read it)."""
    from test_run_cli import ROOT, SAMPLES

    from memprof.advise.rerun import Rerun, parser_default
    from memprof.errors import MemprofError

    rerun = Rerun([str(SAMPLES / "mlp_adam.py"), "--hidden", "40"], ["--device", "cpu"], None,
                  "", str(ROOT))
    assert rerun.value_of("hidden") == 40  # given
    assert rerun.value_of("batch") == 64  # add_argument("--batch", type=int, default=64)
    with pytest.raises(MemprofError, match="nor does the script's argparse default"):
        rerun.value_of("epochs")
    broken = tmp_path / "broken.py"
    broken.write_text("parser.add_argument('--batch', default=8\n")
    assert parser_default(broken, "batch") is None


@pytest.mark.parametrize(("peak_event", "steps"), [(15, 3), (29, 3), (30, None), (55, None)])
def test_a_rerun_reaches_the_phase_that_held_the_recorded_peak(peak_event: int,
                                                               steps: int | None) -> None:
    """Five recorded steps of ten events each: a peak in the first three is reached by a
    three-step re-run; one after them (an evaluation after training) needs the whole run."""
    from pathlib import Path

    from memprof.advise.rerun import _steps_to_peak
    from memprof.advise.source import Run

    device = {"peak": {"event_index": peak_event},
              "steps": [{"step": i + 1, "start": 10 * i, "end": 10 * i + 10} for i in range(5)]}
    run = Run(Path("report.json"), {"run": {"optimizer_steps": 5}}, device, None, False)
    assert _steps_to_peak(run) == steps


class _Rerun:
    """A re-run whose peak is 64 MiB per unit of --batch: the recorded run used 8."""

    def __init__(self) -> None:
        self.args = ["--batch", "8"]

    def value_of(self, name: str) -> int:
        return 8

    def peak(self, args: list[str]) -> Peak:
        return _peak(64 * PAGE // 2 * int(args[args.index("--batch") + 1]))


@pytest.mark.parametrize(("recorded", "largest"), [(8 * 32 * PAGE, 4), (2 * 8 * 32 * PAGE, None)])
def test_fit_batch_is_not_used_when_the_recorded_value_does_not_reproduce_the_peak(
        recorded: int, largest: int | None) -> None:
    from rich.console import Console

    from memprof.cli.suggest import _fit

    found = _fit(_Rerun(), "batch", 4 * 32 * PAGE, Console(quiet=True), recorded)
    assert found["largest"] == largest
    assert (found["not_reproduced"] is None) == (largest is not None)


def test_every_measured_micro_batch_is_shown(advice: Advice) -> None:
    from rich.console import Console

    from memprof.advise.render import _ranking

    def shown(measured: dict | None) -> str:
        console = Console(width=200, record=True, file=io.StringIO())
        console.print(_ranking(advice.ranked, measured, set()))
        return console.export_text()

    assert "micro-batch 1/8" not in shown(None)  # estimates: 1/2 and 1/4 stand for them
    measured = {BASELINE: _peak(64 * PAGE), "micro_batch_8": _peak(8 * PAGE),
                "micro_batch_16": _peak(6 * PAGE)}
    table = shown(measured)
    assert "micro-batch 1/8" in table and "micro-batch 1/16" in table  # --verify ran them
    assert "16.00 MiB" in table and "12.00 MiB" in table


def test_a_remedy_measured_above_the_run_is_said_to_raise_the_peak(advice: Advice) -> None:
    """--verify measured one remedy above the run as recorded and one at it: the first
    raised the peak, the second saved nothing."""
    from rich.console import Console

    from memprof.advise.render import render

    first, second = (r.remedy for r in advice.ranked[:2])
    base = _under(advice.budget.bytes) + 4 * PAGE
    measured = {BASELINE: _peak(base), first.key: _peak(base + PAGE),
                second.key: _peak(base)}
    shown = io.StringIO()
    render(advice, Console(file=shown, width=400), measured)
    text = shown.getvalue()
    assert f"The peak rose when memprof applied {first.title}" in text
    assert f"No measured saving when memprof applied {second.title}" in text
