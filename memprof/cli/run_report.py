"""What ``memprof run`` puts in report.json's ``run`` entry, and the exit code it gives."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:
    from memprof.analysis.findings import DeviceFindings, Findings
    from memprof.collect.launch.script import Target
    from memprof.collect.recording import Recording


def run_facts(recording: Recording, meta: dict[str, Any], target: Target,
              launched: dict[str, Any], conf: str, need: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """The report's ``run`` entry: the command, how it ended, the model, what a run that
    ran out of memory needs."""
    import torch

    from memprof.collect.launch.script import launcher_env, torchrun_rank
    from memprof.report.console import NO_STEPS_RECORDED
    from memprof.report.provenance import sign

    outcome = recording.outcome
    this_rank, world = torchrun_rank()
    if "RANK" not in os.environ and meta.get("world"):  # a rank mp.spawn started
        this_rank, world = int(meta["world"]["rank"]), int(meta["world"]["size"])
    facts = {
        "command": run_command(target),
        **launched,
        "launcher_env": launcher_env(),
        "torch_version": torch.__version__,
        "device": recording.device,
        "predicted": recording.predicted,
        "allocator_conf": conf,
        "duration_s": round(recording.seconds, 3),
        "exit": {"status": outcome.status, "code": outcome.exit_code, "error": outcome.error},
        "stopped_by": outcome.stopped_by,
        "optimizer_steps": len(meta["steps"]),
        "no_steps_reason": None if meta["steps"] else NO_STEPS_RECORDED,
        "rank": this_rank,
        "world_size": world,
        "cuda": recording.facts or None,
        "model": meta.get("model") or None,
        **({"virtual_gpu": recording.virtual_gpu} if recording.virtual_gpu else {}),
        **({"need": need} if need is not None else {}),
    }
    return {**facts, "signature": sign(facts)}


def run_command(target: Target) -> list[str]:
    """The command line the report shows for a run of ``target``."""
    return ["memprof", "run", *target.option, target.name, *target.args]


def gate(findings: Findings, limit: int | None, exit_code: int, notes: Console) -> int:
    """The exit code: the script's, or 1 when it succeeded but its peak broke --max-peak."""
    from memprof.report.units import format_bytes

    peak = max((_peak_reserved(d) for d in findings.devices), default=0)
    if limit is None or peak <= limit:
        return exit_code
    notes.print(f"memprof: peak reserved {format_bytes(peak)} exceeds --max-peak"
                f" {format_bytes(limit)}", markup=False, highlight=False)
    return exit_code or 1


def _peak_reserved(d: DeviceFindings) -> int:
    """The peak reserved bytes, or what the run held before a ring buffer's kept events
    where that was more (reserved where counted, else allocated: a lower bound)."""
    earlier = d.peak_before_window()
    return max([d.peak_reserved_bytes, *(v for v in (earlier or ())[:2] if v)])


_TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT")


def launcher_hint(error: str | None) -> str | None:
    """memprof's line for a script that died reading what torchrun sets (``KeyError:
    'LOCAL_RANK'``, env:// rendezvous without ``RANK``) outside a launcher; else None."""
    if not error or "RANK" in os.environ:
        return None
    named = next((v for v in _TORCHRUN if f"KeyError: '{v}'" in error
                  or f"environment variable {v} expected" in error), None)
    if named is None:
        return None
    return (f"memprof: the script reads torchrun's {named}, which only a launcher sets: run it"
            " as torchrun would with memprof run --nproc-per-node N (one process per GPU)")


_ON_VALUES = ("ZeroDivisionError", "ValueError: math domain error", "OverflowError")


def placeholder_hint(error: str | None, read: bool) -> str | None:
    """memprof's line for a script that died on a value computed from the placeholder
    zeros the virtual GPU's large tensors give (a division by a loss, a log of it)."""
    if not read or not error or not error.startswith(_ON_VALUES):
        return None
    return (f"memprof: the script died on a value ({error.split(':')[0]}) after reading the"
            " placeholder zeros of large virtual tensors (said above): on a card that value"
            " comes from the computation; --device cpu runs the script on real values")
