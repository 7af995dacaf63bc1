"""Compare a report with its baseline: pure, from two checked reports to a verdict."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any

from memprof.gate.metrics import Limit, Metric
from memprof.gate.reports import Report

REGRESSION, IMPROVEMENT, WITHIN = "regression", "improvement", "within limit"


class Incomparable(Exception):
    """The two reports measure different things; comparing them could pass by accident."""


@dataclass(frozen=True)
class Change:
    """Something that grew or shrank between baseline and current."""

    name: str
    baseline_bytes: int
    current_bytes: int

    @property
    def delta(self) -> int:
        return self.current_bytes - self.baseline_bytes


@dataclass
class DeviceVerdict:
    """The metric of one device, baseline against current, and what changed most."""

    device: int
    rank: int | None
    baseline_bytes: int
    current_bytes: int
    allowed_bytes: int
    verdict: str
    reason: str = ""  # why the verdict is what it is when the numbers alone do not say
    categories: list[Change] = field(default_factory=list)
    sites: list[Change] = field(default_factory=list)
    modules: list[Change] = field(default_factory=list)

    @property
    def delta(self) -> int:
        return self.current_bytes - self.baseline_bytes

    @property
    def change(self) -> float | None:
        """The relative change, None from a zero baseline."""
        return self.delta / self.baseline_bytes if self.baseline_bytes else None


@dataclass
class Verdict:
    """The gate's answer: exit 1 when any device regressed."""

    metric: Metric
    limit: Limit
    devices: list[DeviceVerdict]
    notes: list[str] = field(default_factory=list)  # differences allowed or not affecting bytes
    # what the run itself changed (its arguments, precision, checkpointing, optimizer): the
    # first explanation of a regression, before the bytes by category, site and module
    run_changes: list[str] = field(default_factory=list)

    @property
    def regressed(self) -> bool:
        return any(d.verdict == REGRESSION for d in self.devices)

    @property
    def improved(self) -> bool:
        return not self.regressed and any(d.verdict == IMPROVEMENT for d in self.devices)


def compare(current: Report, baseline: Report, metric: Metric, limit: Limit,
            device: int | None = None, allow_different: bool = False, top: int = 3) -> Verdict:
    """Compare ``current`` with ``baseline``; raise :class:`Incomparable` when they differ in
    what they measure (unless ``allow_different``, which turns the differences into notes)."""
    differences = _differences(current, baseline)
    if differences and not allow_different:
        raise Incomparable("; ".join(differences))
    mine, theirs = current.devices(), baseline.devices()
    if device is not None:
        mine = {k: v for k, v in mine.items() if k[0] == device}
        theirs = {k: v for k, v in theirs.items() if k[0] == device}
        if not mine or not theirs:
            raise Incomparable(f"device {device} is not in both reports")
    if mine.keys() != theirs.keys():
        raise Incomparable(f"devices differ: current has {_keys(mine)}, baseline {_keys(theirs)}")
    devices = [_device(key, mine[key], theirs[key], metric, limit, current, top)
               for key in sorted(mine, key=lambda k: (k[0], k[1] or 0))]
    notes = [f"compared although {d}" for d in differences]
    if current.run.get("torch_version") != baseline.run.get("torch_version"):
        notes.append(f"PyTorch changed from {baseline.run.get('torch_version')} to"
                     f" {current.run.get('torch_version')}")
    return Verdict(metric, limit, devices, notes, run_changes(current, baseline))


# the facts of run.model that change memory, as a person reads them
_FACTS: tuple[tuple[str, str, Any], ...] = (
    ("parameters", "parameters", lambda v: f"{v:,}" if isinstance(v, int) else None),
    ("autocast", "autocast", lambda v: v if isinstance(v, str) else "off"),
    ("activation checkpointing", "checkpointed",
     lambda v: ", ".join(map(str, v)) if isinstance(v, list) and v else "none"),
    ("optimizer", "optimizers", lambda v: ", ".join(
        str(o.get("class")) for o in v if isinstance(o, dict)) if isinstance(v, list) else None),
    ("zero_grad(set_to_none)", "zero_grad_set_to_none",
     lambda v: str(v) if isinstance(v, bool) else None),
    ("fused attention", "attention",
     lambda v: str(v.get("fused")) if isinstance(v, dict) else None),
    ("parameter dtypes", "dtypes",
     lambda v: ", ".join(sorted(map(str, v))) if isinstance(v, dict) else None),
)


def run_changes(current: Report, baseline: Report) -> list[str]:
    """What differs between the two runs themselves: the script's arguments, then the model
    facts that change memory (precision, checkpointing, optimizer, size)."""
    found = []
    before, after = baseline.run.get("command"), current.run.get("command")
    if isinstance(before, list) and isinstance(after, list) and before != after:
        found.append(f"the command: {_arguments(before, after)}")
    model_before, model_after = baseline.run.get("model"), current.run.get("model")
    if isinstance(model_before, dict) and isinstance(model_after, dict):
        for title, key, shown in _FACTS:
            a, b = shown(model_before.get(key)), shown(model_after.get(key))
            if a != b and a is not None and b is not None:
                found.append(f"{title}: {a} in the baseline, {b} now")
    return found


