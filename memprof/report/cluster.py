"""The ranks of a distributed run read from their reports: the answer first, then each rank.

    cluster = read_cluster(folder)       # rank-K/report.json, each rank's own report
    render_cluster(cluster, console)     # "fits: worst rank 1.20 GiB of 80.00 GiB (rank 0)"
    worst_report(folder)                 # the report check and suggest read in such a folder

A rank's card holds its peak reserved memory and the CUDA context; the worst rank is the
one whose card holds the most. A rank that ran out of memory answers instead: the first
(the fewest optimizer steps done, then the lowest rank), with PyTorch's message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from memprof.errors import MemprofError
from memprof.report.console import CATEGORY_NAMES
from memprof.report.run_folder import FILE_NAMES, rank_folder, rank_of
from memprof.report.text import visible
from memprof.report.units import format_bytes as fb
from memprof.trace.model import CATEGORIES


@dataclass(frozen=True)
class RankPeak:
    """One rank's peak, from its report (``None``: it wrote none)."""

    rank: int
    report: Path | None
    allocated: int = 0
    reserved: int = 0
    context: int = 0  # the card's CUDA context, as its report assumed or measured
    total: int = 0  # the card's memory (0: not a virtual card)
    steps: int = 0
    exit: dict[str, Any] | None = None
    out_of_memory: bool = False
    card: str = ""  # the card it ran on, as its report names it
    parallelism: dict[str, Any] | None = None  # its run.model.parallelism
    # what was allocated at its peak, by category (its device with the highest peak)
    categories: dict[str, int] = field(default_factory=dict)
    world: int = 1  # the size of the world it was a rank of
    oom_request: int = 0  # the request that ran out of memory (bytes), where one did
    need: int = 0  # what its card must hold, where a re-run with the memory raised told
    unreadable: Path | None = None  # a report there that cannot be read as one

    @property
    def on_card(self) -> int:
        """What the card holds at the peak: reserved memory and the CUDA context."""
        return self.reserved + self.context


@dataclass(frozen=True)
class Cluster:
    """Every rank of a run that was asked for, and the card each ran on."""

    ranks: list[RankPeak]
    card: str
    world_size: int | None = None  # where only some ranks of a world ran
    not_run: str = "--ranks"  # why the others did not

    @property
    def written(self) -> list[RankPeak]:
        return [r for r in self.ranks if r.report is not None]

    def worst(self) -> RankPeak | None:
        """The rank whose card holds the most at its peak (the lowest such rank)."""
        return max(self.written, key=lambda r: (r.on_card, -r.rank), default=None)

    def first_out_of_memory(self) -> RankPeak | None:
        """The rank that ran out of memory first: the fewest steps done, then the lowest."""
        return min((r for r in self.written if r.out_of_memory),
                   key=lambda r: (r.steps, r.rank), default=None)

    def advised(self) -> RankPeak | None:
        """The rank ``suggest`` advises: of those that ran out of memory, the one that needs
        the most (the first where none was told); else the worst."""
        ooms = [r for r in self.written if r.out_of_memory]
        if any(r.need for r in ooms):
            return max(ooms, key=lambda r: (r.need, -r.rank))
        return self.first_out_of_memory() or self.worst()


def rank_reports(folder: Path) -> dict[int, Path]:
    """The ranks' reports in a run folder, by rank: ``rank-K/report.json``, else those of
    the processes the script spawned as the ranks of one world (``mp.spawn``'s,
    ``child-N/report.json``)."""
    found = {rank: path for path in folder.glob(f"rank-*/{FILE_NAMES['report']}")
             if (rank := rank_of(path.parent)) is not None}
    return dict(sorted(found.items())) or _spawned_ranks(folder)


def _spawned_ranks(folder: Path) -> dict[int, Path]:
    """The followed children's reports that are ranks of one world, by rank (none where
    they are not: a pool's workers, or ranks of different worlds)."""
    found: dict[int, Path] = {}
    worlds = set()
    for path in sorted(folder.glob(f"child-*/{FILE_NAMES['report']}")):
        try:
            run = json.loads(path.read_bytes())["run"]
            rank, world = int(run["rank"]), int(run["world_size"])
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if world > 1:
            worlds.add(world)
            found.setdefault(rank, path)
    return dict(sorted(found.items())) if len(worlds) == 1 else {}


def read_cluster(folder: Path, world_size: int | None = None,
                 running: tuple[int, ...] | None = None, not_run: str = "--ranks") -> Cluster:
    """The ranks of the run in ``folder``; with ``world_size``, those that ran (``running``,
    where not all of them did, and ``not_run`` why), a report or not."""
    if world_size is None:
        reports = rank_reports(folder)
    else:  # a world of one writes report.json, as a single run does
        reports = {rank: path for rank in range(world_size) if (path := rank_folder(
            folder, rank, world_size) / FILE_NAMES["report"]).is_file()}
    ranks = list(reports) if world_size is None else running or range(world_size)
    peaks = [_peak(rank, reports[rank]) if rank in reports else RankPeak(rank, None)
             for rank in ranks]
    return Cluster(peaks, next((p.card for p in peaks if p.card), ""),
                   None if running is None or world_size is None else world_size, not_run)


