"""The leak verdict: ``step_growth`` on synthetic step ends, and ``memprof run`` on small scripts.

The verdict must not flip with the number of steps: LBFGS history (bounded by
``history_size``) is never a leak, a list that gains a tensor every step always is.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from conftest import Jobs

from memprof.analysis.findings import BOUNDED, LEAK, NO_GROWTH, NO_STEPS, TOO_FEW_STEPS
from memprof.analysis.steps import MIN_STEPS, step_growth
from tests.test_run_cli import Result, block, memprof_run, report

MIB = 1 << 20
PEAK = 100 * MIB


def test_no_steps() -> None:
    assert step_growth([], PEAK).verdict == NO_STEPS


@pytest.mark.parametrize("n", range(1, MIN_STEPS))
def test_too_few_steps_whatever_the_ends(n: int) -> None:
    growing = step_growth([k * MIB for k in range(n)], PEAK)
    assert (growing.verdict, growing.steps, growing.steps_needed) == (TOO_FEW_STEPS, n, MIN_STEPS)
    assert step_growth([MIB] * n, PEAK).verdict == TOO_FEW_STEPS


def test_steady_growth_through_the_last_steps_is_a_leak() -> None:
    # the first step (optimizer state) grows most and is not counted
    g = step_growth([10 * MIB, 30 * MIB, 32 * MIB, 34 * MIB, 36 * MIB, 38 * MIB], PEAK)
    assert (g.verdict, g.growth_bytes, g.growth_per_step_bytes) == (LEAK, 8 * MIB, 2 * MIB)


def test_leak_tolerates_uneven_steps_within_the_steady_ratio() -> None:
    g = step_growth([0, 10 * MIB, 11 * MIB, 14 * MIB, 16 * MIB], PEAK)
    assert (g.verdict, g.growth_per_step_bytes) == (LEAK, 2 * MIB)


def test_growth_that_stopped_is_bounded() -> None:
    g = step_growth([0, 10 * MIB, 12 * MIB, 14 * MIB, 14 * MIB, 14 * MIB], PEAK)
    assert (g.verdict, g.growth_bytes, g.grew_until_step) == (BOUNDED, 4 * MIB, 4)


def test_growth_that_went_back_down_is_bounded() -> None:
    g = step_growth([0, 10 * MIB, 14 * MIB, 12 * MIB, 13 * MIB, 12 * MIB], PEAK)
    assert (g.verdict, g.growth_bytes, g.grew_until_step) == (BOUNDED, 4 * MIB, 5)


def test_uneven_growth_at_the_end_needs_more_steps() -> None:
    g = step_growth([0, 10 * MIB, 10 * MIB, 10 * MIB, 11 * MIB, 19 * MIB], PEAK)
    assert (g.verdict, g.growth_bytes, g.steps_needed) == (TOO_FEW_STEPS, 9 * MIB, 12)


def test_growth_below_one_percent_of_the_peak_is_no_growth() -> None:
    ends = [0, 10 * MIB, *(10 * MIB + k * 100_000 for k in range(1, 6))]
    assert step_growth(ends, PEAK).verdict == NO_GROWTH
    assert step_growth(ends, PEAK // 10).verdict == LEAK


def test_flat_ends_are_no_growth() -> None:
    g = step_growth([5 * MIB, 9 * MIB, 9 * MIB, 9 * MIB, 9 * MIB], PEAK)
    assert (g.verdict, g.growth_bytes, g.grew_until_step) == (NO_GROWTH, 0, None)
    assert step_growth([0] * MIN_STEPS, 0).verdict == NO_GROWTH


def test_optimizer_state_growth_is_bounded_not_a_leak() -> None:
    ends = [10 * MIB, 20 * MIB, 30 * MIB, 40 * MIB, 50 * MIB]
    state = [0, 10 * MIB, 20 * MIB, 30 * MIB, 40 * MIB]
    assert step_growth(ends, PEAK).verdict == LEAK  # without categories it looks like one
    g = step_growth(ends, PEAK, state)
    assert (g.verdict, g.growth_bytes, g.optimizer_state_growth_bytes, g.grew_until_step) \
        == (BOUNDED, 0, 30 * MIB, 5)


def test_a_leak_beside_growing_optimizer_state_is_still_a_leak() -> None:
    state = [0, 10 * MIB, 20 * MIB, 30 * MIB, 40 * MIB]
    ends = [s + k * 3 * MIB for k, s in enumerate(state)]
    g = step_growth(ends, PEAK, state)
    assert (g.verdict, g.growth_per_step_bytes, g.optimizer_state_growth_bytes) \
        == (LEAK, 3 * MIB, 30 * MIB)


# LBFGS with max_iter=1 adds one history entry per step from step 2 on, up to history_size
HISTORY = 5  # at 5 steps the history still grows: the old verdict called that a leak
LBFGS = f"""\
import torch
m = torch.nn.Linear(256, 256)
opt = torch.optim.LBFGS(m.parameters(), lr=0.1, history_size={HISTORY}, max_iter=1)
x, y = torch.randn(16, 256), torch.randn(16, 256)
def closure():
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(m(x), y)
    loss.backward()
    return loss
