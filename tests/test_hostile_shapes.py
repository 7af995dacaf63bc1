"""explain on small files whose shape multiplies the work (sharing, counts, sizes no device
has) and on inputs that used to print more than one line: each is refused in one line, or
explained, within a time the file's size allows."""

from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import pytest
from conftest import GPU_FIXTURES, Jobs, load_raw

MIB = 1 << 20


def explain(cwd: Path, *args: str | Path, limit: float | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **({"MEMPROF_TIME_LIMIT": str(limit)} if limit else {})}
    return subprocess.run([sys.executable, "-m", "memprof", "explain", *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def refused(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    line, = result.stderr.strip().splitlines()
    assert line.startswith("memprof: error:"), line
    for word in words:
        assert word in line, line


def _segment(addr: int, size: int, device: int = 0, expandable: bool = False) -> dict:
    return {"device": device, "address": addr, "total_size": size, "allocated_size": 0,
            "active_size": 0, "requested_size": 0, "stream": 0, "segment_type": "large",
            "segment_pool_id": (0, 0), "is_expandable": expandable,
            "blocks": [{"address": addr, "size": size, "requested_size": 0, "state": "inactive"}]}


def _dump(path: Path, snapshot: object) -> Path:
    path.write_bytes(pickle.dumps(snapshot, protocol=4))
    return path


# --- each test's file and explain on it: started together on first use --------------------

jobs = Jobs()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Any]]]:
    yield from jobs.started(tmp_path_factory, "shapes")



