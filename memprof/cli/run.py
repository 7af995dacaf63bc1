"""``memprof run``: profile an unmodified training script or module."""

from __future__ import annotations

import os
import shlex
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from memprof.cli.options import flag
from memprof.cli.run_options import max_peak as max_peak_bytes
from memprof.cli.run_options import virtual_card
from memprof.cli.run_report import (
    gate,
    launcher_hint,
    placeholder_hint,
    run_command,
    run_facts,
)
from memprof.errors import MemprofError
from memprof.trace.fields import describe

# PyTorch's allocator history and memprof's recorders alike: enough for the few steps a memory
# profile needs; a longer run keeps its last events (and every allocation still alive)
DEFAULT_MAX_ENTRIES = 1_000_000
MIN_SECONDS, MAX_SECONDS = 0.001, 1e9  # --seconds: a timer's resolution; 30 years
MAX_CARDS = 64  # --cards: more GPUs than any one machine has, each a process of its own

if TYPE_CHECKING:
    from memprof.collect.launch.script import Target
    from memprof.collect.recording import Recording
    from memprof.collect.virtual.need import NeedCheck
    from memprof.report.background_plot import BackgroundPlot


def run(
    ctx: typer.Context,
    module: Annotated[str | None, typer.Option(
        "-m", metavar="MODULE", help="Run a library module as a script, as `python -m` does.",
        show_default=False)] = None,
    command: Annotated[str | None, typer.Option(
        "-c", metavar="CODE", help="Run this code as `python -c` does (sys.argv[0] is '-c').",
        show_default=False)] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="The run folder (default: reports/SCRIPT-YYYYmmdd-HHMMSS).",
        show_default=False)] = None,
    force: Annotated[bool, flag("--force", "-f", help="Overwrite files already in"
                                        " the run folder.")] = False,
    device: Annotated[str, typer.Option(
        "--device", help="auto: the GPU's own allocator history when CUDA is available, else"
        " the virtual GPU (--virtual-gpu); cpu: memprof's CPU recorder (the script's host"
        " tensors, laid out as CUDA's allocator would); cuda: the GPU, or an error.")] = "auto",
    alloc_conf: Annotated[str | None, typer.Option(
        "--alloc-conf", metavar="CONF", help="Allocator settings for the CPU prediction"
        " (default: $PYTORCH_CUDA_ALLOC_CONF), e.g. 'expandable_segments:True'.",
        show_default=False)] = None,
    max_entries: Annotated[int, typer.Option(
        "--max-entries", min=1000, help="Trace events kept (a ring buffer; allocations still"
        " alive are always kept).")] = DEFAULT_MAX_ENTRIES,
    virtual_gpu: Annotated[str | None, typer.Option(
        "--virtual-gpu", metavar="SPEC", help="Run on a virtual GPU: a card (H100, 'A100 40GB',"
        " 'RTX 4090', V100, T4, ...) or a size such as 24GiB. CUDA tensors get real shapes but"
        " no storage or compute; memory is predicted for the card. Default without a GPU:"
        " H100 80GB.", show_default=False)] = None,
    light: Annotated[bool, flag(
        "--light", help="With --device cpu: record the CPU allocator's own events, labelled"
        " by role hooks, instead of the exact recorder's dispatch mode: the script runs"
        " nearer its own speed (no operator goes through Python; loops of many small modules"
        " still pay for the hooks) and torch.compile compiles. Categories and modules as"
        " usual; no Python stack per allocation (sites are unknown), and CPU kernels' own"
        " scratch counts.")] = False,
    top: Annotated[int, typer.Option("--top", min=1, help="Allocation sites to list.")] = 10,
    profile: Annotated[bool, flag(
        "--profile", help="Also run torch.profiler over optimizer steps 2-3 and write its"
        " Chrome trace (open in chrome://tracing or Perfetto) to the run folder.")] = False,
    steps: Annotated[int | None, typer.Option(
        "--steps", min=1, help="Stop the script cleanly after this many optimizer steps and"
        " write the report (exit 0).", show_default=False)] = None,
    seconds: Annotated[float | None, typer.Option(
        "--seconds", help="Stop the script cleanly after this many seconds and"
        " write the report (exit 0).", show_default=False)] = None,
    timeline: Annotated[bool, flag(
        "--timeline/--no-timeline", help="Draw timeline.png, or skip it and matplotlib's"
        " second of CPU (e.g. in CI).", show_default=False)] = True,
    max_peak: Annotated[str | None, typer.Option(
        "--max-peak", metavar="SIZE", help="Fail the run (exit 1) when its peak reserved"
        " memory exceeds SIZE (e.g. 20GiB): a memory gate for CI.", show_default=False)] = None,
    need: Annotated[bool, flag(
        "--need/--no-need", help="When a run on the virtual GPU runs out of memory, run it"
        " again on the same card with its memory raised and report what it needs (its peak"
        " is a lower bound).", show_default=False)] = True,
    virtual_gpu_memory: Annotated[str | None, typer.Option(
        "--virtual-gpu-memory", metavar="SIZE", hidden=True, help="The virtual card's memory"
        " changed to SIZE (what the --need re-run uses).", show_default=False)] = None,
    child: Annotated[bool, flag(
        "--child", hidden=True, help="A child process the run follows (memprof's own"
        " command line for it): silent, with a report only where it made CUDA tensors.")
        ] = False,
    nproc_per_node: Annotated[int | None, typer.Option(
        "--nproc-per-node", min=1, metavar="N", help="Run the script as `torchrun"
        " --nproc-per-node N` would: N ranks, each a process of its own on a card of its own"
        " (cuda:LOCAL_RANK; without a GPU, a virtual card of --virtual-gpu's kind); a report"
        " per rank in one run folder, and the worst rank first.", show_default=False)] = None,
    nnodes: Annotated[int, typer.Option(
        "--nnodes", min=1, metavar="M", help="With --nproc-per-node: M nodes of N ranks, all"
        " run on this machine.")] = 1,
    ranks: Annotated[str | None, typer.Option(
        "--ranks", metavar="LIST", help="With --nproc-per-node on virtual cards: run only"
        " these ranks of the world (0,63 or 0-3,63), a process each. A collective moves no"
        " data between virtual cards, so a rank's memory needs no other rank: run the ones"
        " that differ (the first and the last shard, a pipeline stage, rank 0's extra"
        " work); what an object collective would get from a rank not run is this rank's"
        " own. Default: every rank, but a world over 16 on virtual cards runs its"
        " representatives (0, 1, the second node's first, the middle, the last two); all:"
        " every rank.", show_default=False)] = None,
    cards: Annotated[int, typer.Option(
        "--cards", min=1, max=MAX_CARDS, metavar="N", help="The virtual GPUs the script's"
        " machine has (torch.cuda.device_count() = N), for a script that starts a process per GPU"
        " itself (torch.multiprocessing.spawn): each process it spawns is followed, on the"
        " card it picks with torch.cuda.set_device. A torchrun-style script takes"
        " --nproc-per-node instead.")] = 1,
    cluster_rank: Annotated[bool, flag(
        "--cluster-rank", hidden=True, help="A rank --nproc-per-node started: silent (the"
        " launcher prints the summary).")] = False,
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
    `memprof run --nproc-per-node 2 train_ddp.py` or `torchrun --nproc-per-node 2 -m memprof
    run train_ddp.py` (one report per rank).
    """
    args = list(script or [])
    if module is None and command is None and not args:
        raise MemprofError("nothing to run: give a script (memprof run train.py), -m MODULE"
                           " or -c CODE")
    if module is not None and command is not None:
        raise MemprofError("-m and -c both given: run one module or one command")
    from memprof.collect.launch.script import Target  # here: other commands need none of it

    if module is not None:
        target = Target(module, tuple(args), module=True)
    elif command is not None:
        target = Target(command, tuple(args), code=True)
    else:
        target = Target(args[0], tuple(args[1:]))
    target.check()  # before the slow imports: a typo gets its answer at once
    limit = max_peak_bytes(max_peak)
    if seconds is not None and not MIN_SECONDS <= seconds <= MAX_SECONDS:  # NaN too
        raise MemprofError(f"--seconds {seconds}: expected a number of seconds from"
                           f" {MIN_SECONDS:g} to {MAX_SECONDS:g}")

    from memprof.analysis.settings import parse_alloc_conf, unmodelled
    from memprof.collect.cuda.history import available as cuda_available
    from memprof.collect.launch.children import made_cuda
    from memprof.collect.launch.endings import child_signals, finishing
    from memprof.collect.launch.script import torchrun_rank
    from memprof.collect.recording import RunOptions
    from memprof.collect.session import recorder
    from memprof.collect.virtual.need import NeedCheck
    from memprof.heap import frozen
    from memprof.report.background_plot import BackgroundPlot
    from memprof.report.run_folder import (
        FILE_NAMES,
        claim,
        forget_spawned,
        rank_folder,
        run_folder,
    )

    if device not in ("auto", "cpu", "cuda"):
        raise MemprofError(f"--device {device!r}: expected auto, cpu or cuda")
    use_cuda = device == "cuda" or (device == "auto" and cuda_available())
    if device == "cuda" and not cuda_available():
        raise MemprofError("--device cuda: no CUDA device is available here")
    if light and (device != "cpu" or virtual_gpu or profile):
        raise MemprofError("--light records host tensors: use it with --device cpu, without"
                           " --virtual-gpu or --profile (the GPU path is light already)")
    card = virtual_card(virtual_gpu, device == "auto" and not use_cuda, virtual_gpu_memory)
    if card is not None:
        use_cuda = False
    conf = alloc_conf if alloc_conf is not None else os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    try:
        settings = parse_alloc_conf(conf)
    except ValueError as exc:
        raise MemprofError(f"allocator settings {describe(conf, 100)}: {exc}") from None
    problems = unmodelled(settings, capped=card is not None)
    if problems and not use_cuda:
        raise MemprofError(f"allocator settings {describe(conf, 100)} for the prediction:"
                           f" {'; '.join(problems)}")
    if cards > 1 and (card is None or nproc_per_node is not None or "LOCAL_RANK" in os.environ):
        raise MemprofError(f"--cards {cards}: the cards of a virtual GPU's machine, for a"
                           " script that starts its own processes; " + (
                               "with --nproc-per-node or torchrun, each rank sees its node's"
                               " cards already" if card is not None else
                               "on a GPU or with --device cpu the machine has its own"))
    if nproc_per_node is not None:  # every rank, each a `memprof run` of its own
        from memprof.cli.run_cluster import cluster_ranks, rank_options, run_cluster

        layout = cluster_ranks(nnodes, nproc_per_node, ranks, card)
        options = rank_options(card, device, settings.conf, max_entries, top, steps, seconds,
                               timeline, max_peak)
        raise typer.Exit(run_cluster(run_command(target)[2:], target.stem, layout, output,
                                     force, options, card,
                                     (settings.conf, steps) if need else None))
    if ranks is not None or nnodes > 1:
        what = "--ranks chooses among" if ranks is not None else "--nnodes counts nodes of"
        raise MemprofError(f"{what} the ranks of --nproc-per-node; give --nproc-per-node N"
                           " too")
    rank, world = torchrun_rank()
    # the script may chdir; each rank of a distributed run writes a run folder of its own
    folder = rank_folder(run_folder(target.stem, output, world).absolute(), rank, world)
    names = FILE_NAMES
    if child:  # its folder is claimed once it has something to write
        child_signals()
    else:
        claim(folder, names, force)
        if force:
            forget_spawned(folder)

    # when and where it started (the script may chdir): suggest --verify re-runs it there
    launched: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                "cwd": os.getcwd(), **({"cards": cards} if cards > 1 else {})}
    profile_path = folder / names["profile"] if profile else None
    parent = os.getpid()
    ended = False
    with BackgroundPlot() as plot, ExitStack() as after_script:
        def script_ended() -> None:
            nonlocal ended
            ended = True
            # a Ctrl-C or SIGTERM from now on only says so, a second abandons the report
            if not child:  # (a child ignores them: child_signals)
                after_script.enter_context(finishing())
            if timeline:
                plot.start()  # matplotlib loads while the trace is analysed

        try:
            announce = None if virtual_gpu or card is None else (
                f"memprof: no GPU here: CUDA runs on a virtual {card.name} (--virtual-gpu"
                " SPEC for another card, --device cpu to record host tensors instead)")
            record = recorder(use_cuda, light, card, announce)
            recording = record(target, RunOptions(settings, max_entries, steps, seconds,
                                                  profile_path, script_ended, folder, cards))
            if os.getpid() != parent or (child and not made_cuda(recording.snapshot)):
                raise typer.Exit(recording.outcome.exit_code)  # a fork's copy; an idle child
            if child:
                claim(folder, names, True)
            usable_streams()
            stopped = recording.outcome.stopped_by
            if stopped in ("steps", "seconds") and rank == 0:  # why the script's output ends
                sys.stdout.flush()
                what = f"{steps} steps" if stopped == "steps" else f"{seconds:g} s"
                print(f"memprof: stopped after {what} as asked", file=sys.stderr)
            with frozen():  # the script has ended: its objects wait for the exit
                try:
                    quiet = child or cluster_rank
                    needed = None if card is None or not need or quiet else NeedCheck(
                        target, card, settings.conf, steps, folder)
                    code = _finish(recording, target, folder, names, settings.conf, launched,
                                   top, limit, plot if timeline else None, quiet, needed)
                except (MemprofError, OSError) as exc:  # the run folder, not the script
                    code = _unwritten(exc, folder, recording.outcome.exit_code)
        except KeyboardInterrupt:
            what = (f"while writing the report: {folder} holds only whole files" if ended else
                    "before the script started")
            raise MemprofError(f"interrupted {what}; run again for a full report",
                               exit_code=130) from None
        except OSError as exc:
            raise MemprofError(f"{folder}: cannot write the report ({exc.strerror or exc});"
                               " free some space or pass -o with another folder",
                               exit_code=1) from None
    sys.stdout.flush()
    raise typer.Exit(code)


def _finish(recording: Recording, target: Target, folder: Path, names: dict[str, str],
            conf: str, launched: dict[str, Any], top: int, limit: int | None,
            plot: BackgroundPlot | None, quiet: bool = False,
            need: NeedCheck | None = None) -> int:
    """Analyse a recording, write the run folder's files (the timeline by ``plot``; none
    without one) and print the summary (not when ``quiet``); with ``need``, a run that ran
    out of memory is run again to tell what it needs. Return the exit code (the script's,
    or 1 when its peak broke ``--max-peak``)."""
    from memprof.analysis.explain import explain
    from memprof.collect.launch.children import child_reports
    from memprof.collect.launch.script import torchrun_rank
    from memprof.forked import Forked
    from memprof.heap import trim
    from memprof.report.cluster import rank_reports
    from memprof.report.html import write_report_page
    from memprof.report.json import report_dict, write_json
    from memprof.report.plot import timeline_panels, timeline_title
    from memprof.report.run_folder import write_snapshot
    from memprof.report.run_summary import render_run
    from memprof.report.text import plain
    from memprof.trace.normalize import normalize

    rank, world = torchrun_rank()
    speaks = rank == 0 and not quiet
    notes = Console(stderr=True, soft_wrap=True)
    meta = recording.snapshot["memprof"]
    files = [(recording.snapshot, folder / names["snapshot"])]
    if recording.oom_snapshot is not None:
        files.append((recording.oom_snapshot, folder / names["oom-snapshot"]))
    # a forked copy of memprof writes the snapshots while this process analyses them
    with Forked(lambda: [write_snapshot(*file) for file in files]) as writing:
        snapshot = normalize(recording.snapshot)
        files.clear()
        recording.snapshot, recording.oom_snapshot = {}, None  # the copy's now: freed here
        trim()
        findings = explain(snapshot, str(folder / names["snapshot"]), top=top,
                           placed={0: recording.tally} if recording.tally else None)
        del snapshot
        trim()  # and the analysis's scratch memory
        if plot is not None and findings.devices:  # drawn by the plot's child meanwhile
            plot.send(timeline_panels(findings),
                      timeline_title(findings, shlex.join(run_command(target)[2:])),
                      folder / names["timeline"])
        ooms = [o for d in findings.devices for o in d.ooms]
        needed = need(bool(ooms), len(meta["steps"]), recording.seconds,
                      ooms[0].limit_bytes if ooms else None) if need is not None else None
        facts = run_facts(recording, meta, target, launched, conf, needed)
        report = report_dict(findings, "run", facts)
        write_json(report, folder / names["report"])
        write_report_page(findings, report, shlex.join(run_command(target)[2:]),
                          folder / names["page"])
        children = child_reports(recording.children)  # those that made CUDA tensors
        if findings.devices:
            if speaks:
                for d in findings.devices:
                    render_run(d, facts, notes)
            if plot is not None:
                plot.wait()
        # a library of CUDA kernels the script died in, or the launcher it expected, named
        failed_in = launcher_hint(recording.outcome.error) or placeholder_hint(
            recording.outcome.error, bool(meta.get("placeholders_read")))
        if recording.virtual_gpu and failed_in is None:
            from memprof.collect.virtual.extensions import extension_failure
            failed_in = extension_failure(recording.outcome)
        if speaks and failed_in:
            notes.print(plain(failed_in))
        elif speaks and recording.virtual_gpu and not children and not findings.devices \
                and not (recording.outcome.error or "").startswith("VirtualGpuUnsupported"):
            notes.print(plain(f"memprof: the script made no CUDA tensor, so the virtual"
                              f" {recording.virtual_gpu['spec']} held nothing; --device cpu"
                              " profiles its host tensors instead"))
        if speaks and children and recording.virtual_gpu:
            _spawned(children, folder, recording.virtual_gpu["spec"], bool(findings.devices),
                     notes, recording.children_exits)
        writing.result()
    if speaks:
        run = folder.parent if world > 1 else folder  # the ranks' folders are inside
        written = ", ".join(sorted(p.name for p in run.iterdir() if p.name[0] != "."))
        notes.print()
        notes.print(plain(f"Run folder: {run}/ ({written})"))
        shown = run if world > 1 else folder / names["snapshot"]
        if children and not findings.devices:  # the children's memory, not the parent's
            shown = folder if rank_reports(folder) else children[0] / names["snapshot"]
        notes.print(plain(f"Next: memprof explain {shown}"))
    return gate(findings, limit, recording.outcome.exit_code, notes)


def _spawned(children: list[Path], folder: Path, card: str, itself: bool,
             notes: Console, exits: dict[Path, int]) -> None:
    """Say where the reports of the processes the script spawned are; where they were the
    ranks of one world (``mp.spawn``'s), lead with the cluster's answer and write
    ``cluster.json`` as ``--nproc-per-node`` does."""
    from memprof.cli.run_cluster import CLUSTER_FILE
    from memprof.collect.launch.children import reports_note
    from memprof.report.cluster import (
        Cluster,
        cluster_summary,
        rank_reports,
        read_cluster,
        render_cluster,
    )
    from memprof.report.json import write_json
    from memprof.report.text import plain

    notes.print(plain(reports_note(children, card, itself)))
    if not rank_reports(folder):
        return
    cluster = read_cluster(folder)
    world = max(r.world for r in cluster.written)
    # a process that ended without its report (os._exit, a kill), else the other nodes'
    lost = sorted({f"exit code {code}" if code > 0 else f"signal {-code}"
                   for f, code in exits.items() if code and f not in children})
    if len(cluster.ranks) < world:
        cluster = Cluster(cluster.ranks, cluster.card, world, f"a spawned process ended with"
                          f" {', '.join(lost)} before writing its report" if lost
                          else "spawned on the other nodes")
    write_json(cluster_summary(cluster, 1, world), folder / CLUSTER_FILE, overwrite=True)
    notes.print()
    render_cluster(cluster, notes)


def _unwritten(exc: MemprofError | OSError, folder: Path, script_code: int) -> int:
    """Say in one line what could not be written and what was; the exit code: the script's,
    or 1 where it succeeded (its report is incomplete)."""
    from memprof.report.text import visible

    why = exc.message if isinstance(exc, MemprofError) else \
        f"{folder}: cannot write the report ({exc.strerror or exc})"
    try:
        written = ", ".join(sorted(p.name for p in folder.iterdir() if p.name[0] != "."))
    except OSError:
        written = ""
    print(f"memprof: error: {visible(why)}; the run folder holds {written or 'nothing'}"
          " (free some space or pass -o with another folder)", file=sys.stderr)
    return script_code or 1


def usable_streams() -> None:
    """Give memprof somewhere to speak when the script closed stdout or stderr (or set them
    to None), as Python's exit does not mind: the report is still written, its summary
    goes nowhere."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            usable = stream is not None and not stream.closed and os.fstat(stream.fileno())
        except (AttributeError, OSError, ValueError):
            usable = False
        if not usable:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 - until the exit
