"""Fuzzing explain with hypothesis: any mutation of a real snapshot gives a report or the
documented error, never another exception (structure, field types, truncation, corruption)."""

from __future__ import annotations

import copy
import math
import pickle
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memprof.analysis.explain import explain
from memprof.errors import MemprofError
from memprof.trace.load import load_snapshot
from memprof.trace.normalize import NotASnapshot, normalize
from tests.conftest import fixture, load_raw, needs_fixtures

MIB = 1 << 20
FUZZ = settings(derandomize=True, max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def small_real() -> dict:
    """A real snapshot cut to the newest 80 events (as a smaller ring buffer would keep)."""
    raw = load_raw(fixture("HugePandaCoder"))
    raw["device_traces"] = [t[-80:] for t in raw["device_traces"]]
    return raw


hostile = st.one_of(
    st.none(), st.booleans(), st.sampled_from([math.nan, math.inf, -math.inf, 0.5, -1, -(2**40),
                                               2**70, 10**12, 0]),
    st.integers(), st.text(max_size=8), st.binary(max_size=8),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                         max_size=2),
    st.just(((((((),),),),),)), st.just("a[/]b\x1b[2J\n.py"),
    # plausible values: well-formed files whose parts contradict each other
    st.integers(0, 2**34), st.sampled_from([512, 2 * MIB, 20 * MIB]),
    st.sampled_from(["alloc", "free_requested", "free_completed", "segment_alloc",
                     "segment_free", "segment_map", "segment_unmap", "oom", "snapshot",
                     "inactive", "active_allocated", "small", "large"]))


def containers(obj: object, path: tuple = ()) -> list[tuple]:
    """Paths to every dict value and list item under ``obj`` (frames: their first few)."""
    out = []
    items = obj.items() if isinstance(obj, dict) else \
        enumerate(obj[:3]) if isinstance(obj, list) else ()
    for key, value in items:
        out.append((*path, key))
        out.extend(containers(value, (*path, key)))
    return out


def explain_or_refuse(raw: object) -> None:
    try:
        findings = explain(normalize(raw), "fuzzed.pickle")
    except NotASnapshot:
        return
    except MemprofError as exc:
        assert exc.message.startswith("fuzzed.pickle: device 0: the trace contradicts")
        return
    for d in findings.devices:
        assert d.peak_allocated_bytes >= 0 and d.peak_reserved_bytes >= 0


@pytest.fixture(scope="module")
def base() -> dict:
    return small_real()


@pytest.fixture(scope="module")
def paths(base) -> list[tuple]:
    events = [("device_traces", 0, i, key) for i in range(len(base["device_traces"][0]))
              for key in ("action", "addr", "size")]
    return containers(base) + events


@needs_fixtures
@FUZZ
@given(data=st.data())
def test_any_field_of_any_type(base, paths, data):
    raw = copy.deepcopy(base)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        parent = raw
        try:
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = data.draw(hostile)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation replaced this path
    explain_or_refuse(raw)


@needs_fixtures
@FUZZ
@given(data=st.data())
def test_missing_fields_and_structure(base, paths, data):
    raw = copy.deepcopy(base)
    path = data.draw(st.sampled_from(paths))
    parent = raw
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(st.sampled_from([[], {}, [parent], None]))
    explain_or_refuse(raw)


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> bytes:
    return pickle.dumps(small_real(), protocol=4)


@needs_fixtures
@FUZZ
@given(cut=st.integers(0, 10**9), flips=st.lists(st.tuples(st.integers(0, 10**9),
                                                           st.integers(0, 255)), max_size=4))
def test_truncated_and_corrupted_files(small_file, tmp_path_factory, cut, flips):
    data = bytearray(small_file[: 1 + cut % len(small_file)])
    for where, byte in flips:
        data[where % len(data)] = byte
    path = Path(tmp_path_factory.mktemp("fuzz")) / "mutated.pickle"
    path.write_bytes(bytes(data))
    try:
        snapshot = load_snapshot(path)
    except MemprofError as exc:
        assert str(path) in exc.message
        return
    explain(snapshot)