def _peak(rank: int, path: Path) -> RankPeak:
    """A rank's peak from its report; as a rank without one where it cannot be read as one
    (``check`` and ``suggest`` say what is wrong with the report they read)."""
    try:
        data = json.loads(path.read_bytes())
        run, devices = data.get("run") or {}, data.get("devices") or []
        gpu = run.get("virtual_gpu") or {}
        top = max(devices, key=lambda d: int(d["peak"]["allocated_bytes"]), default={})
        return RankPeak(rank, path, int(top["peak"]["allocated_bytes"]) if top else 0,
                     max((int(d["peak"]["reserved_bytes"]) for d in devices), default=0),
                     int(gpu.get("context_bytes", 0)), int(gpu.get("total_bytes", 0)),
                     int(run.get("optimizer_steps") or 0), run.get("exit"),
                     any(d.get("oom") for d in devices),
                     str(gpu.get("spec") or run.get("device") or ""),
                     (run.get("model") or {}).get("parallelism"),
                     {str(k): int(v) for k, v in (top.get("categories") or {}).items()},
                     int(run.get("world_size") or 1),
                     max((int((d.get("oom") or {}).get("requested_bytes") or 0)
                          for d in devices), default=0),
                     int((run.get("need") or {}).get("total_bytes") or 0))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return RankPeak(rank, None, unreadable=path if path.exists() else None)


CLUSTER_SCHEMA = "memprof.cluster/1"
# what no rank's figure holds; said under the table and kept in cluster.json
NOT_COUNTED = ("NCCL's own buffers and each communicator's memory are outside PyTorch's"
               " allocator and not counted (not yet measured on a card): leave headroom for"
               " them on a run over NCCL")


def cluster_summary(cluster: Cluster, nodes: int, per_node: int) -> dict[str, Any]:
    """``cluster.json``: the layout, the answer, the worst rank, how uneven the ranks are,
    and each rank's peak and where its report is (``docs/report-schema.md``)."""
    worst, written = cluster.worst(), cluster.written
    spread = (max(r.reserved for r in written) - min(r.reserved for r in written)
              if written else 0)
    return {
        "schema": CLUSTER_SCHEMA, "world_size": nodes * per_node, "nodes": nodes,
        "ranks_per_node": per_node, "card": cluster.card or None, "answer": answer(cluster),
        "worst_rank": worst.rank if worst is not None else None,
        "reserved_spread_bytes": spread, "not_counted": [NOT_COUNTED],
        # how the model is spread: the strategies and meshes the first rank's saw
        "parallelism": next((r.parallelism for r in written if r.parallelism), None),
        "ranks_run": [r.rank for r in cluster.ranks],
        "ranks": [{
            "rank": r.rank,
            "report": _relative(r.report) if r.report is not None else None,
            "peak_allocated_bytes": r.allocated if r.report is not None else None,
            "peak_reserved_bytes": r.reserved if r.report is not None else None,
            "on_card_bytes": r.on_card if r.report is not None else None,
            "total_bytes": r.total or None, "optimizer_steps": r.steps,
            "out_of_memory": r.out_of_memory,
            "categories": r.categories if r.report is not None else None,
            "ended": (r.exit or {}).get("status") if r.report is not None else None}
            for r in cluster.ranks]}


def _relative(report: Path) -> str:
    """A rank's report as the run folder names it: ``rank-K/report.json`` or a spawned
    rank's ``child-N/report.json`` (a world of one: ``report.json``)."""
    inside = rank_of(report.parent) is not None or report.parent.name.startswith("child-")
    return f"{report.parent.name}/{report.name}" if inside else report.name


def worst_report(folder: Path) -> Path | None:
    """The report of the rank to advise in a run folder of ranks (``Cluster.advised``; None:
    not such a folder). MemprofError where a rank's report cannot be read: the answer
    without it could be wrong."""
    cluster = read_cluster(folder)
    bad = next((r for r in cluster.ranks if r.unreadable), None)
    if bad is not None:
        raise MemprofError(f"{bad.unreadable}: rank {bad.rank}'s report cannot be read as a memprof"
                           " report; the run's answer needs every rank's: run it again")
    advised = cluster.advised()
    return advised.report if advised is not None else None


