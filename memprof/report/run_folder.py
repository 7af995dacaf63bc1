"""The run folder: where ``memprof run`` writes, named after the script, never overwritten."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import time
from pathlib import Path
from typing import Any

from memprof.errors import MemprofError
from memprof.report.files import write_atomic
from memprof.trace.dump import dump_snapshot


def run_folder(stem: str, output: Path | None, world_size: int, base: Path = Path("reports")
               ) -> Path:
    """``-o DIR``, or ``reports/<stem>-<YYYYmmdd-HHMMSS>`` (a free name).

    Under torchrun every rank must pick the same folder without talking to the others:
    the launcher's run id (or its process id) names it.
    """
    if output is not None:
        return output
    if world_size > 1:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        return base / f"{stem}-torchrun-{run_id if run_id != 'none' else os.getppid()}"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder, n = base / f"{stem}-{stamp}", 2
    while folder.exists():
        folder, n = base / f"{stem}-{stamp}-{n}", n + 1
    return folder


# the files of one process's run folder
FILE_NAMES = {"report": "report.json", "page": "report.html", "snapshot": "snapshot.pickle",
              "timeline": "timeline.png", "oom-snapshot": "oom-snapshot.pickle",
              "profile": "profile.json"}
RANK_FOLDER = re.compile(r"rank-(\d+)")


def rank_folder(folder: Path, rank: int, world_size: int) -> Path:
    """Where one rank of a distributed run writes: a run folder of its own, ``rank-K/``
    inside the run's (a world of one: the run's folder itself)."""
    return folder / f"rank-{rank}" if world_size > 1 else folder


def rank_of(folder: Path) -> int | None:
    """The rank whose folder ``folder`` is (``rank-K``), or None."""
    match = RANK_FOLDER.fullmatch(folder.name)
    return int(match.group(1)) if match else None


def claim(folder: Path, names: dict[str, str], force: bool) -> None:
    """Create ``folder``; refuse if this process's files are already there, unless forced,
    when they are removed so that no stale file (timeline, profile) outlives the new run.

    The claim is exclusive: a lock file, created only if absent and removed when this
    process exits, keeps a second run given the same ``-o`` from passing the check too. It
    holds the claiming process's id: the lock of a process that is gone (killed with
    SIGKILL, or by the machine) is taken over.
    """
    try:
        if folder.exists() and not folder.is_dir():
            raise MemprofError(f"{folder}: exists and is not a folder; pass -o with a folder"
                               " path")
        taken = [n for n in names.values() if (folder / n).exists()]
        if taken and not force:
            raise MemprofError(f"{folder}: already holds {taken[0]}; pass --force to overwrite"
                               " or -o to choose another folder")
        folder.mkdir(parents=True, exist_ok=True)
        lock = _lock_path(folder, names)
        _lock(lock, force)
        for name in taken:
            (folder / name).unlink()
    except FileExistsError:
        raise MemprofError(f"{folder}: another memprof run is writing there (or was killed:"
                           f" then remove {lock.name}); pass --force or another -o") from None
    except OSError as exc:
        raise MemprofError(f"{folder}: cannot prepare the run folder ({exc.strerror})") from None
    atexit.register(lock.unlink, missing_ok=True)


def forget_spawned(folder: Path) -> None:
    """Remove the run folders an earlier run's followed children left in ``folder``
    (``child-N/`` holding memprof's files alone), and the ``cluster.json`` of their ranks:
    a forced run's children are its own."""
    import shutil

    (folder / "cluster.json").unlink(missing_ok=True)
    ours = {*FILE_NAMES.values(), "need"}
    for child in folder.glob("child-*"):
        try:
            if child.is_dir() and all(p.name in ours for p in child.iterdir()):
                shutil.rmtree(child)
        except OSError:
            pass  # left as it is: its name is not reused (children.py)


def unclaim(folder: Path, names: dict[str, str]) -> None:
    """Give up a claimed ``folder`` that nothing was written to: its lock, and itself where
    it is empty now."""
    with contextlib.suppress(OSError):
        _lock_path(folder, names).unlink()
        folder.rmdir()


def _lock_path(folder: Path, names: dict[str, str]) -> Path:
    return folder / f".{names['report']}.lock"


def _lock(lock: Path, force: bool) -> None:
    """Create ``lock`` with this process's id in it, taking over a lock whose process is gone."""
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL), 0o666)
    except FileExistsError:
        if not _stale(lock):
            raise
        stale = lock.with_name(f"{lock.name}.stale-{os.getpid()}")
        os.rename(lock, stale)  # of two runs that saw it stale, one renames it; the other fails
        stale.unlink()
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))


def _stale(lock: Path) -> bool:
    """Whether the process that took ``lock`` is gone."""
    try:
        pid = int(lock.read_text()[:20])
    except (OSError, ValueError):  # being written this moment, or an old memprof's empty lock
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        pass
    return False


def write_snapshot(snapshot: dict[str, Any], path: Path, overwrite: bool = False) -> None:
    """Pickle a snapshot as ``torch.cuda.memory._dump_snapshot`` does (plain containers only)."""
    write_atomic(path, lambda tmp: _dump(snapshot, tmp), overwrite)


def _dump(snapshot: dict[str, Any], path: Path) -> None:
    with path.open("wb") as f:  # streamed: a long trace's pickle is not held in memory
        dump_snapshot(snapshot, f)
