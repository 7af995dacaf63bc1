"""Reading reports to compare: a run folder or a ``report.json``, checked before any use."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memprof.errors import MemprofError
from memprof.report.checked import first_problem
from memprof.report.json import SCHEMA
from memprof.trace.fields import describe

REPORT_NAME = "report.json"
MAX_REPORT_BYTES = 256 << 20  # a report is kilobytes; anything near this is not one


@dataclass(frozen=True)
class Report:
    """A checked report: the raw JSON and where it came from."""

    path: Path
    data: dict[str, Any]

    @property
    def run(self) -> dict[str, Any]:
        run = self.data.get("run")
        return run if isinstance(run, dict) else {}

    def devices(self) -> dict[tuple[int, int | None], dict[str, Any]]:
        """The devices of the report by (device index, rank)."""
        return {(d["device"], d.get("rank")): d for d in self.data["devices"]}


def report_path(source: Path) -> Path:
    """The ``report.json`` that ``source`` (a run folder or the file itself) names; in a
    folder of ranks (``rank-K/report.json``), the worst rank's (``report/cluster.py``)."""
    if not source.is_dir():
        return source
    if not (source / REPORT_NAME).exists():
        from memprof.report.cluster import worst_report

        return worst_report(source) or source / REPORT_NAME
    return source / REPORT_NAME


def load_report(source: Path, role: str) -> Report:
    """Read and check the report at ``source``; ``role`` ("current", "baseline") names it in
    errors, which are :class:`MemprofError` (one line, exit 2)."""
    path = report_path(source)
    if not path.exists() and source.is_dir():  # reports/, say: a folder of run folders
        raise MemprofError(f"{role} {source}: a folder without a report.json, not a run"
                           " folder; give one of the run folders memprof run wrote in it")
    if not path.exists():
        raise MemprofError(f"{role} {source}: not found; give a run folder or a report.json")
    if not path.is_file():
        raise MemprofError(f"{role} {path}: not a regular file; give a run folder or a"
                           " report.json")
    try:
        if path.stat().st_size > MAX_REPORT_BYTES:
            raise MemprofError(f"{role} {path}: too large to be a memprof report")
        data = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not valid JSON"
        raise MemprofError(f"{role} {path}: cannot be read ({reason})") from None
    problem = _problem(data)
    children = sorted(path.parent.glob(f"child-*/{REPORT_NAME}"))
    if problem == "no devices" and children:
        from memprof.report.cluster import worst_report

        if (ranks := worst_report(path.parent)) is not None:  # mp.spawn's ranks: the worst
            return load_report(ranks, role)
        raise MemprofError(f"{role} {path}: the script made no CUDA tensor itself; the"
                           " processes it spawned did: give one of their run folders, such"
                           f" as {children[0].parent}")
    if problem == "no devices" and isinstance(data.get("run"), dict) \
            and data["run"].get("virtual_gpu"):
        raise MemprofError(f"{role} {path}: the run made no CUDA tensor, so the virtual GPU held"
                           " nothing to measure; run the script with --device cpu to profile"
                           " its host tensors")
    if problem:
        raise MemprofError(f"{role} {path}: not a memprof report ({problem})")
    return Report(path, data)


def load_ranks(source: Path, role: str) -> Report:
    """The report ``check`` compares: a run's, or, in a folder of ranks (``rank-K/``, or the
    ranks a script spawned), every rank's as one, each rank's devices under its rank (the
    run's facts are the first rank's)."""
    from memprof.report.cluster import rank_reports

    ranks = rank_reports(source) if source.is_dir() else {}
    if len(ranks) < 2:
        return load_report(source, role)
    reports = {rank: load_report(path, role) for rank, path in ranks.items()}
    first = next(iter(reports.values()))
    devices = [{**d, "rank": rank} for rank, r in reports.items() for d in r.data["devices"]]
    return Report(source, {**first.data, "devices": devices})


def _problem(data: Any) -> str | None:
    if not isinstance(data, dict):
        return "expected a JSON object"
    if data.get("schema") != SCHEMA:
        return f"schema {describe(data.get('schema'))}, expected {SCHEMA!r}"
    if data.get("devices") == []:
        return "no devices"
    return first_problem(data)
