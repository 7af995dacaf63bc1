"""``memprof check``: fail CI when a run uses more memory than its baseline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from memprof.cli.options import flag
from memprof.errors import MemprofError


def check(
    current: Annotated[Path, typer.Argument(
        help="The run to judge: a run folder or its report.json.", show_default=False)],
    baseline: Annotated[Path, typer.Option(
        "--baseline", "-b", help="The reference run: a run folder or a report.json (keep one"
        " in your repository).", show_default=False)],
    max_increase: Annotated[str, typer.Option(
        "--max-increase", help="Growth allowed over the baseline: a percentage (5%) or a size"
        " (200MiB).")] = "5%",
    metric: Annotated[str, typer.Option(
        "--metric", help="peak_allocated (what max_memory_allocated() reports), peak_reserved"
        " (what the card holds for PyTorch) or category:NAME (e.g. category:activations).")]
    = "peak_allocated",
    device: Annotated[int | None, typer.Option(
        "--device", help="Compare only this device index (default: every device).",
        show_default=False)] = None,
    allow_different: Annotated[bool, flag(
        "--allow-different", help="Compare even when the runs differ in device, virtual GPU,"
        " allocator settings or how they ended (otherwise exit 2).")] = False,
    update_baseline: Annotated[bool, flag(
        "--update-baseline", help="Write CURRENT's report as the new baseline (atomically)"
        " and exit 0.")] = False,
    fmt: Annotated[str, typer.Option(
        "--format", help="text, json, markdown (a pull-request comment), junit (XML for CI"
        " test reports) or html (one offline page: both runs side by side).")] = "text",
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write the verdict to this file instead of stdout.",
        show_default=False)] = None,
) -> None:
    """Compare a run's memory with a baseline run: exit 0 within the limit, 1 on a
    regression, 2 on bad input or reports that cannot be compared.

    It fails closed: a missing or unreadable baseline, or reports that measure different
    things (another device or virtual GPU, other allocator settings, a run that did not
    complete) give exit 2, never a pass. On a regression it says what grew: the category,
    the allocation sites and the modules that grew most.

    Examples: `memprof check reports/train-new --baseline ci/memory-baseline.json`,
    `memprof check new/ -b base/ --metric peak_reserved --max-increase 200MiB --format junit
    -o memprof.xml`.
    """
    from memprof.gate.compare import Incomparable, compare
    from memprof.gate.metrics import parse_limit, parse_metric
    from memprof.gate.render import FORMATS, render, text
    from memprof.gate.reports import load_ranks, report_path
    from memprof.report.files import write_atomic

    if fmt not in (*FORMATS, "html"):
        raise MemprofError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)} or html")
    try:
        chosen, limit = parse_metric(metric), parse_limit(max_increase)
    except ValueError as exc:
        raise MemprofError(str(exc)) from None
    mine = load_ranks(current, "current")
    if update_baseline:
        if mine.path.is_dir() and baseline.is_dir():
            raise MemprofError(f"--update-baseline {baseline}: every rank's report becomes one"
                               " baseline file; give --baseline a file (memory-baseline.json)")
        target = report_path(baseline)
        whole = json.dumps(mine.data, indent=2).encode() if mine.path.is_dir() \
            else mine.path.read_bytes()  # every rank's, as one report
        write_atomic(target, lambda tmp: tmp.write_bytes(whole), overwrite=True)
        typer.echo(f"Baseline updated: {target} now holds {mine.path}", err=True)
        return
    theirs = load_ranks(baseline, "baseline")
    try:
        verdict = compare(mine, theirs, chosen, limit, device, allow_different)
    except Incomparable as exc:
        raise MemprofError(f"cannot compare {mine.path} with baseline {theirs.path}: {exc};"
                           " pass --allow-different to compare anyway") from None
    if fmt == "html":
        from memprof.gate.page import check_html

        rendered = check_html(verdict, (mine.path, mine.data), (theirs.path, theirs.data))
    else:
        rendered = render(verdict, fmt)
    if output is None:
        typer.echo(rendered)
    else:
        write_atomic(output, lambda tmp: tmp.write_text(rendered + "\n"), overwrite=True)
        typer.echo(text(verdict))
    raise typer.Exit(1 if verdict.regressed else 0)
