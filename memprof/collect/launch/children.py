"""Child processes the script starts with ``spawn`` or ``forkserver``, each profiled by a
``memprof run`` of its own (``mp.spawn``, ``multiprocessing.Process``, ``Pool`` workers).

A spawned child is a fresh Python: left alone it would run without memprof, on the virtual
GPU without any CUDA at all. While :class:`FollowedChildren` is entered, the command line
multiprocessing builds for a child (``spawn.get_command_line``) becomes ``python -m memprof
run --child OPTIONS -o FOLDER/child-N -c CODE``, where CODE calls multiprocessing's own
``spawn_main``: the child unpickles and runs its target as it would have, on the parent's
device options, silently, and writes ``child-N/`` if it made CUDA tensors. A forkserver
child starts as a spawned one (the fork server's process has no memprof to fork from);
either way it imports the main module and unpickles its target. DataLoader's workers start
as the script asked, not followed: they make no CUDA memory, as forked ones record none.

    with FollowedChildren(folder, ["--virtual-gpu", "H100"]) as children:
        run(target)
    children.folders  # [folder / "child-1", ...], in the order they started
"""

from __future__ import annotations

import functools
import multiprocessing.context
import multiprocessing.spawn
import threading
from pathlib import Path
from typing import Any

from memprof.collect.launch.endings import child_script
from memprof.errors import Refusal

_SPAWN_MAIN = "from multiprocessing.spawn import spawn_main; "
FOLLOWED_CODE = "from memprof.collect.launch.children import spawn_main; "  # a child's -c
_DATA_LOADER_WORKER = ("torch.utils.data._utils.worker", "_worker_loop")
_SPAWNED_RANK = ("torch.multiprocessing.spawn", "_wrap")  # mp.spawn's process target
GRACE_S = 120  # for a signalled child to write its report


class NestedRanks(Refusal):
    """The script spawns ranks of its own inside a rank a launcher started."""


class FollowedChildren:
    """Starts the script's spawn and forkserver children under ``memprof run OPTIONS``,
    each with its run folder in ``folder`` (``folders``, in the order they started)."""

    def __init__(self, folder: Path, options: list[str], ranks: int = 1) -> None:
        self.folder = folder
        self.options = options
        self.ranks = ranks  # the ranks on this node a launcher started (LOCAL_WORLD_SIZE)
        self.folders: list[Path] = []
        self._next = 1  # the number of the next child's folder
        self._starting = threading.local()  # set while this thread starts a followed child
        self._lock = threading.Lock()
        self._saved: dict[Any, Any] = {}
        self._processes: list[Any] = []  # the followed children's Process objects
        self.exits: dict[Path, int] = {}  # how each ended (finish), by run folder

    def __enter__(self) -> FollowedChildren:
        context = multiprocessing.context
        spawned = context.SpawnProcess.__dict__["_Popen"].__func__
        for kind in (context.SpawnProcess, getattr(context, "ForkServerProcess", None)):
            if kind is not None:
                own = kind.__dict__["_Popen"]
                self._saved[kind] = own
                kind._Popen = staticmethod(functools.partial(self._start, own.__func__, spawned))
        self._saved[multiprocessing.spawn] = multiprocessing.spawn.get_command_line
        multiprocessing.spawn.get_command_line = self._command_line
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, value in self._saved.items():
            if owner is multiprocessing.spawn:
                owner.get_command_line = value
            else:
                owner._Popen = value
        self._saved.clear()

    def _start(self, own: Any, spawned: Any, process: Any) -> Any:
        """A ``Process._Popen``: a DataLoader worker as its kind starts it, any other child
        spawned with memprof's command line."""
        target = getattr(process, "_target", None)
        name = (getattr(target, "__module__", None), getattr(target, "__name__", None))
        if name == _DATA_LOADER_WORKER:
            return own(process)
        if name == _SPAWNED_RANK and self.ranks > 1:
            # each would see every card and start as many again, and wait for them forever
            raise NestedRanks(
                "the script starts ranks of its own (torch.multiprocessing.spawn) inside one"
                f" of the {self.ranks} ranks its launcher started: run it with memprof run"
                f" --cards {self.ranks} alone, which follows the processes it spawns, one per"
                " card, not with --nproc-per-node or torchrun")
        self._starting.on = True
        before = len(self.folders)
        try:
            started = spawned(process)
        finally:
            self._starting.on = False
        self._processes.append((process, self.folders[-1] if len(self.folders) > before
                                else None))  # (a frozen executable's child: not followed)
        return started

    def finish(self, signalled: bool) -> None:
        """Wait for the children still running, as Python's exit would (its daemonic ones
        terminated, the others joined), so that their reports are written before the run's;
        where a signal ended the script, every child is signalled too (each writes its
        report), and one that has not ended after ``GRACE_S`` is killed."""
        for process, _ in self._processes:
            if process.is_alive() and (signalled or process.daemon):
                process.terminate()
        for process, folder in self._processes:
            process.join(GRACE_S if signalled else None)
            if process.is_alive():
                process.kill()
                process.join()
            if folder is not None and process.exitcode is not None:
                self.exits[folder] = process.exitcode

    def _command_line(self, **kwds: Any) -> list[str]:
        """``spawn.get_command_line``: a followed child's runs under ``memprof run``."""
        command = self._saved[multiprocessing.spawn](**kwds)
        if not getattr(self._starting, "on", False) or "-c" not in command:
            return command  # not a child of the script's (a frozen executable has no -c)
        at = command.index("-c")
        code = command[at + 1]
        if not code.startswith(_SPAWN_MAIN):
            return command
        with self._lock:  # a name no earlier run left in the folder (-o DIR --force)
            while (self.folder / f"child-{self._next}").exists():
                self._next += 1
            folder = self.folder / f"child-{self._next}"
            self._next += 1
            self.folders.append(folder)
        return [*command[:at], "-m", "memprof", "run", "--child", "--no-timeline",
                *self.options, "-o", str(folder), "-c", FOLLOWED_CODE + code[len(_SPAWN_MAIN):],
                *command[at + 2:]]


def spawn_main(**kwds: Any) -> None:
    """A followed child's code: multiprocessing's ``spawn_main``, where a SIGTERM (from
    ``Pool.terminate()``, say) ends the script silently and its report is written
    (``endings.child_signals``)."""
    with child_script():
        multiprocessing.spawn.spawn_main(**kwds)


def made_cuda(snapshot: dict[str, Any]) -> bool:
    """Whether a recording's snapshot holds CUDA memory (a trace event or a segment): a
    followed child writes a report only then."""
    return bool(snapshot.get("segments") or any(snapshot.get("device_traces", [])))


def child_reports(folders: list[Path]) -> list[Path]:
    """The children's run folders that hold a report (those that made CUDA tensors)."""
    return [f for f in folders if any(f.glob("report*.json"))]


def reports_note(reports: list[Path], card: str, itself: bool) -> str:
    """The parent's line about its children's ``reports``; ``itself``: whether the parent
    made CUDA tensors too."""
    many = len(reports) > 1
    who = (f"{len(reports)} child process{'es' if many else ''} made CUDA tensors"
           f"{' too' if itself else ''}, {'each ' if many else ''}on a virtual {card} of its own")
    where = ", ".join(f"{f}/" for f in reports)
    return (f"memprof: {who}: reports in {where}" if itself else
            f"memprof: the script made no CUDA tensor itself; {who}: reports in {where}")
