"""What the ranks of a distributed run that ran out of memory need: the world run again on
its virtual cards with their memory raised, as ``need.py`` does for one process.

A rank's peak is a lower bound once any rank ran out of memory: that rank never got past
it, and the others were stopped with it. The same ranks run again, silently, each on the
same card with memory enough for anything; each rank's re-run becomes its run folder's
``need/`` (where ``memprof suggest`` advises from it) and its ``run.need`` goes into its
report, as ``memprof run`` writes them for one process.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from memprof.collect.launch.ranks import Ranks, run_ranks
from memprof.collect.virtual.cards import Card, card_args
from memprof.collect.virtual.need import (
    MIN_SECONDS,
    NEED_FOLDER,
    RAISED_BYTES,
    SLOWER,
    STEPS_PAST,
    Need,
    need_of,
)
from memprof.report.cluster import Cluster
from memprof.report.json import write_json
from memprof.report.run_folder import rank_folder


def cluster_need(command: list[str], ranks: Ranks, folder: Path, card: Card, conf: str,
                 cluster: Cluster, steps_asked: int | None, at_once: int | None
                 ) -> dict[int, dict[str, Any]]:
    """Run ``command``'s ``ranks`` again with the cards' memory raised; each rank's
    ``run.need`` (written into its report too), by rank."""
    written = cluster.written
    steps = steps_asked or min(r.steps for r in written) + STEPS_PAST + 1
    seconds = max(MIN_SECONDS, SLOWER * max(_duration(r.report) for r in written))
    scratch = folder / f".{NEED_FOLDER}"
    shutil.rmtree(scratch, ignore_errors=True)
    run_ranks(ranks, [sys.executable, "-m", "memprof", "run", "--cluster-rank", "--force",
                      "--no-need", "--no-timeline", "-o", str(scratch), *card_args(card),
                      "--virtual-gpu-memory", str(RAISED_BYTES), "--alloc-conf", conf,
                      "--steps", str(steps), "--seconds", f"{seconds:g}", *command],
              at_once, quiet=True)
    needs = {}
    for r in written:
        again = rank_folder(scratch, r.rank, ranks.world_size)
        try:
            need: Need | str = need_of(json.loads((again / "report.json").read_text()), card)
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            need = "the re-run with the memory raised wrote no report"
        if isinstance(need, Need):
            kept = rank_folder(folder, r.rank, ranks.world_size) / NEED_FOLDER
            shutil.rmtree(kept, ignore_errors=True)
            shutil.move(again, kept)
        needs[r.rank] = need.as_dict() if isinstance(need, Need) else {"unknown": need}
        if r.report is not None:
            data = json.loads(r.report.read_text())
            write_json({**data, "run": {**data["run"], "need": needs[r.rank]}}, r.report,
                       overwrite=True)
    shutil.rmtree(scratch, ignore_errors=True)
    return needs


def _duration(report: Path | None) -> float:
    try:
        return float(json.loads(report.read_text())["run"]["duration_s"]) if report else 0.0
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


def worst_need(needs: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """``cluster.json``'s ``need``: the rank that needs the most, with its ``run.need``; or
    the first rank's reason where none could be told."""
    told = {rank: n for rank, n in needs.items() if "total_bytes" in n}
    if not told:
        return next(({"rank": rank, **n} for rank, n in needs.items()), None)
    rank = max(told, key=lambda k: (told[k]["total_bytes"], -k))
    return {"rank": rank, **told[rank]}