def _arguments(before: list[Any], after: list[Any]) -> str:
    """The arguments that differ: ``--batch 32 → 64``, ``+ --hidden 1024`` (added),
    ``- --amp bf16`` (gone)."""
    a, b = [str(x) for x in before], [str(x) for x in after]
    parts = []
    for op, i, j, k, m in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if op == "replace":
            flag = f"{a[i - 1]} " if i and a[i - 1].startswith("-") else ""
            parts.append(f"{flag}{' '.join(a[i:j])} → {' '.join(b[k:m])}")
        elif op == "insert":
            parts.append(f"+ {' '.join(b[k:m])}")
        elif op == "delete":
            parts.append(f"- {' '.join(a[i:j])}")
    return "; ".join(parts)


def _keys(devices: dict[tuple[int, int | None], Any]) -> str:
    return ", ".join(f"device {d}" + ("" if r is None else f" rank {r}")
                     for d, r in sorted(devices, key=lambda k: (k[0], k[1] or 0))) or "none"


def _differences(current: Report, baseline: Report) -> list[str]:
    """What makes the two reports measure different things."""
    found = []
    for what, key in (("device", lambda r: r.run.get("device")),
                      ("virtual GPU", lambda r: _spec(r.run.get("virtual_gpu"))),
                      ("allocator settings", lambda r: r.data.get("source", {}).get(
                          "allocator_conf")),
                      ("prediction", lambda r: "predicted" if r.run.get("predicted")
                       else "measured")):
        a, b = key(current), key(baseline)
        if a != b:
            found.append(f"the {what} differs (current {a!r}, baseline {b!r})")
    for role, report in (("baseline", baseline), ("current", current)):
        ended = report.run.get("exit")
        if isinstance(ended, dict) and ended.get("code") not in (0, None) and not _oom(report):
            found.append(f"the {role} run did not complete ({ended.get('status')}, exit code"
                         f" {ended.get('code')}): its peak covers part of the run")
    return found


def _spec(virtual: Any) -> Any:
    return virtual.get("spec") if isinstance(virtual, dict) else virtual


def _oom(report: Report) -> bool:
    return any(d.get("oom") for d in report.data["devices"])


def _device(key: tuple[int, int | None], mine: dict[str, Any], theirs: dict[str, Any],
            metric: Metric, limit: Limit, current: Report, top: int) -> DeviceVerdict:
    now, before = metric.value(mine), metric.value(theirs)
    if now is None or before is None:
        raise Incomparable(f"{metric.name} is not in the {'current' if now is None else 'baseline'}"
                           " report (category peaks need `memprof run` reports)")
    allowed = limit.allowed(before)
    reason = ""
    if mine.get("oom") and not theirs.get("oom"):
        verdict, reason = REGRESSION, "the current run ran out of memory"
    elif now - before > allowed:
        verdict = REGRESSION
    elif before - now > allowed:
        verdict = IMPROVEMENT
    else:
        verdict = WITHIN
    return DeviceVerdict(
        device=key[0], rank=key[1], baseline_bytes=before, current_bytes=now,
        allowed_bytes=allowed, verdict=verdict, reason=reason,
        categories=_grown(_categories(theirs), _categories(mine), None),
        sites=_grown(_sites(theirs), _sites(mine), top),
        modules=_grown(_modules(theirs), _modules(mine), top))


def _categories(device: dict[str, Any]) -> dict[str, int]:
    table = device.get("categories")
    return {k: v for k, v in table.items() if isinstance(v, int)} if isinstance(table, dict) else {}


_LINE = re.compile(r":\d+ ")


def _sites(device: dict[str, Any]) -> dict[str, int]:
    """Bytes at the peak by site, keyed without line numbers so that an edit above a line
    does not turn one site into a vanished one and a new one."""
    sites: dict[str, int] = {}
    for s in device.get("top_sites") or []:
        if isinstance(s, dict) and isinstance(s.get("site"), str) and isinstance(s.get("bytes"),
                                                                                 int):
            key = _LINE.sub(" ", s["site"] + " ")[:-1]
            sites[key] = sites.get(key, 0) + s["bytes"]
    return sites


def _modules(device: dict[str, Any]) -> dict[str, int]:
    modules: dict[str, int] = {}
    for m in device.get("top_modules") or []:
        if isinstance(m, dict) and isinstance(m.get("module"), str) and isinstance(m.get("bytes"),
                                                                                   int):
            modules[m["module"]] = m["bytes"]
    return modules


def _grown(before: dict[str, int], after: dict[str, int], top: int | None) -> list[Change]:
    """The ``top`` largest changes (all with None), largest first."""
    changes = [Change(k, before.get(k, 0), after.get(k, 0)) for k in before.keys() | after.keys()]
    changes = [c for c in changes if c.delta]
    changes.sort(key=lambda c: (-abs(c.delta), c.name))
    return changes[:top]