@jobs
def hash_bomb(where: Path) -> CompletedProcess:
    """A dict key of 60 levels of memo-shared tuples (431 bytes): 2^60 steps of hashing in
    the unpickler, which only another process can stop."""
    out = io.BytesIO()
    out.write(b"\x80\x04})\x940")  # PROTO 4, EMPTY_DICT; EMPTY_TUPLE, MEMOIZE, POP
    for i in range(60):  # BINGET i, BINGET i, TUPLE2, MEMOIZE, POP
        out.write(b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x940")
    out.write(b"h" + bytes([60]) + b"Ns.")
    (where / "bomb.pickle").write_bytes(out.getvalue())
    return explain(where, "bomb.pickle", limit=2)


def test_a_hash_bomb_is_stopped(runs: dict[str, Future[Any]]):
    refused(runs["hash_bomb"].result(), "bomb.pickle", "pathological")


@jobs
def expandable(where: Path) -> CompletedProcess:
    segments = [_segment((1 << 40) + i * 2 * MIB, 2 * MIB, expandable=True)
                for i in range(100_000)]
    path = _dump(where / "expandable.pickle", {"segments": segments, "device_traces": [[]]})
    return explain(where, path, "--json", "-o", "-", timeout=300)


def test_many_expandable_segments_are_explained_in_linear_time(runs: dict[str, Future[Any]]):
    result = runs["expandable"].result()
    assert result.returncode == 0, result.stderr
    assert '"reserved_bytes": 209715200000' in result.stdout


@jobs
def devices(where: Path) -> CompletedProcess:
    path = _dump(where / "devices.pickle", {
        "segments": [_segment(1 << 40, 2 * MIB, device=d) for d in range(20_000)],
        "device_traces": [[] for _ in range(20_000)]})
    return explain(where, path)


def test_more_devices_than_a_machine_has_are_refused(runs: dict[str, Future[Any]]):
    refused(runs["devices"].result(), "devices")


@jobs
def shared_oom(where: Path) -> tuple[CompletedProcess, CompletedProcess]:
    oom = {"action": "oom", "addr": 0, "size": 1 << 30, "stream": 0, "time_us": 1,
           "frames": [], "device_free": 0}
    alloc = {"action": "alloc", "addr": 1 << 40, "size": 512, "stream": 0, "time_us": 0,
             "frames": []}
    path = _dump(where / "shared.pickle", {"segments": [],
                                           "device_traces": [[alloc] + [oom] * 50_000]})
    return explain(where, path, "--json", "-o", "-", timeout=60), explain(where, path)


def test_an_oom_event_shared_50000_times_is_described_once(runs: dict[str, Future[Any]]):
    """One OOM event dict shared 50,000 times in a 100 KB file: the first 16 OOM events are
    described (the live memory of each), the rest counted."""
    result, text = runs["shared_oom"].result()
    assert result.returncode == 0, result.stderr
    assert len(result.stdout) < 100_000 and '"oom_events": 50000' in result.stdout
    assert "49,984 more out-of-memory events" in text.stdout


@jobs
def wrap(where: Path) -> CompletedProcess:
    events = [{"action": "alloc", "addr": (1 << 44) + i * 512, "size": (1 << 44) - 1,
               "stream": 0, "time_us": i, "frames": []} for i in range((1 << 19) + 8)]
    path = _dump(where / "wrap.pickle", {"segments": [], "device_traces": [events]})
    return explain(where, path)


def test_sizes_that_add_up_past_any_device_are_refused(runs: dict[str, Future[Any]]):
    """16 TiB - 1 allocated 2^19 times: int64 sums wrap, and said 0 allocated at the end."""
    refused(runs["wrap"].result(), "2 EiB")


@jobs
def sparse(where: Path) -> CompletedProcess:
    path = where / "sparse.pickle"
    with path.open("wb") as f:
        f.write(b"\x80\x04}.")
        f.truncate(20 << 30)  # 20 GB of zeros after a pickle's start: sparse, no disk
    return explain(where, path, timeout=30)


def test_a_huge_sparse_file_is_refused_from_its_ends(runs: dict[str, Future[Any]]):
    refused(runs["sparse"].result(), "does not begin and end as a pickle")


@jobs
def bytearray_bomb(where: Path) -> CompletedProcess:
    path = where / "ba8.pickle"
    path.write_bytes(b"\x80\x05\x96" + struct.pack("<Q", 1 << 40) + b"xx.")
    return explain(where, path)


def test_a_bytearray_bomb_says_one_line(runs: dict[str, Future[Any]]):
    refused(runs["bytearray_bomb"].result(), "more memory")


@jobs
def snapshot_folder(where: Path) -> CompletedProcess:
    (where / "run" / "snapshot.pickle").mkdir(parents=True)
    return explain(where, "run")


def test_a_run_folder_whose_snapshot_is_a_folder(runs: dict[str, Future[Any]]):
    refused(runs["snapshot_folder"].result(), "is a directory")


@jobs
def run_peak(where: Path) -> CompletedProcess:
    raw = load_raw(GPU_FIXTURES / "leak" / "snapshot.pickle")
    raw["memprof"]["run_peak"] = {"requested_bytes": 10**400, "allocated_bytes": None,
                                  "reserved_bytes": None}
    return explain(where, _dump(where / "peak.pickle", raw))


def test_a_run_peak_no_device_has_is_refused(runs: dict[str, Future[Any]]):
    refused(runs["run_peak"].result(), "run_peak")


@jobs
def not_utf8(where: Path) -> tuple[CompletedProcess, Path]:
    name = os.fsdecode(b"bad\xff.pickle")
    (where / name).write_bytes((GPU_FIXTURES / "leak" / "snapshot.pickle").read_bytes())
    return explain(where, name, "--plot", "--out-dir", "out"), where


def test_a_file_name_that_is_not_utf8_plots(runs: dict[str, Future[Any]]):
    result, where = runs["not_utf8"].result()
    assert result.returncode == 0, result.stderr
    assert [p.suffix for p in (where / "out").iterdir()] == [".png"]


USAGE_ERRORS = [["--top", "abc", "x.pickle"], ["x.pickle", "--nope"],
                ["x.pickle", "--device", "-1x"]]


def _usage_error(number: int) -> None:
    def run(where: Path) -> CompletedProcess:
        return explain(where, *USAGE_ERRORS[number])

    run.__name__ = f"usage{number}"
    jobs(run)


for _number in range(len(USAGE_ERRORS)):
    _usage_error(_number)


@pytest.mark.parametrize("args", USAGE_ERRORS)
def test_usage_errors_are_one_line(runs: dict[str, Future[Any]], args: list[str]):
    refused(runs[f"usage{USAGE_ERRORS.index(args)}"].result(), "--help")
