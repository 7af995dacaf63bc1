"""Start the ranks of a distributed run as torchrun would, each a process of its own.

    exits = run_ranks(Ranks(nodes=1, per_node=4), [sys.executable, "-m", "memprof", ...])

Each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` on a free port of
this machine, ``TORCHELASTIC_RUN_ID``, and ``OMP_NUM_THREADS=1`` unless set), its output
goes where this process's goes, and its exit code is kept. The M nodes of ``--nnodes M``
are M groups of local ranks on this machine. Ctrl-C reaches every rank (they share the
terminal's process group) and a SIGTERM is passed on to each: a rank under ``memprof run``
then ends its script and writes its report. When a rank fails, the others get
:data:`GRACE_S` seconds to finish (their collectives do not wait for it, as a card's would)
and are then stopped the same way, as torchrun stops a job whose rank failed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass

from memprof.errors import MemprofError

GRACE_S = 60.0  # after a rank failed, how long the others may still run
_POLL_S = 0.05


@dataclass(frozen=True)
class Ranks:
    """The layout of a run: ``nodes`` x ``per_node`` ranks."""

    nodes: int
    per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    def environment(self, rank: int, port: int, run_id: str) -> dict[str, str]:
        """What torchrun sets for ``rank``."""
        node, local = divmod(rank, self.per_node)
        return {"RANK": str(rank), "LOCAL_RANK": str(local), "GROUP_RANK": str(node),
                "NODE_RANK": str(node), "ROLE_RANK": str(rank),
                "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(self.per_node),
                "ROLE_WORLD_SIZE": str(self.world_size), "GROUP_WORLD_SIZE": str(self.nodes),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": run_id}


@dataclass(frozen=True)
class RankExit:
    """How one rank ended: its exit code (negative: killed by that signal)."""

    rank: int
    code: int
    stopped: bool  # stopped by memprof after another rank failed, or by Ctrl-C


def free_port() -> int:
    """A TCP port no process listens on now, for the ranks' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(ranks: Ranks, command: list[str]) -> list[RankExit]:
    """Run ``command`` once per rank, all at once; how each ended, by rank."""
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    base = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    running = [subprocess.Popen(command, env={**base, **ranks.environment(r, port, run_id)})
               for r in range(ranks.world_size)]
    stopped: set[int] = set()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: _stop(running, stopped))
    try:
        _wait(running, stopped)
    except KeyboardInterrupt:  # Ctrl-C reached every rank too: they write their reports
        try:
            for p in running:
                p.wait()
        except KeyboardInterrupt:
            raise MemprofError("interrupted again while the ranks wrote their reports",
                               exit_code=130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    return [RankExit(r, p.returncode, r in stopped) for r, p in enumerate(running)]


def _wait(running: list[subprocess.Popen[bytes]], stopped: set[int]) -> None:
    """Wait for every rank; once one fails, stop the rest after :data:`GRACE_S`."""
    failed_at = None
    while any(p.poll() is None for p in running):
        if failed_at is None and any(p.returncode for p in running if p.returncode is not None):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            _stop(running, stopped)
            failed_at = float("inf")  # stopped once; now wait for them to write reports
        time.sleep(_POLL_S)


def _stop(running: list[subprocess.Popen[bytes]], stopped: set[int]) -> None:
    for rank, p in enumerate(running):
        if p.poll() is None:
            stopped.add(rank)
            p.send_signal(signal.SIGTERM)
