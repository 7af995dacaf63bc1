"""``memprof explain`` as a user runs it: a subprocess, its output, its files, its exit code."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import fixture, load_raw, needs_fixtures


def memprof(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memprof", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=120,
                          env={**os.environ, "COLUMNS": "120"})


class Payload:
    """Unpickling this would run a command that creates a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _bad_inputs(tmp: Path) -> dict[str, Path]:
    (tmp / "text.pickle").write_text("not a pickle at all\n")
    (tmp / "truncated.pickle").write_bytes(pickle.dumps({"segments": list(range(100))})[:40])
    (tmp / "evil.pickle").write_bytes(pickle.dumps(Payload(tmp / "PWNED")))
    (tmp / "other.pickle").write_bytes(pickle.dumps({"weights": [1.0, 2.0]}))
    (tmp / "adir").mkdir()
    return {
        "missing": tmp / "missing.pickle",
        "directory": tmp / "adir",
        "text": tmp / "text.pickle",
        "truncated": tmp / "truncated.pickle",
        "evil": tmp / "evil.pickle",
        "not a snapshot": tmp / "other.pickle",
    }


@pytest.mark.parametrize("case", ["missing", "directory", "text", "truncated", "evil",
                                  "not a snapshot"])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, case):
    path = _bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    result = memprof("explain", str(path), "--json", "--plot", "--out-dir", str(out),
                     cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path.name) in lines[0] and "Traceback" not in result.stderr
    assert not out.exists() or not any(out.iterdir())
    assert not (tmp_path / "PWNED").exists()


@needs_fixtures
def test_json_report_follows_the_schema(tmp_path):
    path = fixture("Constructor-Sun")
    result = memprof("explain", str(path), "--json", "-o", "-", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["schema"] == "memprof.report/1"
    raw = load_raw(path)
    devices = sorted({s["device"] for s in raw["segments"]})
    assert [d["device"] for d in report["devices"]] == devices
    for d in report["devices"]:
        assert sum(d["categories"].values()) == d["peak"]["allocated_bytes"]
        assert d["categories_inferred"] is True
        assert {"top_sites", "fragmentation", "oom", "replay"} <= set(d)
        assert d["replay"]["decisions_matched"] == d["replay"]["decisions_total"]
    ooms = [d["oom"] for d in report["devices"] if d["oom"]]
    assert [o["requested_bytes"] for o in ooms] == \
        [e["size"] for t in raw["device_traces"] for e in t if e["action"] == "oom"]


@needs_fixtures
def test_files_are_written_once_and_not_overwritten(tmp_path):
    path = fixture("MAGMA27")
    first = memprof("explain", str(path), "--json", "--plot", "--top", "3", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    written = sorted(p.name for p in (tmp_path / "reports").iterdir())
    assert written == [f"{path.stem}-timeline.png", f"{path.stem}.json"]
    png = (tmp_path / "reports" / f"{path.stem}-timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert "peak allocated" in first.stdout and "Top allocation sites" in first.stdout
    again = memprof("explain", str(path), "--json", cwd=tmp_path)
    assert again.returncode == 2 and "--force" in again.stderr
    assert memprof("explain", str(path), "--json", "--force", cwd=tmp_path).returncode == 0


@needs_fixtures
def test_device_filter_and_unknown_device(tmp_path):
    path = fixture("Constructor-Sun")
    one = memprof("explain", str(path), "--device", "2", "--json", "-o", "-", cwd=tmp_path)
    assert [d["device"] for d in json.loads(one.stdout)["devices"]] == [2]
    missing = memprof("explain", str(path), "--device", "7", cwd=tmp_path)
    assert missing.returncode == 2 and "no device" in missing.stderr


@needs_fixtures
def test_empty_snapshot_is_explained(tmp_path):
    result = memprof("explain", str(fixture("angelolmn")), cwd=tmp_path)
    assert result.returncode == 0 and "empty" in result.stdout


@needs_fixtures
def test_a_run_folder_shows_every_rank_and_the_imbalance(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    for rank, name in enumerate(("MAGMA27", "bcrafton")):
        (folder / f"rank-{rank}").mkdir()
        (folder / f"rank-{rank}" / "snapshot.pickle").write_bytes(fixture(name).read_bytes())
    result = memprof("explain", str(folder), "--json", "-o", "-", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [(d["rank"], d["device"]) for d in report["devices"]] == [(0, 0), (1, 0)]
    peaks = [d["peak"]["allocated_bytes"] for d in report["devices"]]
    assert report["imbalance"]["max_over_min"] == round(max(peaks) / min(peaks), 4)
    text = memprof("explain", str(folder), cwd=tmp_path)
    assert "imbalance" in text.stdout and "rank 1" in text.stdout
