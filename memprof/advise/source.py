"""The run ``memprof suggest`` advises on: a run folder, a report.json or a snapshot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memprof.errors import MemprofError
from memprof.gate.reports import REPORT_NAME, load_report


@dataclass(frozen=True)
class Run:
    """A run's report, its device with the highest peak, and what is known of its model."""

    path: Path
    report: dict[str, Any]
    device: dict[str, Any]
    snapshot: Path | None  # the trace, for allocator what-ifs
    inferred: bool  # categories inferred from stacks (a plain snapshot), not recorded

    @property
    def facts(self) -> dict[str, Any]:
        """``run`` of the report (empty for a snapshot)."""
        run = self.report.get("run")
        return run if isinstance(run, dict) else {}

    @property
    def model(self) -> dict[str, Any]:
        """What the recorder saw of the model and optimizers (empty when not recorded)."""
        model = self.facts.get("model")
        return model if isinstance(model, dict) else {}


def newest_run(reports: Path) -> Path:
    """The newest run folder under ``reports`` (the default SOURCE)."""
    folders = [p.parent for p in reports.glob(f"*/{REPORT_NAME}")] if reports.is_dir() else []
    if not folders:
        raise MemprofError(f"no run folder under {reports}/: profile a run first"
                           " (memprof run train.py) or give SOURCE")
    return max(folders, key=lambda p: p.stat().st_mtime)


def is_snapshot(source: Path) -> bool:
    """Whether SOURCE is a snapshot file (not a run folder or a report.json)."""
    return source.is_file() and source.suffix != ".json"


def load_run(source: Path) -> Run:
    """Read SOURCE: a run folder, a report.json, or a PyTorch snapshot (errors: one line)."""
    if is_snapshot(source):
        return _from_snapshot(source)
    report = load_report(source, "source")
    folder = report.path.parent
    snapshot = folder / "snapshot.pickle"
    return Run(report.path, report.data, _largest(report.data["devices"]),
               snapshot if snapshot.is_file() else None,
               any(d.get("categories_inferred") for d in report.data["devices"]))


def _from_snapshot(path: Path) -> Run:
    from memprof.analysis.explain import explain
    from memprof.report.json import report_dict
    from memprof.trace.load import load_snapshot

    findings = explain(load_snapshot(path), str(path))
    data = report_dict(findings, "explain")
    if not data["devices"]:
        raise MemprofError(f"{path}: the snapshot is empty; nothing to advise on")
    return Run(path, data, _largest(data["devices"]), path, True)


def _largest(devices: list[dict[str, Any]]) -> dict[str, Any]:
    return max(devices, key=lambda d: d["peak"]["reserved_bytes"])
