"""``memprof run``: profile an unmodified training script or module."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from memprof.errors import MemprofError

if TYPE_CHECKING:
    from memprof.collect.virtual.cards import Card


def run(
    ctx: typer.Context,
    module: Annotated[str | None, typer.Option(
        "-m", metavar="MODULE", help="Run a library module as a script, as `python -m` does.",
        show_default=False)] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="The run folder (default: reports/SCRIPT-YYYYmmdd-HHMMSS).",
        show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite files already in"
                                        " the run folder.")] = False,
    device: Annotated[str, typer.Option(
        "--device", help="auto: the GPU's own allocator history when CUDA is available, else"
        " memprof's CPU recorder and a predicted CUDA layout; or force cpu / cuda.")] = "auto",
    alloc_conf: Annotated[str | None, typer.Option(
        "--alloc-conf", metavar="CONF", help="Allocator settings for the CPU prediction"
        " (default: $PYTORCH_CUDA_ALLOC_CONF), e.g. 'expandable_segments:True'.",
        show_default=False)] = None,
    max_entries: Annotated[int, typer.Option(
        "--max-entries", min=1000, help="CUDA: events the allocator history keeps (a ring"
        " buffer).")] = 1_000_000,
    virtual_gpu: Annotated[str | None, typer.Option(
        "--virtual-gpu", metavar="SPEC", help="Run on a virtual GPU: a card (H100, 'A100 40GB',"
        " 'RTX 4090', V100, T4, ...) or a size such as 24GiB. CUDA tensors get real shapes but"
        " no storage or compute; memory is predicted for the card. Default without a GPU:"
        " H100 80GB.", show_default=False)] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Allocation sites to list.")] = 10,
    profile: Annotated[bool, typer.Option(
        "--profile", help="Also run torch.profiler over optimizer steps 2-3 and write its"
        " Chrome trace (open in chrome://tracing or Perfetto) to the run folder.")] = False,
    script: Annotated[list[str] | None, typer.Argument(
        metavar="[SCRIPT] [ARGS]...", help="The script and its arguments (with -m: the"
        " module's arguments). Options after the script go to the script.",
        show_default=False)] = None,
) -> None:
    """Run a training script unmodified and break its peak memory into parameters,
    gradients, optimizer state, activations, temporaries, the allocator's cache and the
    CUDA context.

    The script runs in this process as Python would run it; its output is untouched and
    memprof speaks on stderr. The exit code is the script's. A run folder gets
    report.json, snapshot.pickle (open it with `memprof explain` or PyTorch's memory
    viewer) and timeline.png, however the script ends.

    Examples: `memprof run train.py --epochs 1`, `memprof run -m mypkg.train`,
    `torchrun --nproc-per-node 2 -m memprof run train_ddp.py` (one report per rank).
    """
    from memprof.collect.launch import Target

    args = list(script or [])
    if module is None and not args:
        raise MemprofError("nothing to run: give a script (memprof run train.py) or -m MODULE")
    target = Target(module, tuple(args), True) if module else Target(args[0], tuple(args[1:]),
                                                                     False)
    target.check()  # before the slow imports: a typo gets its answer at once

    from memprof.analysis.explain import explain
    from memprof.analysis.settings import parse_alloc_conf, unmodelled
    from memprof.collect import cuda, session
    from memprof.report.json import report_dict, write_json
    from memprof.report.plot import plot_timeline
    from memprof.report.run_folder import claim, file_names, run_folder, write_snapshot
    from memprof.report.run_summary import render_run
    from memprof.trace.normalize import normalize

    if device not in ("auto", "cpu", "cuda"):
        raise MemprofError(f"--device {device!r}: expected auto, cpu or cuda")
    use_cuda = device == "cuda" or (device == "auto" and cuda.available())
    if device == "cuda" and not cuda.available():
        raise MemprofError("--device cuda: no CUDA device is available here")
    card = virtual_card(virtual_gpu, device == "auto" and not use_cuda)
    if card is not None:
        use_cuda = False
    conf = alloc_conf if alloc_conf is not None else os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    try:
        settings = parse_alloc_conf(conf)
    except ValueError as exc:
        raise MemprofError(f"allocator settings {conf!r}: {exc}") from None
    problems = unmodelled(settings, capped=card is not None)
    if problems and not use_cuda:
        raise MemprofError(f"allocator settings {conf!r} for the prediction:"
                           f" {'; '.join(problems)}")
    rank, world = session.rank()
    folder = run_folder(target.stem, output, world)
    names = file_names(rank, world)
    claim(folder, names, force)

    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    profile_path = folder / names["profile"] if profile else None
    if card is not None:
        from memprof.collect.virtual.session import record_virtual

        announce = None if virtual_gpu else (
            f"memprof: no GPU here: CUDA runs on a virtual {card.name} (--virtual-gpu SPEC for"
            " another card, --device cpu to record host tensors instead)")
        recording = record_virtual(target, card, settings, profile_path, announce)
    else:
        recording = session.record(target, use_cuda, max_entries, settings, profile_path)
    notes = Console(stderr=True, soft_wrap=True)
    findings = explain(normalize(recording.snapshot), str(folder / names["snapshot"]), top=top)
    import torch

    facts = {
        "command": ["memprof", "run", *(["-m"] if module else []), target.name, *target.args],
        "started": started,
        "torch_version": torch.__version__,
        "device": recording.device,
        "predicted": recording.predicted,
        "allocator_conf": settings.conf,
        "duration_s": round(recording.seconds, 3),
        "exit": {"status": recording.outcome.status, "code": recording.outcome.exit_code,
                 "error": recording.outcome.error},
        "rank": rank,
        "world_size": world,
        "cuda": recording.facts or None,
        **({"virtual_gpu": recording.virtual_gpu} if recording.virtual_gpu else {}),
    }
    write_snapshot(recording.snapshot, folder / names["snapshot"])
    if recording.oom_snapshot is not None:
        write_snapshot(recording.oom_snapshot, folder / names["oom-snapshot"])
    write_json(report_dict(findings, "run", facts), folder / names["report"])
    if findings.devices:
        plot_timeline(findings, folder / names["timeline"], " ".join(facts["command"][2:]))
        if rank == 0:
            for d in findings.devices:
                render_run(d, facts, notes)
    if rank == 0:
        files = ", ".join(sorted(p.name for p in folder.iterdir()))
        notes.print(f"\nRun folder: {folder}/ ({files})")
        notes.print(f"Next: memprof explain {folder if world > 1 else folder / names['snapshot']}")
    sys.stdout.flush()
    raise typer.Exit(recording.outcome.exit_code)


def virtual_card(spec: str | None, by_default: bool) -> Card | None:
    """The card of ``--virtual-gpu SPEC``, the default card where there is no GPU, or None."""
    from memprof.collect.virtual.cards import DEFAULT_CARD, parse_spec

    if spec is None:
        return DEFAULT_CARD if by_default else None
    try:
        return parse_spec(spec)
    except ValueError as exc:
        raise MemprofError(f"--virtual-gpu {spec!r}: {exc}") from None
