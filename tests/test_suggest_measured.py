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


class Measuring:
    """A ``Rerun`` whose re-runs measure given peaks, by the remedies applied (``alloc``:
    allocator settings), and which counts them."""

    alloc_conf, on_cpu, args = "", False, []

    def __init__(self, peaks: dict[tuple[str, ...], Peak]) -> None:
        self.peaks, self.runs = peaks, []

    def peak(self, args=None, apply=None, conf=None, world=None) -> Peak:
        key = tuple(sorted(apply or {})) + (("alloc",) if conf else ())
        self.runs.append(key)
        return self.peaks[key]


def _over(peak: Peak, budget: int) -> Peak:
    """``peak`` with bytes the estimate missed: 8 MiB allocated over ``budget``."""
    from dataclasses import replace

    extra = budget - peak.reserved + (8 << 20)
    more = {"other": peak.at_peak["other"] + extra}
    over = replace(peak, at_peak={**peak.at_peak, **more},
                   at_step={**peak.at_step, "other": peak.at_step["other"] + extra})
    assert over.reserved > budget
    return over


@pytest.mark.parametrize("together_fits", [True, False])
def test_a_plan_measured_over_the_budget_gets_more_remedies_estimated_from_its_peak(
        advice: Advice, together_fits: bool) -> None:
    """The estimated plan (autocast) measured over the budget, no remedy measured to fit
    alone: the plan made again from its measured peak adds the cheapest remedy of another
    group that fits (expandable segments), and that plan is measured in turn; it fits only
    when that measurement does."""
    from rich.console import Console

    from memprof.advise.render import as_json, render
    from memprof.advise.verify import DISCARDED, verify

    budget, start = advice.budget.bytes, advice.start
    assert [s.remedy.key for s in advice.plan.steps] == ["autocast"]
    over = _over(advice.plan.final(start), budget)
    below = _peak(_under(start.reserved) - PAGE)  # saves, but not enough alone
    together = _peak(_under(budget) if together_fits else _under(budget) + PAGE)
    rerun = Measuring({(): start, ("autocast",): over, ("alloc",): below,
                       ("autocast", "alloc"): together})
    again, measured = verify(advice, rerun, None, lambda _: None)  # type: ignore[arg-type]
    assert rerun.runs == [(), ("autocast",), ("alloc",), ("autocast",), ("autocast", "alloc")]
    steps = again.plan.steps
    assert [s.remedy.key for s in steps] == ["autocast", "expandable_segments"]
    # the step added is estimated from the measured plan, not from the estimate
    assert steps[0].peak == over  # the plan's steps as measured together
    assert steps[1].peak == steps[1].remedy.change(over) and steps[1].peak.reserved <= budget
    assert again.discarded == advice.plan and measured[DISCARDED] == over
    assert measured[PLAN] == together and plan_fits(again, measured) is together_fits
    shown = io.StringIO()
    render(again, Console(file=shown, width=300), measured)
    assert ("Plan, made again from the measured peaks: 2 step(s) to fit" if together_fits
            else "does not: the estimated plan, ") in shown.getvalue()
    plan = as_json(again, measured)["suggest"]["plan"]
    assert plan["fits"] is together_fits and plan["discarded"]["steps"] == ["autocast"]


