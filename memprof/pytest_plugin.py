"""The pytest plugin: ``@pytest.mark.memprof_limit("512 MiB")`` fails a test that uses more.

Registered through the ``pytest11`` entry point, so installing memprof enables it.
``--memprof-fail-on-increase`` also fails a marked test that uses more than in its
previous run (kept in the pytest cache).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

CACHE_KEY = "memprof/usage"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("memprof", "GPU memory limits (memprof)")
    group.addoption("--memprof-fail-on-increase", action="store_true", default=False,
                    help="Fail a memprof_limit test that uses more memory than in its previous"
                    " run (stored in the pytest cache).")
    group.addoption("--memprof-max-increase", default="5%", metavar="LIMIT",
                    help="Growth allowed by --memprof-fail-on-increase: 5%% or 200MiB"
                    " (default 5%%).")
    group.addoption("--memprof-virtual-gpu", default=None, metavar="SPEC",
                    help="The card a machine without a GPU predicts for: H100, 'A100 40GB',"
                    " 24GiB, ... (default: H100 80GB).")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "memprof_limit(size, metric='peak_allocated'): fail the test when its"
        " memory (peak_allocated, peak_reserved or category:NAME) exceeds size, e.g. '512 MiB'."
        " Measured on the GPU where there is one, else predicted by memprof.")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    marker = item.get_closest_marker("memprof_limit")
    if marker is None:
        return (yield)
    from memprof.gate.measure import Measurement

    limit, metric = _marker_args(marker)
    measurement = Measurement(card=_card(item.config))
    measurement.start()
    try:
        result = yield
    finally:
        report = measurement.stop()
    used = max(metric.value(d) or 0 for d in report["devices"]) if report["devices"] else 0
    problems = _over_limit(used, limit, metric, measurement.backend)
    if item.config.getoption("memprof_fail_on_increase"):
        problems += _increase(item, used, metric)
    if problems:
        pytest.fail("\n".join([*problems, *_sites(report)]), pytrace=False)
    return result


def _card(config: pytest.Config) -> str | None:
    from memprof.collect.virtual.cards import parse_spec

    spec = config.getoption("memprof_virtual_gpu")
    try:
        if spec is not None:
            parse_spec(spec)  # a bad spec is a usage error before any test runs
    except ValueError as exc:
        raise pytest.UsageError(f"--memprof-virtual-gpu: {exc}") from None
    return spec


def _marker_args(marker: pytest.Mark) -> tuple[int, Any]:
    from memprof.gate.metrics import parse_metric
    from memprof.sizes import parse_size

    if len(marker.args) != 1 or set(marker.kwargs) - {"metric"}:
        pytest.fail("memprof_limit takes one size and an optional metric, e.g."
                    " @pytest.mark.memprof_limit('512 MiB', metric='peak_reserved')",
                    pytrace=False)
    try:
        limit = parse_size(str(marker.args[0]))  # an int too: bounded like any size
        return limit, parse_metric(str(marker.kwargs.get("metric", "peak_allocated")))
    except ValueError as exc:
        problem = str(exc)
    pytest.fail(f"memprof_limit: {problem}", pytrace=False)


def _over_limit(used: int, limit: int, metric: Any, backend: str) -> list[str]:
    from memprof.report.units import format_bytes

    if used <= limit:
        return []
    how = {"cuda": "measured on the GPU", "virtual": "predicted by memprof for CUDA",
           "cpu": "host tensors recorded, CUDA layout predicted: the test made no CUDA"
           " tensor"}[backend]
    return [f"{metric.title} {format_bytes(used)} exceeds the memprof_limit of"
            f" {format_bytes(limit)} ({how})"]


def _increase(item: pytest.Item, used: int, metric: Any) -> list[str]:
    """Compare with the previous run in the cache; remember this one unless it regressed."""
    from memprof.gate.metrics import parse_limit
    from memprof.report.units import format_bytes

    try:
        limit = parse_limit(item.config.getoption("memprof_max_increase"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    cache = item.config.cache
    if cache is None:
        return []
    usage = cache.get(CACHE_KEY, {})
    key = f"{item.nodeid} {metric.name}"
    before = usage.get(key)
    if isinstance(before, int) and used - before > limit.allowed(before):
        # the stored figure stays: a regression must not become the new normal by rerunning
        return [f"{metric.title}: previously used {format_bytes(before)}, now uses"
                f" {format_bytes(used)} (limit +{limit.text})"]
    usage[key] = used
    cache.set(CACHE_KEY, usage)
    return []


def _sites(report: dict[str, Any]) -> list[str]:
    from memprof.report.text import visible
    from memprof.report.units import format_bytes

    sites = [s for d in report["devices"] for s in d["top_sites"]]
    if not sites:
        return []
    return ["Top allocation sites at the peak:"] + [
        f"  {format_bytes(s['bytes']):>12}  {visible(s['site'])}" for s in sites[:5]]
