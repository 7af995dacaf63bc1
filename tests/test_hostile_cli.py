"""Hostile files given to ``memprof explain`` as a user runs it: exit 2 and one line naming
the file, nothing written, nothing from the file interpreted by the terminal or by rich."""

from __future__ import annotations

import os
import pickle
import socket
import struct
from pathlib import Path

import pytest

from tests.test_cli_explain import memprof

MIB = 1 << 20


def _snapshot(filename: str, name: str = "train_step") -> dict:
    """A one-block snapshot whose only stack frame has this file name and function."""
    frames = [{"filename": filename, "line": 7, "name": name}]
    block = {"address": 0, "size": MIB, "requested_size": MIB, "state": "active_allocated",
             "frames": frames}
    segment = {"device": 0, "address": 0, "total_size": 2 * MIB, "allocated_size": MIB,
               "active_size": MIB, "requested_size": MIB, "stream": 0, "segment_type": "large",
               "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": [
                   block, {"address": MIB, "size": MIB, "requested_size": 0, "state": "inactive",
                           "frames": []}]}
    trace = [{"action": "alloc", "addr": 0, "size": MIB, "stream": 0, "frames": frames}]
    return {"segments": [segment], "device_traces": [trace]}


def _refused_class(module: str) -> bytes:
    """A protocol-4 pickle that references ``module.name`` (STACK_GLOBAL)."""
    def text(s: str) -> bytes:
        data = s.encode()
        return b"\x8c" + bytes([len(data)]) + data
    return b"\x80\x04" + text(module) + text("name") + b"\x93)R."


def _hostile(tmp: Path) -> dict[str, Path]:
    files = {
        "deep tuple key": b"\x80\x02})" + b"\x85" * 200_000 + b"Ns.",
        "memo index bomb": b"\x80\x02Nr" + struct.pack("<I", 1_000_000_000) + b".",
        "escape codes in a class name": _refused_class("\x1b]0;owned\x07\x1b[2J"),
        "newline in a module name": _refused_class("os\nmemprof: error: forged"),
    }
    block = {"address": 0, "size": 512, "requested_size": 512, "state": "active_allocated"}
    segment = {"address": 0, "total_size": 2 * MIB, "blocks": [block] * 2000}
    files["shared-reference bomb"] = pickle.dumps({"segments": [segment] * 50_000}, protocol=4)
    out = {}
    for name, data in files.items():
        out[name] = tmp / f"{name.replace(' ', '-')}.pickle"
        out[name].write_bytes(data)
    os.mkfifo(tmp / "fifo.pickle")
    out["fifo"] = tmp / "fifo.pickle"
    out["too long a name"] = tmp / ("x" * 300 + ".pickle")
    out["/proc/self/mem"] = Path("/proc/self/mem")
    out["device"] = Path("/dev/zero")
    return out


CASES = ["deep tuple key", "memo index bomb", "shared-reference bomb",
         "escape codes in a class name", "newline in a module name", "fifo", "too long a name",
         "/proc/self/mem", "device", "socket"]


@pytest.mark.parametrize("case", CASES)
def test_hostile_file_is_one_line_exit_2_nothing_written(tmp_path, case):
    if case == "socket":
        path = tmp_path / "sock.pickle"
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
    else:
        path = _hostile(tmp_path)[case]
    result = memprof("explain", str(path), "--json", "--plot", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("memprof: error: ")
    assert path.name[:50] in lines[0]
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr
    assert not (tmp_path / "reports").exists()


def test_a_forged_line_stays_on_the_one_line(tmp_path):
    path = _hostile(tmp_path)["newline in a module name"]
    result = memprof("explain", str(path), cwd=tmp_path)
    assert len(result.stderr.splitlines()) == 1
    assert "os\\nmemprof: error: forged" in result.stderr


@pytest.mark.parametrize("filename", ["a[/]b.py", "runs[train]/model.py", "[bold]x[/bold].py"])
def test_rich_markup_in_file_names_is_shown_verbatim(tmp_path, filename):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(_snapshot(f"/home/u/{filename}"), protocol=4))
    result = memprof("explain", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"{filename}:7 train_step" in result.stdout


def test_escape_codes_in_frames_are_made_visible(tmp_path):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(_snapshot("/x/\x1b]0;title\x07model.py", "f\x1b[2J\nforged"),
                                  protocol=4))
    result = memprof("explain", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert "\\x1b]0;title\\x07model.py:7 f\\x1b[2J\\nforged" in result.stdout.replace("\n", "")


def test_output_errors_are_one_line(tmp_path):
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(pickle.dumps(_snapshot("/home/u/train.py"), protocol=4))
    (tmp_path / "afile").write_text("")
    (tmp_path / "afolder").mkdir()
    for args, says in ((["--json", "--out-dir", "afile"], "afile is a file"),
                       (["--json", "-o", "afolder"], "is a folder"),
                       (["--plot", "--out-dir", "afile/deeper"], "afile is a file")):
        result = memprof("explain", str(snap), *args, cwd=tmp_path)
        assert result.returncode == 2 and says in result.stderr, result.stderr
        assert len(result.stderr.splitlines()) == 1
    assert (tmp_path / "afile").read_text() == "" and not any((tmp_path / "afolder").iterdir())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_one_line(tmp_path):
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(pickle.dumps(_snapshot("/home/u/train.py"), protocol=4))
    (tmp_path / "ro").mkdir(mode=0o555)
    result = memprof("explain", str(snap), "--json", "--out-dir", "ro/sub", cwd=tmp_path)
    assert result.returncode == 2 and "Permission denied" in result.stderr
    assert len(result.stderr.splitlines()) == 1 and not any((tmp_path / "ro").iterdir())


def test_visible_text_escapes_what_a_terminal_would_act_on():
    from memprof.report.text import plain, visible

    assert visible("runs[train]/model.py") == "runs[train]/model.py"
    assert visible("a\x1b[2Jb\nc\rd\te\x07\u202ef\x85") == \
        "a\\x1b[2Jb\\nc\\rd\\te\\x07\\u202ef\\x85"
    assert plain("a[/]b.py").plain == "a[/]b.py" and not plain("[bold]x").spans
