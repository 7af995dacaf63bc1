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
    # the run ran out of memory: how the advice stands to it (None when it did not)
    out_of_memory: str | None = None
    # the peak is of what ran before the run ran out of memory or failed: what it needs is
    # unknown
    lower_bound: bool = False
    failed: str | None = None  # the run raised otherwise: how the advice stands to it

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
    folders = [*(p.parent for p in reports.glob(f"*/{REPORT_NAME}")),  # a run's
               *(p.parent.parent for p in reports.glob(f"*/rank-*/{REPORT_NAME}"))  # a cluster's
               ] if reports.is_dir() else []
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
    if any(d.get("oom") for d in report.data["devices"]):
        return _out_of_memory(report.data, folder, report.path)
    run = _run(report.path, report.data)
    ended = run.facts.get("exit")
    if isinstance(ended, dict) and ended.get("code") and ended.get("status") == "raised":
        from dataclasses import replace

        steps = run.facts.get("optimizer_steps") or 0
        error = str(ended.get("error") or "an error").splitlines()[0].rstrip(".")
        return replace(run, lower_bound=True, failed=(
            f"The run raised {error} after {steps} optimizer step{'s' * (steps != 1)}, so its"
            " peak is a lower bound of what it needs; the savings below are of what ran"
            " (fix the error and run it again for the whole run's)."))
    return run


def _run(path: Path, data: dict[str, Any], out_of_memory: str | None = None,
         lower_bound: bool = False) -> Run:
    snapshot = path.parent / path.name.replace("report", "snapshot").replace(".json", ".pickle")
    return Run(path, data, _largest(data["devices"]), snapshot if snapshot.is_file() else None,
               any(d.get("categories_inferred") for d in data["devices"]), out_of_memory,
               lower_bound)


def _out_of_memory(data: dict[str, Any], folder: Path, path: Path) -> Run:
    """A run that ran out of memory: advised from its re-run with the memory raised
    (``memprof run``'s ``need`` folder) where there is one, else from its own peak, a
    lower bound."""
    from memprof.collect.virtual.need import NEED_FOLDER
    from memprof.report.units import format_bytes as fb

    run = data.get("run") if isinstance(data.get("run"), dict) else {}
    need = run.get("need") if isinstance(run.get("need"), dict) else {}
    again = folder / NEED_FOLDER / REPORT_NAME
    if isinstance(need.get("total_bytes"), int) and again.is_file():
        rerun = load_report(again, "the re-run's report")
        allowed = need.get("allowed_bytes")
        capped = f", where the run could reserve only {fb(allowed)}" if allowed else ""
        return _run(rerun.path, rerun.data, f"The run ran out of memory; advising from its"
                    f" re-run with the card's memory raised ({again.parent}), which needs"
                    f" {fb(need['total_bytes'])}{capped}.")
    why = need.get("unknown") if isinstance(need.get("unknown"), str) else \
        "no re-run with the memory raised: memprof suggest RUN --predict re-runs it on the" \
        " virtual GPU"
    return _run(path, data, f"The run ran out of memory, so its peak is a lower bound of what"
                f" it needs ({why}); the savings below are of what ran.", lower_bound=True)


def _from_snapshot(path: Path) -> Run:
    from memprof.analysis.explain import explain
    from memprof.report.json import report_dict
    from memprof.trace.load import load_snapshot

    findings = explain(load_snapshot(path), str(path))
    data = report_dict(findings, "explain")
    if not data["devices"]:
        raise MemprofError(f"{path}: the snapshot is empty; nothing to advise on")
    ran_out = any(d.get("oom") for d in data["devices"])
    return Run(path, data, _largest(data["devices"]), path, True,
               "The snapshot ran out of memory, so its peak is a lower bound of what the run"
               " needs (memprof run of its script tells it); the savings below are of"
               " what ran." if ran_out else None, ran_out)


def _largest(devices: list[dict[str, Any]]) -> dict[str, Any]:
    return max(devices, key=lambda d: d["peak"]["reserved_bytes"])