for i in range(20):
    opt.step(closure)
"""
FLAT = 256 * 256 + 256  # LBFGS's history vectors hold every parameter, flattened
# each history entry: y and s (flat float32 vectors), and the scalars ro and al
ENTRY = 2 * block(FLAT * 4) + 2 * block(4)

APPEND = """\
import torch
m = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
kept = []
for i in range(20):
    m(torch.randn(32, 64)).sum().backward()
    opt.step(); opt.zero_grad()
    kept.append(torch.randn(256, 64))
"""


def _run(tmp_path: Path, script: str, steps: int) -> tuple[str, dict]:
    (tmp_path / "train.py").write_text(script)
    out = f"out{steps}"
    result = memprof_run(tmp_path, "--device", "cpu", "-o", out, "--steps", str(steps),
                         "train.py")
    assert result.code == 0, result.stderr
    return result.stderr, report(tmp_path / out)["devices"][0]


# --- the runs: started together on first use, each in a folder of its own ----------------

jobs = Jobs()


def _runs_of(name: str, script: str, steps: int) -> None:
    def run(where: Path) -> tuple[str, dict]:
        return _run(where, script, steps)

    run.__name__ = f"{name}{steps}"
    jobs(run)


for _steps in (8, 5, 3):
    _runs_of("lbfgs", LBFGS, _steps)
for _steps in (8, 5):
    _runs_of("append", APPEND, _steps)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Any]]]:
    yield from jobs.started(tmp_path_factory, "steps")


@pytest.mark.parametrize("steps", [3, 5, 8])
def test_lbfgs_history_is_never_a_leak(runs: dict[str, Future[Any]], steps: int) -> None:
    stderr, device = runs[f"lbfgs{steps}"].result()
    growth = device["step_growth"]
    assert device["leak"] is None and "LEAK" not in stderr
    if steps < MIN_STEPS:
        assert growth["verdict"] == TOO_FEW_STEPS and growth["steps_needed"] == MIN_STEPS
        assert f"Too few steps to tell whether memory leaks: {steps} recorded" in stderr
    else:  # one entry after each of steps 2 to HISTORY + 1, then HISTORY entries held
        until = min(steps, HISTORY + 1)
        assert growth == {"verdict": BOUNDED, "steps": steps, "steps_needed": MIN_STEPS,
                          "growth_bytes": 0, "growth_per_step_bytes": 0,
                          "grew_until_step": until,
                          "optimizer_state_growth_bytes": (until - 2) * ENTRY}
        ended = "through the last step" if until == steps else f"stopped after step {until}"
        assert "Bounded growth, not a leak" in stderr and ended in stderr


@pytest.mark.parametrize("steps", [5, 8])
def test_a_list_that_keeps_a_tensor_every_step_is_a_leak(runs: dict[str, Future[Any]],
                                                        steps: int) -> None:
    stderr, device = runs[f"append{steps}"].result()
    per_step = block(256 * 64 * 4)
    assert device["step_growth"]["verdict"] == LEAK
    assert device["step_growth"]["growth_bytes"] == (steps - 2) * per_step
    leak = device["leak"]
    assert (leak["growth_per_step_bytes"], leak["steps"]) == (per_step, steps - 2)
    assert leak["site"]["line"] == 8
    assert "PROBABLE LEAK" in stderr


def _table_rows(peaks: list[int], ends: list[int]) -> list[tuple[str, ...]]:
    from rich.console import Console

    from memprof.analysis.findings import StepPeak
    from memprof.report.console import steps_table

    steps = [StepPeak(k + 1, 0, 0, p, e) for k, (p, e) in enumerate(zip(peaks, ends, strict=True))]
    console = Console(width=100, record=True)
    console.print(steps_table(steps))
    lines = console.export_text().splitlines()[2:]  # past the title and the header
    return [tuple(line.split(maxsplit=1)) for line in lines if line.strip()]


def test_steps_that_read_the_same_share_a_row_and_the_peak_has_its_own() -> None:
    rows = _table_rows([80 * MIB, 87 * MIB, *[87 * MIB] * 39], [12 * MIB] * 41)
    assert [r[0] for r in rows] == ["1", "2", "3–41"]
    assert "← peak" in rows[1][1] and "← peak" not in rows[2][1]


def test_a_peak_after_the_last_step_has_its_own_row_and_no_step_is_marked() -> None:
    """ViT's evaluation after its one training step: its peak is the run's."""
    from rich.console import Console

    from memprof.analysis.findings import StepPeak
    from memprof.report.console import steps_table

    steps = [StepPeak(1, 0, 10, 80 * MIB, 12 * MIB), StepPeak(2, 10, 20, 87 * MIB, 12 * MIB)]
    console = Console(width=100, record=True)
    console.print(steps_table(steps, peak_event=25, peak_bytes=95 * MIB))
    rows = [line.split() for line in console.export_text().splitlines()[2:] if line.strip()]
    assert [r[:2] for r in rows] == [["1", "80.00"], ["2", "87.00"], ["after", "2"]]
    assert "← peak" in " ".join(rows[2]) and "95.00 MiB" in " ".join(rows[2])
    assert not any("←" in " ".join(r) for r in rows[:2])


def test_a_long_run_of_distinct_steps_shows_its_ends_and_its_peak() -> None:
    peaks = [(k + 1) * MIB for k in range(100)]
    peaks[40] = 500 * MIB  # step 41
    rows = _table_rows(peaks, peaks)
    labels = [r[0] for r in rows]
    assert labels[:8] == [str(k) for k in range(1, 9)] and labels[-7:] == [
        str(k) for k in range(94, 101)]
    assert "41" in labels and labels.count("…") == 2 and len(rows) <= 19


GAN = """\
import torch
g, d = torch.nn.Linear(16, 32), torch.nn.Linear(32, 1)
opt_g, opt_d = torch.optim.Adam(g.parameters()), torch.optim.Adam(d.parameters())
for i in range(6):
    fake = g(torch.randn(64, 16))
    d(fake.detach()).mean().backward()  # the discriminator's step
    opt_d.step(); opt_d.zero_grad()
    (-d(fake).mean()).backward()  # then the generator's
    opt_g.step(); opt_g.zero_grad(); opt_d.zero_grad()
    print("iteration", i)
