"""The pytest plugin, through pytest's own ``pytester``: marked tests that use too much memory
fail with their top allocation sites; ``--memprof-fail-on-increase`` compares runs."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest_plugins = ["pytester"]

# installed memprof registers the plugin itself; a bare checkout on PYTHONPATH names it
AUTOLOADED = any(e.name == "memprof" for e in entry_points(group="pytest11"))
PLUGIN = () if AUTOLOADED else ("-p", "memprof.pytest_plugin")

TESTS = """
import os
import pytest
import torch

WIDTH = int(os.environ.get("MEMPROF_TEST_WIDTH", "256"))


def make_weights():
    return torch.ones(WIDTH, 1024)  # WIDTH KiB of float32


@pytest.mark.memprof_limit("2 MiB")
def test_small():
    assert make_weights().sum() > 0


@pytest.mark.memprof_limit("512 KiB", metric="peak_allocated")
def test_too_big():
    assert make_weights().sum() > 0


def test_unmarked():
    make_weights()


@pytest.mark.memprof_limit("2 MiB")
def test_host_values_are_real():
    layer = torch.nn.Linear(4, 4)
    torch.nn.init.ones_(layer.weight)
    assert layer.weight.sum().item() == 16


RUNS = []


@pytest.mark.memprof_limit("2 MiB")
def test_runs_once():
    RUNS.append(1)  # a body with a side effect: measured in one run, as pytest runs it
    assert len(RUNS) == 1


@pytest.mark.memprof_limit("512 KiB")
def test_cuda_too_big():
    weights = torch.ones(WIDTH, 1024, device="cuda")
    assert weights.is_cuda
"""


@pytest.fixture(autouse=True, scope="module")
def _measured_once() -> None:
    """Measure once in this process first: pytester's inline runs drop the modules they
    import, and dropping torch's lazily imported modules while hooks hold them crashes."""
    from memprof.gate.measure import Measurement

    measurement = Measurement()
    measurement.start()
    measurement.stop()


def test_the_plugin_is_registered_through_pytest11():
    assert [e.value for e in entry_points(group="pytest11") if e.name == "memprof"] == [
        "memprof.pytest_plugin"]


def test_a_marked_test_over_its_limit_fails_with_its_sites(pytester: pytest.Pytester):
    pytester.makepyfile(test_memory=TESTS)
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(passed=4, failed=2)
    result.stdout.fnmatch_lines([
        "*peak allocated 1.00 MiB exceeds the memprof_limit of 512.00 KiB (host tensors"
        " recorded, CUDA layout predicted: the test made no CUDA tensor)*",
        "*Top allocation sites at the peak:*",
        "*1.00 MiB*test_memory.py:9 make_weights*",
    ])
    # a test that made no CUDA tensor is measured by the host recorder beside the virtual
    # GPU, in its one run; CUDA code on this GPU-less machine runs on the virtual H100
    result.stdout.fnmatch_lines([
        "*test_cuda_too_big*",
        "*peak allocated 1.00 MiB exceeds the memprof_limit of 512.00 KiB (predicted by"
        " memprof for CUDA)*",
        "*1.00 MiB*test_memory.py:44 test_cuda_too_big*",
    ])
    assert "test_small" not in "\n".join(result.stdout.lines).split("short test summary")[-1]


def test_fail_on_increase_compares_with_the_previous_run(pytester: pytest.Pytester,
                                                         monkeypatch: pytest.MonkeyPatch):
    pytester.makepyfile(test_memory=TESTS)
    args = (*PLUGIN, "--memprof-fail-on-increase", "-k", "small")
    monkeypatch.setenv("MEMPROF_TEST_WIDTH", "256")
    pytester.runpytest(*args).assert_outcomes(passed=1)
    monkeypatch.setenv("MEMPROF_TEST_WIDTH", "260")  # +1.6%: within the default 5%
    pytester.runpytest(*args).assert_outcomes(passed=1)
    monkeypatch.setenv("MEMPROF_TEST_WIDTH", "384")
    grown = pytester.runpytest(*args)
    grown.assert_outcomes(failed=1)
    grown.stdout.fnmatch_lines(["*peak allocated: previously used 1.02 MiB, now uses 1.50 MiB"
                                " (limit +5%)*"])
    # the regression did not become the new baseline: rerunning does not make it pass
    pytester.runpytest(*args).assert_outcomes(failed=1)
    monkeypatch.setenv("MEMPROF_TEST_WIDTH", "256")
    pytester.runpytest(*args).assert_outcomes(passed=1)


def test_a_bad_marker_is_a_usage_error(pytester: pytest.Pytester):
    pytester.makepyfile(test_bad="""
import pytest

@pytest.mark.memprof_limit("lots")
def test_x():
    pass
""")
    result = pytester.runpytest(*PLUGIN)
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*memprof_limit: not a size: 'lots'*"])


@pytest.mark.parametrize("marker", ['"lots"', "", '"1MiB", metric="nope"', '["x"]',
                                    '"1MiB", "2MiB"', "None", '"9" * 400', '"1MiB", limit=2'])
def test_a_bad_marker_fails_its_test_in_one_line(pytester: pytest.Pytester, marker: str):
    pytester.makepyfile(test_bad=f"""
import pytest

@pytest.mark.memprof_limit({marker})
def test_x():
    pass
""")
    result = pytester.runpytest(*PLUGIN)
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*memprof_limit*"])
    out = result.stdout.str()
    assert "Traceback" not in out and "raise " not in out and "During handling" not in out


def test_the_marker_is_documented(pytester: pytest.Pytester):
    result = pytester.runpytest(*PLUGIN, "--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.memprof_limit(size, metric='peak_allocated')*"])
