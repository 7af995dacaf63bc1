"""A report.json is data someone hands over: ``suggest --verify`` never runs the command
it records unless ``memprof run`` wrote it here, for this user, or the user gives it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from test_run_cli import memprof_run
from test_suggest import suggest

TRAIN = ("import torch\nm = torch.nn.Linear(64, 64).cuda()\no = torch.optim.SGD(m.parameters())\n"
         "for _ in range(3):\n    m(torch.randn(8, 64, device='cuda')).sum().backward()\n"
         "    o.step()\n")


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder memprof run wrote here."""
    where = tmp_path_factory.mktemp("own")
    (where / "train.py").write_text(TRAIN)
    assert memprof_run(where, "-o", "run", "train.py").code == 0
    return where


def _handed(own: Path, to: Path, **run: object) -> Path:
    """``own``'s run folder copied to ``to``, its ``run`` entry changed by ``run``."""
    shutil.copytree(own / "run", to / "run")
    report = to / "run" / "report.json"
    data = json.loads(report.read_text())
    data["run"].update(run)
    report.write_text(json.dumps(data))
    return to / "run"


def _payload(marker: Path) -> list[str]:
    """A recorded command that runs code: it writes ``marker``."""
    return ["memprof", "run", "-m", "timeit", "-s",
            f"open({str(marker)!r}, 'w').write('ran')", "pass"]


def test_a_recorded_command_that_runs_code_is_not_run(own: Path, tmp_path: Path):
    marker = tmp_path / "pwned"
    handed = _handed(own, tmp_path, command=_payload(marker))
    for how in (["--verify"], ["--fit-batch", "batch"]):
        result = suggest(tmp_path, handed, "--budget", "1MB", *how)
        assert result.code == 2, result.stderr
        line, = result.stderr.strip().splitlines()
        assert "not written by memprof run here" in line and "--rerun-command" in line
        assert "timeit" in line  # the command is shown, for the user to check
    assert not marker.exists()


@pytest.mark.parametrize("forgery", ["copied", "edited", "launcher added", "other key"])
def test_a_signature_only_this_user_can_make(own: Path, tmp_path: Path, forgery: str,
                                             monkeypatch: pytest.MonkeyPatch):
    marker = tmp_path / "pwned"
    signature = json.loads((own / "run" / "report.json").read_text())["run"]["signature"]
    assert isinstance(signature, str) and len(signature) == 64
    if forgery == "copied":  # a valid signature, over another command
        handed = _handed(own, tmp_path, command=_payload(marker), signature=signature)
    elif forgery == "edited":  # the folder it ran in, changed
        handed = _handed(own, tmp_path, cwd=str(tmp_path))
    elif forgery == "launcher added":  # variables a re-run would set, not recorded here
        handed = _handed(own, tmp_path, launcher_env={"ACCELERATE_USE_FSDP": "true"})
    else:  # signed by the same memprof elsewhere: another user's key
        handed = _handed(own, tmp_path)
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "another-user"))
    result = suggest(tmp_path, handed, "--budget", "1MB", "--verify")
    assert result.code == 2 and "--rerun-command" in result.stderr, result.stderr
    assert not marker.exists()


def test_a_handed_report_is_re_run_with_the_command_the_user_gives(own: Path, tmp_path: Path):
    marker = tmp_path / "pwned"
    handed = _handed(own, tmp_path, command=_payload(marker))
    (tmp_path / "train.py").write_text(TRAIN)  # the user's own copy of the script
    given = suggest(tmp_path, handed, "--budget", "1MB", "--verify", "--json",
                    "--rerun-command", "train.py")
    assert given.code in (0, 1), given.stderr
    advice = json.loads(given.stdout)["suggest"]
    assert advice["baseline_measured"] == advice["current"]  # the recorded run, reproduced
    assert not marker.exists()


@pytest.mark.parametrize("text", ["", "--steps 3", "-m", "'unclosed"])
def test_a_given_command_must_be_a_script(own: Path, text: str):
    result = suggest(own, "run", "--budget", "1MB", "--verify", "--rerun-command", text)
    assert result.code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr


LAUNCHED = ("import os, torch\nopen('seen.txt', 'w').write(os.environ.get("
            "'FSDP_SHARDING_STRATEGY', 'unset'))\n" + TRAIN)


def test_a_re_run_sets_again_what_the_launcher_set(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch):
    """accelerate launch configures the processes it starts through variables
    (``ACCELERATE_USE_FSDP``, ``FSDP_*``): a re-run of a report signed here sets them
    again; a command the user gives runs in the user's own environment."""
    from test_run_cli import run_python

    from memprof.advise.rerun import Rerun
    from memprof.advise.source import load_run

    (tmp_path / "train.py").write_text(LAUNCHED)
    ran = run_python(["-m", "memprof", "run", "-o", "run", "train.py"], tmp_path,
                     env={"FSDP_SHARDING_STRATEGY": "FULL_SHARD"})
    assert ran.code == 0, ran.stderr
    run = load_run(tmp_path / "run")
    assert run.facts["launcher_env"] == {"FSDP_SHARDING_STRATEGY": "FULL_SHARD"}
    (tmp_path / "seen.txt").unlink()
    assert "FSDP_SHARDING_STRATEGY" not in os.environ
    Rerun.of(run).peak()
    assert (tmp_path / "seen.txt").read_text() == "FULL_SHARD"
    monkeypatch.chdir(tmp_path)  # a given command runs from here
    assert Rerun.of(run, ["train.py"]).env is None


def test_the_secret_is_the_users_alone(own: Path):
    key = Path(os.environ["XDG_CONFIG_HOME"]) / "memprof" / "run-key"
    assert key.stat().st_mode & 0o077 == 0 and len(key.read_bytes()) == 32
