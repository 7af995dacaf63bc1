"""``memprof explain``: explain a PyTorch memory snapshot."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from memprof.cli.options import flag
from memprof.errors import MemprofError
from memprof.sizes import parse_size
from memprof.trace.fields import describe

if TYPE_CHECKING:
    from memprof.trace.model import AllocatorSettings


def explain(
    ctx: typer.Context,
    snapshot: Annotated[Path, typer.Argument(
        help="A snapshot from torch.cuda.memory._dump_snapshot() (any format since PyTorch 2.0),"
        " or a memprof run folder (every rank of a distributed run, and their imbalance).",
        show_default=False)],
    json: Annotated[bool, flag(
        "--json", help="Also write the report as JSON (schema memprof.report/1) to"
        " OUT_DIR/NAME.json.")] = False,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Where --json writes; '-' prints the JSON on stdout instead of"
        " the report.")] = None,
    plot: Annotated[bool, flag(
        "--plot", help="Write a PNG of allocated and reserved memory over time to"
        " OUT_DIR/NAME-timeline.png.")] = False,
    html: Annotated[Path | None, typer.Option(
        "--html", metavar="FILE", help="Also write the report as one interactive page that"
        " opens offline (timeline, peak, modules, allocator) to FILE.", show_default=False)
                    ] = None,
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Folder for --json and --plot.")
                       ] = Path("reports"),
    top: Annotated[int, typer.Option("--top", min=1, help="How many allocation sites to list.")
                   ] = 10,
    device: Annotated[list[int] | None, typer.Option(
        "--device", "-d", help="Only this device (repeatable).")] = None,
    what_if: Annotated[list[str] | None, typer.Option(
        "--what-if", metavar="CONF", help="Also replay the trace under these allocator settings,"
        " e.g. 'expandable_segments:True' or 'max_split_size_mb:128' (repeatable).")] = None,
    device_memory: Annotated[str | None, typer.Option(
        "--device-memory", metavar="SIZE", help="Replay the trace (as recorded, and under each"
        " --what-if) on a device with this much memory for PyTorch, e.g. 24GB: does it fit, or"
        " where does it run out?", show_default=False)] = None,
    alloc_conf: Annotated[str | None, typer.Option(
        "--alloc-conf", metavar="CONF", help="The allocator settings the run used, where the"
        " snapshot does not record them (or records them wrongly).", show_default=False)] = None,
    force: Annotated[bool, flag("--force", "-f", help="Overwrite existing output files.")
                     ] = False,
) -> None:
    """Explain a memory snapshot: the peak, what was live and from which lines, the allocator's
    cache and fragmentation, and any out-of-memory event.

    Snapshots are read without executing any code from them. Byte counts are the caching
    allocator's: **allocated** is what `torch.cuda.max_memory_allocated()` reports,
    **reserved** what `torch.cuda.max_memory_reserved()` reports.
    """
    # here, not at the top: `memprof run` imports this module before the script starts
    from memprof.analysis.explain import explain as analyse
    from memprof.analysis.explain import merge_ranks
    from memprof.report.files import check_writable
    from memprof.report.json import report_dict, write_json
    from memprof.report.text import plain, visible
    from memprof.supervised import supervise, time_limit
    from memprof.trace import load_snapshot
    from memprof.trace.load import gc_paused

    is_dir = _is_dir(snapshot)
    stem = snapshot.resolve().name if is_dir else snapshot.stem
    json_path = output if output is not None else out_dir / f"{stem}.json"
    to_stdout = str(json_path) == "-"
    plot_path = out_dir / f"{stem}-timeline.png"
    if output is not None and not json:
        raise MemprofError("--output names where --json writes; add --json")
    try:
        limit = parse_size(device_memory) if device_memory is not None else None
    except ValueError as exc:
        raise MemprofError(f"--device-memory: {exc}") from None
    settings = [_settings(c, "--what-if", limit is not None) for c in what_if or []]
    recorded = _settings(alloc_conf, "--alloc-conf", True) if alloc_conf is not None else None
    for path, wanted in ((json_path, json and not to_stdout), (plot_path, plot),
                         (html, html is not None)):
        if wanted:
            check_writable(path, force)

    snapshots = _snapshots(snapshot, is_dir)
    if ctx.obj and ctx.obj.get("own_process"):
        supervise(time_limit(sum(_size(path) for _, path in snapshots)),
                  f"{snapshot}: explaining it takes far longer than any snapshot of its size"
                  " needs: a pathological file (a pickle bomb?), refused")
    per_rank = []
    # Loading and analysing make millions of objects and no cycles. One pause over both, and
    # the snapshot dropped inside it: resumed any earlier, the collector would traverse all
    # of them, twice as they age (about 0.3 s CPU for a million events).
    with gc_paused():
        for rank, path in snapshots:
            snap = load_snapshot(path)
            if recorded is not None:
                snap.settings = recorded
            if device and not set(device) & set(snap.devices):
                if len(snapshots) > 1:  # a rank on another card of the node
                    continue
                raise MemprofError(f"{path}: no device {device} in this snapshot"
                                   f" (it has {snap.devices or 'none'})")
            per_rank.append(analyse(snap, str(path), devices=device or None, top=top,
                                    what_ifs=settings, rank=rank, device_memory=limit))
            del snap
    if not per_rank:
        raise MemprofError(f"{snapshot}: no rank ran on device {device}")
    findings = merge_ranks(str(snapshot), per_rank) if is_dir else per_rank[0]
    out = Console()
    if json and to_stdout:
        import json as json_module

        print(json_module.dumps(report_dict(findings), indent=2))
    else:
        from memprof.report import console as console_report  # rich's tables: not for --json -o -

        console_report.render(findings, out)
        if not is_dir and any(d.ooms for d in findings.devices):
            _said_need(snapshot.parent, out)
    notes = Console(stderr=True, soft_wrap=True)
    if json and not to_stdout:
        write_json(report_dict(findings), json_path, force)
        notes.print(plain(f"JSON report: {json_path}"))
    if html is not None:
        from memprof.report.html import write_report_page

        write_report_page(findings, report_dict(findings), visible(snapshot.name), html, force)
        notes.print(plain(f"Interactive report: {html}"))
    if plot and findings.devices:
        from memprof.report.plot import plot_timeline  # matplotlib is slow to import

        plot_timeline(findings, plot_path, overwrite=force)
        notes.print(plain(f"Timeline plot: {plot_path}"))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # the load says what is wrong with it
        return 0


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # e.g. a name too long: loading it says so
        return False


def _snapshots(path: Path, is_dir: bool) -> list[tuple[int | None, Path]]:
    """The snapshot file, or the snapshots of a run folder with their ranks."""
    from memprof.report.cluster import rank_reports
    from memprof.report.run_folder import rank_of

    if not is_dir:
        return [(None, path)]
    try:  # a cluster's (rank-K/, or the ranks the script spawned): per rank
        ranks = sorted((rank, p) for p in path.glob("rank-*/snapshot.pickle")
                       if (rank := rank_of(p.parent)) is not None) or [
            (rank, snapshot) for rank, report in rank_reports(path).items()
            if (snapshot := report.parent / "snapshot.pickle").is_file()]
        found = ranks or [(rank_of(p.parent), p) for p in sorted(path.glob("snapshot*.pickle"))]
        children = sorted(path.glob("child-*/snapshot.pickle"))
    except OSError as exc:
        raise MemprofError(f"{path}: cannot list the folder ({exc.strerror})") from None
    if not ranks and children and _made_nothing(path):
        raise MemprofError(f"{path}: the script made no CUDA tensor itself; the processes it"
                           " spawned did: give one of their run folders, such as"
                           f" {children[0].parent}")
    if not found:
        raise MemprofError(f"{path}: a directory with no snapshot*.pickle; pass a snapshot file"
                           " or a memprof run folder")
    return found


def _made_nothing(folder: Path) -> bool:
    """Whether the run folder's report says its process made no CUDA tensor."""
    import json

    try:
        return json.loads((folder / "report.json").read_bytes()).get("devices") == []
    except (OSError, ValueError, AttributeError):
        return False


