"""Start the ranks of a distributed run as torchrun would, each a process of its own.

    exits = run_ranks(Ranks(nodes=1, per_node=4), [sys.executable, "-m", "memprof", ...])

Each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT``,
``TORCHELASTIC_RUN_ID``, and ``OMP_NUM_THREADS=1`` unless set), its output goes where this
process's goes (memprof's own notes once for all the ranks: ``collect/notices.py``), and its
exit code is kept. As torchrun's agent does, this process hosts the
store the ranks meet at (``TORCHELASTIC_USE_AGENT_STORE``): no rank waits for the others
to connect, so ``Ranks.chosen`` may run some ranks of a world only (their names in
:data:`RANKS_RUN`, for the object collectives, ``collect/virtual/objects.py``). The M
nodes of ``--nnodes M`` are M groups of local ranks on this machine. Ctrl-C reaches every
rank (they share the terminal's process group) and a SIGTERM is passed on to each: a rank
under ``memprof run`` then ends its script and writes its report. When a rank fails, the
others get :data:`GRACE_S` seconds to finish (their collectives do not wait for it, as a
card's would) and are then stopped the same way, as torchrun stops a job whose rank failed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from memprof.collect.notices import SAID_DIR
from memprof.errors import MemprofError

GRACE_S = 60.0  # after a rank failed, how long the others may still run
RANKS_RUN = "MEMPROF_RANKS_RUN"  # the ranks of a world that run, where not all of them do
_POLL_S = 0.05


@dataclass(frozen=True)
class Ranks:
    """The layout of a run: ``nodes`` x ``per_node`` ranks, of which ``chosen`` run (None:
    all of them)."""

    nodes: int
    per_node: int
    chosen: tuple[int, ...] | None = None
    why: str = "--ranks"  # who chose them, as the summary says it

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def running(self) -> tuple[int, ...]:
        """The ranks that run, in order."""
        return self.chosen if self.chosen is not None else tuple(range(self.world_size))

    def environment(self, rank: int, port: int, run_id: str) -> dict[str, str]:
        """What torchrun sets for ``rank``."""
        node, local = divmod(rank, self.per_node)
        return {"RANK": str(rank), "LOCAL_RANK": str(local), "GROUP_RANK": str(node),
                "NODE_RANK": str(node), "ROLE_RANK": str(rank),
                "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(self.per_node),
                "ROLE_WORLD_SIZE": str(self.world_size), "GROUP_WORLD_SIZE": str(self.nodes),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
                **({RANKS_RUN: ",".join(map(str, self.chosen))} if self.chosen is not None
                   else {})}


@dataclass(frozen=True)
class RankExit:
    """How one rank ended: its exit code (negative: killed by that signal)."""

    rank: int
    code: int
    stopped: bool  # stopped by memprof after another rank failed, or by Ctrl-C
    started: bool = True  # False: another rank failed first (exit code 0)


def representatives(nodes: int, per_node: int) -> tuple[int, ...]:
    """The ranks of a large world run by default on virtual cards: the first (rank 0's
    extra work) and the second (a rank without it), the first of the second node (a
    node's own work), the middle (a pipeline's stage boundary) and the last two (where
    sharding leaves its remainder)."""
    world = nodes * per_node
    return tuple(sorted({0, 1, per_node % world, world // 2, world - 2, world - 1}))


def parse_ranks(text: str, world_size: int) -> tuple[int, ...]:
    """``--ranks``: ranks and ranges (``0,7``, ``0-3,63``) of a world of ``world_size``,
    sorted; a ValueError says what is wrong."""
    chosen: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"{part.strip()!r} is not a rank or a range of ranks (0-3)")
        low, high = int(first), int(last or first)
        if low > high or high >= world_size:
            raise ValueError(f"{part.strip()!r} is not within ranks 0-{world_size - 1}")
        chosen.update(range(low, high + 1))
    return tuple(sorted(chosen))


def run_ranks(ranks: Ranks, command: list[str], at_once: int | None = None,
              quiet: bool = False) -> list[RankExit]:
    """Run ``command`` once per running rank, all at once or ``at_once`` at a time (ranks
    on virtual cards wait for no other), their output discarded where ``quiet``; how each
    ended, in rank order. Once a rank has failed, the ranks not started yet are not started
    (``started`` False)."""
    output = subprocess.DEVNULL if quiet else None
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port, run_id = store.port, uuid.uuid4().hex[:12]
    said = tempfile.TemporaryDirectory(prefix="memprof-said-")  # a note, once for all ranks
    base = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            SAID_DIR: said.name}
    launch = _Launch(list(ranks.running), at_once or len(ranks.running),
                     lambda r: subprocess.Popen(command, env={
                         **base, **ranks.environment(r, port, run_id)},
                         stdin=output, stdout=output, stderr=output))
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: launch.stop())
    try:
        launch.run()
    except KeyboardInterrupt:  # Ctrl-C reached every rank too: they write their reports
        launch.pending.clear()
        try:
            for p in launch.started.values():
                p.wait()
        except KeyboardInterrupt:
            raise MemprofError("interrupted again while the ranks wrote their reports",
                               exit_code=130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    del store  # after every rank: the ranks' store lives as long as they do
    said.cleanup()
    return [RankExit(r, launch.started[r].returncode, r in launch.stopped)
            if r in launch.started else RankExit(r, 0, True, False) for r in ranks.running]


@dataclass
class _Launch:
    """The ranks started, those waiting to start, and those memprof stopped."""

    pending: list[int]
    at_once: int
    start: Callable[[int], subprocess.Popen[bytes]]
    started: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    stopped: set[int] = field(default_factory=set)

    def run(self) -> None:
        """Start ranks while fewer than ``at_once`` run, until all have ended; once one
        has failed, start no more and stop the rest after :data:`GRACE_S`."""
        failed_at = None
        while True:
            running = sum(p.poll() is None for p in self.started.values())  # polls each
            if failed_at is None and any(p.returncode for p in self.started.values()):
                failed_at = time.monotonic()
                self.pending.clear()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                self.stop()
                failed_at = float("inf")  # stopped once; now wait for them to write reports
            while self.pending and running < self.at_once:
                rank = self.pending.pop(0)
                self.started[rank] = self.start(rank)
                running += 1
            if not running:
                return
            time.sleep(_POLL_S)

    def stop(self) -> None:
        """SIGTERM to the ranks running; none started from now on."""
        self.pending.clear()
        for rank, p in self.started.items():
            if p.poll() is None:
                self.stopped.add(rank)
                p.send_signal(signal.SIGTERM)
