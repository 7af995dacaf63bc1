"""``memprof run --nproc-per-node N``: every rank of a distributed run, each profiled.

Each rank is a ``memprof run`` of its own (``--cluster-rank``: quiet, its report forced
into the run folder), started as torchrun starts ranks (``collect/launch/ranks.py``), on a
virtual card of its own where there is no GPU; this process prints the answer for the
whole run (``report/cluster.py``) and exits with the first failed rank's code.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from rich.console import Console
from rich.text import Text

from memprof.cli.cluster_need import cluster_need, worst_need
from memprof.collect.launch.ranks import Ranks, parse_ranks, representatives, run_ranks
from memprof.collect.virtual.cards import Card, card_args
from memprof.errors import MemprofError
from memprof.report.cluster import cluster_summary, ranges, read_cluster, render_cluster
from memprof.report.json import write_json
from memprof.report.run_folder import FILE_NAMES, claim, rank_folder, run_folder, unclaim
from memprof.report.run_summary import need_line
from memprof.report.text import plain

CLUSTER_FILE = "cluster.json"  # the whole run's summary, beside the ranks' reports
REPRESENTED_ABOVE = 16  # ranks: a larger world on virtual cards runs representatives


def cluster_ranks(nodes: int, per_node: int, chosen: str | None, card: Card | None) -> Ranks:
    """The layout ``--nnodes``, ``--nproc-per-node`` and ``--ranks`` ask for: by default
    every rank, or a large world's representatives on virtual cards."""
    world = nodes * per_node
    if chosen is None and card is not None and world > REPRESENTED_ABOVE:
        return Ranks(nodes, per_node, representatives(nodes, per_node),
                     f"a world over {REPRESENTED_ABOVE} runs representatives; --ranks all"
                     " runs every one")
    if chosen is None or chosen.strip() == "all":
        return Ranks(nodes, per_node)
    if card is None:
        raise MemprofError("--ranks runs some ranks on virtual cards only: on GPUs every rank"
                           " of the world must run for their collectives to meet")
    try:
        running = parse_ranks(chosen, world)
    except ValueError as exc:
        raise MemprofError(f"--ranks {plain(chosen)}: {exc}") from None
    return Ranks(nodes, per_node, running if len(running) < world else None)


def run_cluster(command: list[str], stem: str, ranks: Ranks, output: Path | None,
                force: bool, options: list[str], card: Card | None,
                need: tuple[str, int | None] | None = None) -> int:
    """Run ``command`` (the script and its arguments, as after ``memprof run``) as
    ``ranks``, each rank under ``memprof run OPTIONS`` on a virtual ``card`` (None: a GPU);
    print the summary; the exit code. With ``need`` (the allocator settings and the steps
    asked for), a world that ran out of memory on virtual cards is run again with their
    memory raised to tell what each rank needs (``cluster_need.py``)."""
    folder = run_folder(stem, output, 1).absolute()
    running = ranks.chosen if ranks.chosen is not None else range(ranks.world_size)
    for rank in running:  # every rank's folder, before any rank starts
        claim(rank_folder(folder, rank, ranks.world_size), FILE_NAMES, force)
    claim(folder, {"report": CLUSTER_FILE}, force)
    notes = Console(stderr=True, soft_wrap=True, highlight=False)
    world = ranks.world_size
    layout = f"{ranks.nodes} nodes x {ranks.per_node}" if ranks.nodes > 1 else "one node"
    where = f"a virtual {card.name}" if card else "a GPU"
    ranks_word = f"{world} rank{'s' * (world > 1)}"
    if ranks.chosen is not None:
        ranks_word = f"ranks {ranges(ranks.chosen)} of {world} ({ranks.why})"
    # ranks on virtual cards wait for no other's tensors: as many at once as memory holds
    at_once = _at_once() if card is not None else None
    paced = f", {at_once} at a time" if at_once and at_once < len(running) else ""
    if paced and ranks.chosen is None:  # a large world: say how to ask for less
        paced += (f" (--ranks 0,{world - 1} runs the first and the last alone; the ranks"
                  " not run are not predicted)")
    notes.print(plain(f"memprof: {ranks_word} ({layout}), each a process of its own on"
                      f" {where} of its own{paced}"))
    exits = run_ranks(ranks, [sys.executable, "-m", "memprof", "run", "--cluster-rank",
                              "--force", "--no-need", "-o", str(folder), *options, *command],
                      at_once)
    sys.stdout.flush()
    started = tuple(e.rank for e in exits if e.started)
    if len(started) < len(running):  # a rank failed before these could start
        for rank in set(running) - set(started):  # their folders, claimed and left empty
            unclaim(rank_folder(folder, rank, world), FILE_NAMES)
        cluster = read_cluster(folder, world, started, "a rank failed before they started")
    else:
        cluster = read_cluster(folder, world, ranks.chosen, ranks.why)
    needed = None
    if need is not None and card is not None and cluster.first_out_of_memory() is not None:
        notes.print(plain(f"memprof: a rank ran out of memory, so every rank's peak is a lower"
                          f" bound; running the ranks again on virtual {card.name} cards with"
                          " their memory raised to tell what each needs (--no-need skips"
                          " this)"))
        needed = worst_need(cluster_need(command, ranks, folder, card, need[0], cluster,
                                         need[1], at_once))
    summary = cluster_summary(cluster, ranks.nodes, ranks.per_node)
    write_json({**summary, "need": needed} if needed else summary, folder / CLUSTER_FILE)
    notes.print(plain(f"memprof run {shlex.join(command)}: {ranks_word} on"
                      f" {cluster.card or 'the GPUs'}"))
    render_cluster(cluster, notes)
    if needed is not None:
        notes.print(Text.assemble(f"Rank {needed['rank']}: ",
                                  need_line(needed, card.name if card else None)))
    notes.print()
    inside = "rank-K/, a run folder per rank" if world > 1 else "the rank's report"
    notes.print(plain(f"Run folder: {folder}/ ({inside}, and {CLUSTER_FILE})"))
    notes.print(plain(f"Next: memprof explain {folder}"))
    failed = [e for e in exits if e.code and not e.stopped]
    return _exit_code(failed[0].code) if failed else 0


RANK_BYTES = 1 << 30  # a rank's process on a virtual card: torch, the script, the trace


def _at_once() -> int:
    """How many ranks on virtual cards run at once: as many as memory holds. (Not one per
    core: ranks that exchange objects, ``all_gather_object``, wait for each other.)"""
    return max(1, _available() // RANK_BYTES)


def _available() -> int:
    """The memory this machine can give without swapping (Linux; elsewhere: unbounded)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62


def _exit_code(code: int) -> int:
    """A rank's exit code as a shell shows it (killed by signal N: 128 + N)."""
    return 128 - code if code < 0 else code


def rank_options(card: Card | None, device: str, conf: str, max_entries: int, top: int,
                 steps: int | None, seconds: float | None, timeline: bool,
                 max_peak: str | None) -> list[str]:
    """The ``memprof run`` options each rank runs with, from this run's."""
    options = card_args(card) if card is not None else ["--device", device]
    options += ["--alloc-conf", conf, "--max-entries", str(max_entries), "--top", str(top)]
    if steps is not None:
        options += ["--steps", str(steps)]
    if seconds is not None:
        options += ["--seconds", repr(seconds)]
    if not timeline:
        options.append("--no-timeline")
    if max_peak is not None:
        options += ["--max-peak", max_peak]
    return options
