"""``memprof explain`` on every real snapshot: the numbers a user would check."""

from __future__ import annotations

import pytest

from memprof.analysis.explain import explain
from memprof.trace import load_snapshot
from memprof.trace.model import CATEGORIES
from tests.conftest import fixture, fixture_files, fixture_id, load_raw, needs_fixtures
from tests.independent import peak_allocated

pytestmark = needs_fixtures
FILES = fixture_files()


@pytest.fixture(scope="module", params=FILES, ids=[fixture_id(p) for p in FILES])
def analysed(request):
    path = request.param
    snapshot = load_snapshot(path)
    return path, snapshot, explain(snapshot, str(path))


def test_peak_equals_an_independent_computation(analysed):
    path, _, findings = analysed
    raw = load_raw(path)
    raw = raw if isinstance(raw, dict) else {"segments": raw}
    for d in findings.devices:
        peak, end = peak_allocated(raw, d.device)
        assert d.peak_allocated_bytes == peak
        assert d.end_allocated_bytes == end


def test_end_state_equals_the_segments(analysed):
    path, _, findings = analysed
    raw = load_raw(path)
    segments = raw["segments"] if isinstance(raw, dict) else raw
    for d in findings.devices:
        mine = [s for s in segments if s["device"] == d.device]
        assert d.end_allocated_bytes == sum(s["allocated_size"] for s in mine)
        assert d.end_reserved_bytes == sum(s["total_size"] for s in mine)
        assert d.peak_allocated_bytes >= d.end_allocated_bytes
        assert d.peak_reserved_bytes >= d.end_reserved_bytes


def test_categories_sum_to_the_peak(analysed):
    path, _, findings = analysed
    raw = load_raw(path)
    labelled = isinstance(raw, dict) and "memprof" in raw  # recorded under memprof run
    for d in findings.devices:
        assert set(d.at_peak.categories) == set(CATEGORIES)
        assert sum(d.at_peak.categories.values()) == d.peak_allocated_bytes
        assert d.categories_inferred is not labelled
        assert sum(s.bytes for s in d.at_peak.sites) <= d.peak_allocated_bytes


def test_every_device_with_data_is_reported(analysed):
    path, _, findings = analysed
    raw = load_raw(path)
    segments = raw["segments"] if isinstance(raw, dict) else raw
    assert {s["device"] for s in segments} <= {d.device for d in findings.devices}


def test_the_oom_request_is_reported():
    path = fixture("Constructor-Sun")
    raw = load_raw(path)
    findings = explain(load_snapshot(path), str(path))
    for device, events in enumerate(raw["device_traces"]):
        if not events:
            continue
        ooms = [e for e in events if e["action"] == "oom"]
        reported = next(d for d in findings.devices if d.device == device).ooms
        assert [o.requested_bytes for o in reported] == [e["size"] for e in ooms]
        assert [o.device_free_bytes for o in reported] == [e["device_free"] for e in ooms]
    oom = next(d for d in findings.devices if d.ooms).ooms[0]
    # the request is bigger than everything cached: a real shortage, not fragmentation
    assert oom.cached_free_bytes < oom.requested_bytes
    assert oom.kind == "shortage"
    assert oom.live.allocated_bytes == oom.allocated_bytes
    assert oom.live.sites and oom.live.sites[0].user is not None


def test_the_top_site_names_the_users_line():
    path = fixture("MAGMA27")
    d = explain(load_snapshot(path), str(path)).devices[0]
    top = d.at_peak.sites[0]
    assert top.user is not None and top.user.filename.endswith("model.py")
    assert "site-packages" not in top.user.filename


def test_a_sites_library_call_skips_the_libraries_decorators():
    from memprof.analysis.sites import site_of
    from memprof.trace.model import Frame

    hf = "/env/site-packages/transformers"
    stack = (Frame("??", 0, "c10::alloc"),
             Frame("/env/site-packages/torch/nn/functional.py", 2100, "linear"),
             Frame(f"{hf}/models/llama/modeling_llama.py", 210, "forward"),
             Frame(f"{hf}/utils/deprecation.py", 172, "wrapped_func"),  # deprecate_kwarg's
             Frame(f"{hf}/utils/generic.py", 940, "wrapper"),  # can_return_tuple's
             Frame("/home/u/train.py", 31, "main"))
    site = site_of(stack)
    assert site.user == stack[-1] and site.call == stack[2]  # the model's forward