def test_more_remedies_memprof_cannot_apply_are_estimated_from_the_measured_plan(
        advice: Advice) -> None:
    """The plan measured far over the budget: the remedy added is a micro-batch, which
    ``--verify`` applies only with ``--batch-arg``; the plan is estimated from the measured
    peak, and says so."""
    from rich.console import Console

    from memprof.advise.render import render
    from memprof.advise.verify import DISCARDED, verify

    budget, start = advice.budget.bytes, advice.start
    over = _over(advice.plan.final(start), budget + (start.reserved - budget) // 4)
    rerun = Measuring({(): start, ("autocast",): over, ("alloc",): over})
    again, measured = verify(advice, rerun, None, lambda _: None)  # type: ignore[arg-type]
    assert rerun.runs == [(), ("autocast",), ("alloc",), ("autocast",)]  # nothing more to run
    added = again.plan.steps[1:]
    assert [s.remedy.group for s in added] == ["batch"] and PLAN not in measured
    assert measured[DISCARDED] == over and added[-1].peak.reserved <= budget
    assert plan_fits(again, measured)  # by the estimate, as any plan not measured
    shown = io.StringIO()
    render(again, Console(file=shown, width=300), measured)
    assert "estimated from that measurement" in shown.getvalue()


def test_a_batch_flag_left_at_its_default_is_read_from_the_scripts_parser(tmp_path) -> None:
    """``--batch-arg batch`` on a run whose command left ``--batch`` to argparse: its default,
    read from the source (the script is not run to read it)."""
    from test_run_cli import ROOT, SAMPLES

    from memprof.advise.rerun import Rerun
    from memprof.advise.script_flags import parser_default
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


def test_a_batch_flag_is_read_and_set_under_any_of_its_aliases(tmp_path) -> None:
    """pytorch/examples' imagenet: ``add_argument('-b', '--batch-size', default=256)``, run
    with ``-b 32``: the batch is 32, and a re-run sets ``-b``, not an appended
    ``--batch-size`` that the script's ``-b`` would lose to or win over by position."""
    from memprof.advise.rerun import Rerun

    script = tmp_path / "main.py"
    script.write_text("import argparse\nparser = argparse.ArgumentParser()\n"
                      "parser.add_argument('-b', '--batch-size', default=256, type=int)\n")

    def rerun(*args: str) -> Rerun:
        return Rerun([str(script), "--dummy", *args], ["--device", "cpu"], None, "",
                     str(tmp_path))

    assert rerun("-b", "32").value_of("batch-size") == 32
    assert rerun("-b", "32").with_value("batch-size", 8) == ["--dummy", "-b", "8"]
    assert rerun("-b32").value_of("batch-size") == 32
    assert rerun("-b32").with_value("batch-size", 8) == ["--dummy", "-b8"]
    assert rerun("--batch-size=64").with_value("batch-size", 8) == ["--dummy", "--batch-size=8"]
    assert rerun("-b", "32").value_of("b") == 32  # --batch-arg b names the short flag
    assert rerun().value_of("batch-size") == 256  # the default, read from the source
    assert rerun().with_value("batch-size", 8) == ["--dummy", "--batch-size", "8"]


def test_a_hydra_override_is_a_batch_flag_too(tmp_path) -> None:
    """minGPT-ddp's ``trainer_config.batch_size=32``: the key is the flag."""
    from memprof.advise.rerun import Rerun

    rerun = Rerun(["main.py", "data_config.path=x", "trainer_config.batch_size=32"],
                  ["--virtual-gpu", "T4"], None, "", str(tmp_path))
    assert rerun.value_of("trainer_config.batch_size") == 32
    assert rerun.with_value("trainer_config.batch_size", 8) == [
        "data_config.path=x", "trainer_config.batch_size=8"]


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


def test_a_run_that_ended_on_its_own_after_few_steps_is_re_run_to_its_end() -> None:
    """A dry run of one iteration (a GAN's two optimizers, then an evaluation): a re-run
    stopped after that step would cut what came after it; one stopped by --steps 2 is
    re-run for as many."""
    from pathlib import Path

    from memprof.advise.rerun import _steps_to_peak
    from memprof.advise.source import Run

    device = {"peak": {"event_index": 5}, "steps": [{"step": 1, "start": 0, "end": 10}]}
    ended = Run(Path("report.json"), {"run": {"optimizer_steps": 1, "stopped_by": None}},
                device, None, False)
    assert _steps_to_peak(ended) is None
    stopped = Run(Path("report.json"), {"run": {"optimizer_steps": 2, "stopped_by": "steps"}},
                  device, None, False)
    assert _steps_to_peak(stopped) == 2


class _Rerun:
    """A re-run whose peak is 64 MiB per unit of --batch: the recorded run used 8."""

    def __init__(self) -> None:
        self.args = ["--batch", "8"]

    def value_of(self, name: str) -> int:
        return 8

    def with_value(self, name: str, value: int) -> list[str]:
        return [f"--{name}", str(value)]

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
