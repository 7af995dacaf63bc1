"""Fuzzing check and suggest with hypothesis: any mutation of a real report.json (a field of
the wrong type, a huge number, a missing key) gives a result, or one line and exit 2;
never a traceback."""

from __future__ import annotations

import copy
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hostile_fuzz import containers
from test_run_cli import SAMPLES, flags, memprof_run
from typer.testing import CliRunner

from memprof.cli.app import app
from memprof.errors import MemprofError

FUZZ = settings(derandomize=True, max_examples=50, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

hostile = st.one_of(
    st.none(), st.booleans(), st.sampled_from([math.nan, math.inf, -1, -(2**40), 2**70,
                                               10**400, 0, 0.5, 1e308]),
    st.integers(), st.text(max_size=6), st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.just([[[[[]]]]]), st.just("a|b\n[x](y)<script>`@all\x1b[2J\x00"),
    st.sampled_from(["x", "peak_allocated", "cuda", "virtual H100 80GB", "completed"]))


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A virtual-GPU run's report (with its model facts) and a CPU recording's."""
    where = tmp_path_factory.mktemp("reports")

    def recorded(name: str, extra: list[str]) -> dict[str, Any]:
        result = memprof_run(where, "-o", name, *extra[:2], SAMPLES / "mlp_adam.py",
                             *flags({"steps": 3}), *extra)
        assert result.code == 0, result.stderr
        return json.loads((where / name / "report.json").read_text())

    with ThreadPoolExecutor(max_workers=2) as pool:  # the two runs at once
        runs = {name: pool.submit(recorded, name, extra)
                for name, extra in (("virtual", []), ("cpu", ["--device", "cpu"]))}
        return {name: run.result() for name, run in runs.items()}


def _mutate(report: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    mutated = copy.deepcopy(report)
    paths = containers(mutated)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        parent: Any = mutated
        try:
            for key in path[:-1]:
                parent = parent[key]
            if data.draw(st.booleans()) and isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent[path[-1]] = data.draw(hostile)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation replaced this path
    return mutated


def _invoke(args: list[str]) -> None:
    """One command in-process: a result (exit 0 or 1) or a MemprofError, nothing else."""
    result = CliRunner().invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        assert isinstance(result.exception, MemprofError), repr(result.exception)
        assert "\n" not in result.exception.message
        return
    assert result.exit_code in (0, 1), result.output


@FUZZ
@given(data=st.data(), which=st.sampled_from(["virtual", "cpu"]))
def test_check_takes_any_report(reports, tmp_path_factory, data, which):
    folder = tmp_path_factory.mktemp("check")
    original, mutated = folder / "original.json", folder / "mutated.json"
    original.write_text(json.dumps(reports[which]))
    mutated.write_text(json.dumps(_mutate(reports[which], data)))
    for fmt in ("text", "markdown", "junit", "json"):
        _invoke(["check", str(mutated), "--baseline", str(original), "--format", fmt])
        _invoke(["check", str(original), "--baseline", str(mutated), "--format", fmt])
    # the page reads both runs alike: one way round is enough
    _invoke(["check", str(mutated), "--baseline", str(original), "--format", "html"])


@FUZZ
@given(data=st.data(), which=st.sampled_from(["virtual", "cpu"]))
def test_suggest_takes_any_report(reports, tmp_path_factory, data, which):
    path = Path(tmp_path_factory.mktemp("suggest")) / "report.json"
    path.write_text(json.dumps(_mutate(reports[which], data)))
    _invoke(["suggest", str(path), "--budget", "1MB"])
    _invoke(["suggest", str(path), "--budget", "1MB", "--gpus", "8", "--json"])


@pytest.mark.parametrize(("field", "value"), [
    ("loss", {"shape": "abc", "dtype": 5, "logits_rows": "x"}),
    ("loss", {"shape": [4, 4096], "dtype": "float32", "logits_rows": -3}),
    ("accumulation", "twice"),
    ("trained_in_eval", ["GPT"]),
    ("parallelism", {"strategies": ["fsdp2"], "meshes": [], "param_dtype": 16}),
])
def test_model_facts_suggest_reads_are_refused_when_wrong(reports, tmp_path, field, value):
    """The model facts the loss, accumulation, precision and checkpointing remedies read,
    of a wrong type or range: the report is refused in one line that names the field."""
    report = copy.deepcopy(reports["virtual"])
    report["run"]["model"][field] = value
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    result = CliRunner().invoke(app, ["suggest", str(path), "--budget", "1MB"])
    assert isinstance(result.exception, MemprofError), repr(result.exception)
    assert f"run.model.{field}" in result.exception.message
    assert "\n" not in result.exception.message