def answer(cluster: Cluster) -> str:
    """The line that leads: whether the worst rank fits its card, or the first rank that
    ran out of memory and PyTorch's message for it; first, a rank that failed otherwise
    (one that raised before one memprof stopped once another had failed), its error, and
    then only what the ranks held until then (no verdict: the run did not get through)."""
    failed = min((r for r in cluster.ranks if r.report is None or (
        not r.out_of_memory and (r.exit or {}).get("code"))),
        key=lambda r: ((r.exit or {}).get("status") == "stopped", r.rank), default=None)
    verdict = _verdict(cluster, failed is not None)
    if failed is None:
        return verdict or "no rank wrote a report"
    ended = failed.exit or {}
    why = (f"rank {failed.rank} wrote no report" if failed.report is None else
           f"rank {failed.rank} {ended.get('status')} (exit code {ended.get('code')})"
           f" after {failed.steps} step{'s' * (failed.steps != 1)}")
    error = next((line.strip() for line in str(ended.get("error") or "").splitlines()
                  if line.strip()), "")
    why += f": {error.rstrip(':')}" if error else ""
    return f"{why}; {verdict}" if verdict else why


def _verdict(cluster: Cluster, cut_short: bool = False) -> str:
    """Whether the worst rank fits, or the first out of memory ("": no report); of a run
    ``cut_short`` by a failure, what the worst rank held until then."""
    first = cluster.first_out_of_memory()
    if first is not None:
        # the script's own handler may have caught PyTorch's error (and exited)
        error = (first.exit or {}).get("error") or \
            f"CUDA out of memory. Tried to allocate {fb(first.oom_request)}"
        return (f"out of memory on rank {first.rank} at step {first.steps + 1}:"
                f" {error.split(' See documentation')[0].strip()}")
    worst = cluster.worst()
    if worst is None:
        return ""
    if not worst.total:
        return f"worst rank: {fb(worst.reserved)} reserved at its peak (rank {worst.rank})"
    verdict = "does not fit" if worst.on_card > worst.total else \
        "until then" if cut_short else "fits"
    return f"{verdict}: worst rank {fb(worst.on_card)} of {fb(worst.total)} (rank {worst.rank})"


def ranges(ranks: tuple[int, ...]) -> str:
    """``0-3, 7, 63`` for ranks 0, 1, 2, 3, 7 and 63 (sorted)."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


COMPOSITIONS = 4  # columns of the table of what filled the cards: the worst rank's first


def _compositions(cluster: Cluster) -> Table | None:
    """What was allocated at each rank's peak, by category: a column per composition
    (ranks that hold the same bytes share one), the worst rank's first; None for one rank,
    or where no rank allocated anything."""
    worst = cluster.worst()
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in cluster.written:
        groups.setdefault(tuple(r.categories.get(k, 0) for k in CATEGORIES), []).append(r.rank)
    if worst is None or len(cluster.written) < 2 or not any(any(held) for held in groups):
        return None
    order = sorted(groups.items(), key=lambda g: (worst.rank not in g[1], g[1][0]))
    t = Table(box=None, header_style="bold", title_justify="left", title_style="bold",
              title="What was allocated at each rank's peak")
    t.add_column("")
    for _, ranks in order[:COMPOSITIONS]:
        t.add_column(f"rank{'s' * (len(ranks) > 1)} {ranges(tuple(ranks))}", justify="right")
    for i, category in enumerate(CATEGORIES):
        if any(held[i] for held, _ in order[:COMPOSITIONS]):
            t.add_row(CATEGORY_NAMES[category], *(fb(held[i]) for held, _ in order[:COMPOSITIONS]))
    if len(order) > COMPOSITIONS:
        t.caption = (f"{len(order) - COMPOSITIONS} more compositions: each rank's report"
                     " (rank-K/) has its own")
    return t


def render_cluster(cluster: Cluster, console: Console) -> None:
    """The answer, then a row per rank and how uneven they are."""
    console.print(Text(visible(answer(cluster)), "bold"))
    t = Table(box=None, header_style="bold")
    for col in ("rank", "peak allocated", "peak reserved", "on the card", "headroom", "ended"):
        t.add_column(col, justify="right" if col != "ended" else "left")
    for r in cluster.ranks:
        if r.report is None:
            t.add_row(str(r.rank), "", "", "", "", "no report")
            continue
        ended = (r.exit or {}).get("status", "")
        if r.out_of_memory:
            ended = "out of memory"
        t.add_row(str(r.rank), fb(r.allocated), fb(r.reserved), fb(r.on_card),
                  fb(r.total - r.on_card) if r.total else "", ended)
    console.print(t)
    composition = _compositions(cluster)
    if composition is not None:
        console.print(composition)
    written = cluster.written
    if len(written) > 1:
        high = max(written, key=lambda r: (r.reserved, -r.rank))
        low = min(written, key=lambda r: (r.reserved, r.rank))
        spread = high.reserved - low.reserved
        console.print(Text(
            "Every rank peaks at the same reserved memory." if not spread else
            f"Ranks differ by {fb(spread)} reserved at their peaks (rank {high.rank} the most,"
            f" rank {low.rank} the least).", "dim"))
    if cluster.world_size is not None:
        shown = len(cluster.ranks)
        console.print(Text(f"{cluster.world_size - shown} of the world's {cluster.world_size}"
                           f" ranks were not run ({cluster.not_run}): the answer is the ranks"
                           " run.", "dim"))
    console.print(Text(f"{NOT_COUNTED}.", "dim"))