"""


def _gan(where: Path, *args: str) -> tuple[Result, Path]:
    (where / "gan.py").write_text(GAN)
    return memprof_run(where, "--device", "cpu", *args, "gan.py"), where


@jobs
def gan_whole(where: Path) -> tuple[Result, Path]:
    return _gan(where, "-o", "whole")


@jobs
def gan_two(where: Path) -> tuple[Result, Path]:
    return _gan(where, "--steps", "2", "-o", "two")


@jobs
def gan_one(where: Path) -> tuple[Result, Path]:
    return _gan(where, "--steps", "1", "-o", "one")


def test_two_optimizers_make_one_step_per_iteration(runs: dict[str, Future[Any]]) -> None:
    whole, where = runs["gan_whole"].result()
    assert whole.code == 0, whole.stderr
    data = report(where / "whole")
    assert data["run"]["optimizer_steps"] == 6
    ends = [s["end_allocated_bytes"] for s in data["devices"][0]["steps"]]
    assert len(set(ends[1:])) == 1  # no alternation between the two optimizers' steps
    stopped, where = runs["gan_two"].result()
    assert stopped.code == 0 and stopped.stdout.split("\n")[:-1] == ["iteration 0"]
    assert report(where / "two")["run"]["optimizer_steps"] == 2
    # --steps 1: the first iteration whole, the generator's step too
    one, where = runs["gan_one"].result()
    assert one.code == 0 and one.stdout == "", one.stderr
    data = report(where / "one")
    assert data["run"]["optimizer_steps"] == 1
    assert len(data["run"]["model"]["optimizers"]) == 2  # both stepped


def test_step_pace_ends_a_step_per_iteration_of_several_optimizers() -> None:
    from memprof.collect.hooks.step_pace import END, MOVE, StepPace

    class Opt:  # an optimizer, as far as the pace goes: identity and weak references
        pass

    def paced(order: list[Opt]) -> list[str | None]:
        pace = StepPace()
        return [pace.at(o) for o in order]

    a, b, c = Opt(), Opt(), Opt()
    assert paced([a, a, a]) == [END, END, END]
    assert paced([a, b, a, b, a, b]) == [END, MOVE, None, END, None, END]
    assert paced([a, b, c, a, b, c]) == [END, MOVE, MOVE, None, None, END]
    # the script replaces its optimizer (the old one still alive): the new one paces
    assert paced([a, a, b, b, b]) == [END, END, None, END, END]