def _settings(conf: str, option: str, capped: bool) -> AllocatorSettings:
    from memprof.analysis.settings import parse_alloc_conf, unmodelled

    try:
        settings = parse_alloc_conf(conf)
    except ValueError as exc:
        raise MemprofError(f"{option} {describe(conf, 100)}: {exc}"
                           " (expected e.g. 'expandable_segments:True,max_split_size_mb:128')"
                           ) from None
    problems = unmodelled(settings, capped)
    if problems:
        raise MemprofError(f"{option} {describe(conf, 100)}: {'; '.join(problems)}")
    return settings


def _said_need(folder: Path, out: Console) -> None:
    """What the run folder's report says the out-of-memory run needs, if it says."""
    from memprof.gate.reports import REPORT_NAME, load_report
    from memprof.report.run_summary import need_line

    if not (folder / REPORT_NAME).is_file():
        return
    try:
        report = load_report(folder / REPORT_NAME, "the run's report")
    except MemprofError:
        return  # a report that is not one: the snapshot's explanation stands alone
    run = report.data.get("run")
    need = run.get("need") if isinstance(run, dict) else None
    if isinstance(need, dict):
        spec = (run.get("virtual_gpu") or {}).get("spec")
        out.print(need_line(need, spec if isinstance(spec, str) else None))
