"""One size parser, one meaning, bounded, for every option that takes a size; numbers and
allocator settings out of range refused in one line before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_run_cli import SAMPLES, memprof_run, run_python

from memprof.sizes import MAX_SIZE, read_size

HUGE = "9" * 400


@pytest.mark.parametrize(("text", "size"), [
    ("24GB", 24 * 10**9), ("24000MB", 24 * 10**9), ("24gb", 24 * 10**9),
    ("24GiB", 24 * 2**30), ("24G", 24 * 2**30), ("512 MiB", 512 * 2**20),
    ("0.5GiB", 2**29), ("1.5TB", 15 * 10**11), ("1073741824", 2**30), ("7B", 7),
    ("16TiB", MAX_SIZE),
])
def test_sizes_read_one_way(text: str, size: int):
    assert read_size(text).bytes == size


@pytest.mark.parametrize("text", ["", "lots", "-3GB", "1e3GB", "nan", "inf", "24 GBs",
                                  f"{HUGE}GB", HUGE, "16.0001TiB", "x" * 10**6])
def test_what_is_not_a_size_or_too_large_is_refused(text: str):
    with pytest.raises(ValueError) as error:
        read_size(text)
    assert len(str(error.value)) < 200


def _one_line(result, option: str) -> None:
    assert result.code == 2, (option, result.stderr)
    line, = result.stderr.strip().splitlines()
    assert line.startswith("memprof: error:") and len(line) < 400, line


@pytest.mark.parametrize("option", ["--max-peak", "--virtual-gpu"])
def test_run_options_refuse_huge_sizes_before_the_script(tmp_path: Path, option: str):
    marker = tmp_path / "ran"
    (tmp_path / "train.py").write_text(f"open({str(marker)!r}, 'w')\n")
    _one_line(memprof_run(tmp_path, option, f"{HUGE}GB", "train.py"), option)
    assert not marker.exists()


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "1e400", "0"])
def test_seconds_must_be_a_time(tmp_path: Path, value: str):
    (tmp_path / "train.py").write_text("pass\n")
    _one_line(memprof_run(tmp_path, "--seconds", value, "train.py"), "--seconds")


@pytest.mark.parametrize("conf", ["garbage_collection_threshold:2",
                                  "garbage_collection_threshold:-1",
                                  "garbage_collection_threshold:nan",
                                  "garbage_collection_threshold:inf",
                                  "roundup_power2_divisions:100000", "roundup_power2_divisions:3",
                                  f"max_split_size_mb:{HUGE}", "expandable_segments:maybe"])
def test_allocator_settings_are_checked_before_the_script_runs(tmp_path: Path, conf: str):
    marker = tmp_path / "ran"
    (tmp_path / "train.py").write_text(f"open({str(marker)!r}, 'w')\n")
    _one_line(memprof_run(tmp_path, "--alloc-conf", conf, "train.py"), conf)
    assert not marker.exists()
    _one_line(run_python(["-m", "memprof", "explain", str(SAMPLES / "nowhere.pickle"),
                          "--what-if", conf], tmp_path), conf)


@pytest.mark.parametrize(("command", "option"), [
    (["suggest", "nowhere", "--budget"], "--budget"),
    (["explain", "nowhere.pickle", "--device-memory"], "--device-memory"),
    (["check", "a", "--baseline", "b", "--max-increase"], "--max-increase"),
])
def test_every_size_option_refuses_400_digits(tmp_path: Path, command: list[str], option: str):
    for value in (HUGE, f"{HUGE}GB", f"{HUGE}%"):
        result = run_python(["-m", "memprof", *command, value], tmp_path)
        _one_line(result, option)
        assert "more than any device" in result.stderr or "expected" in result.stderr \
            or "not a size" in result.stderr, result.stderr
