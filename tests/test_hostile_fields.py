"""Each bad field of a snapshot, and each output error, gives the documented error (one line
for the command line) or a sensible report: never another exception."""

from __future__ import annotations

import copy
import errno
import math
import pickle
import threading
from pathlib import Path

import pytest

from memprof.analysis.explain import explain
from memprof.errors import MemprofError
from memprof.report.files import write_atomic
from memprof.report.run_folder import FILE_NAMES, claim
from memprof.trace.load import load_snapshot
from memprof.trace.normalize import NotASnapshot, normalize
from tests.test_hostile_cli import MIB, _snapshot

BAD_NUMBERS = ["12", None, math.nan, math.inf, [1], {"a": 1}, -1, 2**70, True]


def _set(raw: dict, path: tuple, value: object) -> dict:
    raw = copy.deepcopy(raw)
    parent = raw
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return raw


NUMBER_FIELDS = [("segments", 0, "address"), ("segments", 0, "total_size"),
                 ("segments", 0, "stream"), ("segments", 0, "device"),
                 ("segments", 0, "blocks", 0, "size"), ("segments", 0, "blocks", 0, "address"),
                 ("device_traces", 0, 0, "addr"), ("device_traces", 0, 0, "size"),
                 ("device_traces", 0, 0, "stream")]


@pytest.mark.parametrize("path", NUMBER_FIELDS, ids=lambda p: "/".join(map(str, p)))
@pytest.mark.parametrize("value", BAD_NUMBERS, ids=repr)
def test_a_number_field_of_any_other_type_is_refused(path, value):
    raw = _set(_snapshot("/u/train.py"), path, value)
    if path[0] == "device_traces" and value in (None, "12", True):
        explain(normalize(raw))  # events are read as numpy reads them: None as 0, "12" as 12
        return
    if value is None and path[-1] in ("stream", "device", "address") and len(path) > 3:
        explain(normalize(raw))  # a block without an address follows the one before it
        return
    if value is None and path[-1] in ("stream", "device"):
        assert explain(normalize(raw)).devices[0].device == 0  # missing: stream and device 0
        return
    with pytest.raises(NotASnapshot, match=path[-1]):
        normalize(raw)


@pytest.mark.parametrize("path, value", [
    (("segments", 0, "segment_pool_id"), "x"), (("segments", 0, "segment_pool_id"), (1, -2)),
    (("segments", 0, "blocks", 0, "state"), None), (("segments", 0, "blocks", 0, "state"), "on"),
    (("segments", 0, "blocks"), {"a": 1}), (("segments", 0, "total_size"), 2**70),
    (("allocator_settings",), {"max_split_size": "big"}),
    (("allocator_settings",), {"garbage_collection_threshold": math.nan}),
    (("allocator_settings",), {"roundup_power2_divisions": {"x": 1}}),
    (("allocator_settings",), {"roundup_power2_divisions": [-4]}),
    (("memprof",), {"steps": [-5, 10**12]}), (("memprof",), {"labels": [[0, "nonsense"]]}),
    (("memprof",), {"device": "0"}), (("memprof",), {"segment_pools": [[0, (1, -2)]]}),
    (("memprof",), {"segment_pools": {"0": [1, 0]}}),
    (("device_traces", 0, 0, "action"), ["alloc"]),
    (("device_traces", 0, 0, "action"), ((((),),),)),
])
def test_bad_structure_and_settings_are_refused(path, value):
    with pytest.raises(NotASnapshot):
        normalize(_set(_snapshot("/u/train.py"), path, value))


def test_missing_state_or_size_is_refused():
    for key in ("state", "size"):
        raw = _snapshot("/u/train.py")
        del raw["segments"][0]["blocks"][0][key]
        with pytest.raises(NotASnapshot, match=key):
            normalize(raw)


def test_bad_frames_are_shown_as_unknown_not_raised():
    nested: object = "deep"
    for _ in range(100_000):
        nested = [nested]
    raw = _set(_snapshot("/u/train.py"), ("device_traces", 0, 0, "frames"),
               [{"filename": nested, "line": "7", "name": None}, 5, {"line": 10**100}])
    device = explain(normalize(raw)).devices[0]
    assert [s.label for s in device.at_peak.sites] == ["unknown (no stack recorded)"]
    assert device.at_peak.sites[0].bytes == device.peak_allocated_bytes


def test_a_deep_tuple_is_refused_on_any_thread(tmp_path):
    path = tmp_path / "deep.pickle"
    path.write_bytes(b"\x80\x02})" + b"\x85" * 200_000 + b"Ns.")
    errors: list[str] = []

    def load() -> None:
        try:
            load_snapshot(path)
        except MemprofError as exc:
            errors.append(exc.message)

    worker = threading.Thread(target=load)  # a thread's stack cannot grow: memprof makes one
    worker.start()
    worker.join()
    assert errors == [f"{path}: not a PyTorch memory snapshot (a pickled dict without the"
                      " 'segments' list of a snapshot)"]


def test_a_second_writer_of_one_file_is_refused_and_the_first_kept(tmp_path):
    path = tmp_path / "out" / "report.json"
    write_atomic(path, lambda tmp: tmp.write_text("first"))
    with pytest.raises(MemprofError, match="already exists"):
        write_atomic(path, lambda tmp: tmp.write_text("second"))
    assert path.read_text() == "first"
    write_atomic(path, lambda tmp: tmp.write_text("forced"), overwrite=True)
    assert path.read_text() == "forced"
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json"]


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    def full(tmp: Path) -> None:
        tmp.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    path = tmp_path / "report.json"
    with pytest.raises(MemprofError, match="No space left on device"):
        write_atomic(path, full)
    assert list(tmp_path.iterdir()) == []


def test_a_pickle_of_shared_blocks_is_refused_by_size(tmp_path):
    segment = _snapshot("/u/train.py")["segments"][0]
    blocks = segment["blocks"]
    for b in blocks:
        del b["address"]  # as in PyTorch 2.0: blocks tile their segment in order
    raw = {"segments": [{**segment, "address": i * 2 * MIB} for i in range(300)]}
    path = tmp_path / "shared.pickle"
    path.write_bytes(pickle.dumps(raw, protocol=4))  # one list of blocks, shared
    assert len(load_snapshot(path).segments) == 300  # 300 segments of 2 blocks fit its size
    blocks *= 1000
    path.write_bytes(pickle.dumps(raw, protocol=4))
    with pytest.raises(MemprofError, match="pickle bomb"):
        load_snapshot(path)


def test_two_runs_given_one_folder_cannot_both_claim_it(tmp_path):
    folder, names = tmp_path / "run", FILE_NAMES
    claim(folder, names, force=False)
    with pytest.raises(MemprofError, match="another memprof run is writing there"):
        claim(folder, names, force=False)
    claim(folder, names, force=True)  # --force takes over (a run that was killed)
