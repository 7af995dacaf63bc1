"""One size parser, one meaning, bounded, for every option that takes a size; numbers and
allocator settings out of range refused in one line before anything runs."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from conftest import Jobs
from test_run_cli import Result, memprof_run
from typer.testing import CliRunner

from memprof.analysis.settings import parse_alloc_conf
from memprof.cli.app import app
from memprof.errors import MemprofError
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


# --- the runs each test refuses: started together on first use ---------------------------

jobs = Jobs()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Any]]]:
    yield from jobs.started(tmp_path_factory, "sizes")


def _refused_run(name: str, *options: str, marks: bool = True) -> None:
    """A run with ``options`` of a script that marks that it ran (or ``pass``)."""
    def run(where: Path) -> tuple[Result, Path]:
        marker = where / "ran"
        (where / "train.py").write_text(f"open({str(marker)!r}, 'w')\n" if marks else "pass\n")
        return memprof_run(where, *options, "train.py"), marker

    run.__name__ = name
    jobs(run)


SIZE_OPTIONS = ["--max-peak", "--virtual-gpu"]
SECONDS = ["inf", "nan", "-1", "1e400", "0"]
for _option in SIZE_OPTIONS:
    _refused_run(_option, _option, f"{HUGE}GB")
for _value in SECONDS:
    _refused_run(f"--seconds {_value}", "--seconds", _value, marks=False)


@pytest.mark.parametrize("option", SIZE_OPTIONS)
def test_run_options_refuse_huge_sizes_before_the_script(runs: dict[str, Future[Any]],
                                                         option: str):
    result, marker = runs[option].result()
    _one_line(result, option)
    assert not marker.exists()


@pytest.mark.parametrize("value", SECONDS)
def test_seconds_must_be_a_time(runs: dict[str, Future[Any]], value: str):
    _one_line(runs[f"--seconds {value}"].result()[0], "--seconds")


BAD_CONFS = ["garbage_collection_threshold:2", "garbage_collection_threshold:-1",
             "garbage_collection_threshold:nan", "garbage_collection_threshold:inf",
             "roundup_power2_divisions:100000", "roundup_power2_divisions:3",
             f"max_split_size_mb:{HUGE}", "expandable_segments:maybe"]


def _refused_in_process(args: list[str]) -> str:
    """The one-line error a command gives ``args`` (in this process: no fork, no start-up)."""
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, MemprofError), (args, result.output)
    message = result.exception.message
    assert result.exception.exit_code == 2 and "\n" not in message and len(message) < 400
    return message


@pytest.mark.parametrize("conf", BAD_CONFS)
def test_allocator_settings_pytorch_refuses_are_refused(conf: str):
    with pytest.raises(ValueError):
        parse_alloc_conf(conf)
    _refused_in_process(["explain", "nowhere.pickle", "--what-if", conf])


_refused_run("--alloc-conf", "--alloc-conf", BAD_CONFS[0])


def test_allocator_settings_are_checked_before_the_script_runs(runs: dict[str, Future[Any]]):
    result, marker = runs["--alloc-conf"].result()
    _one_line(result, BAD_CONFS[0])
    assert not marker.exists()


@pytest.mark.parametrize("command", [["suggest", "nowhere", "--budget"],
                                     ["explain", "nowhere.pickle", "--device-memory"],
                                     ["check", "a", "--baseline", "b", "--max-increase"]])
def test_every_size_option_refuses_400_digits(command: list[str]):
    for value in (HUGE, f"{HUGE}GB", f"{HUGE}%"):
        message = _refused_in_process([*command, value])
        assert command[-1] in message, message
