"""``memprof suggest``: the remedies that make a run fit a memory budget, ranked, planned."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from memprof.cli.options import flag
from memprof.errors import MemprofError

if TYPE_CHECKING:
    from memprof.advise.advice import Advice
    from memprof.advise.source import Run
    from memprof.advise.verify import Measured


def suggest(
    ctx: typer.Context,
    source: Annotated[Path | None, typer.Argument(
        help="A run folder, its report.json, or a PyTorch snapshot (default: the newest run"
        " folder under reports/).", show_default=False)] = None,
    budget: Annotated[str, typer.Option(
        "--budget", "-b", help="The memory to fit in: 24GB (decimal), 24GiB or 24G (binary),"
        " 24000MB, bytes, or a card (A10, 'A100 40GB': its memory less the CUDA context).",
        show_default=False)] = "",
    gpus: Annotated[int, typer.Option(
        "--gpus", min=1, help="GPUs the job may use. A single-GPU run: 2 or more adds ZeRO/FSDP"
        " by the ZeRO paper's formulas. A rank of a distributed run: more than its world"
        " re-runs the script over that many virtual GPUs and measures the worst rank.")] = 1,
    verify: Annotated[bool, flag(
        "--verify", help="Re-run the script (as its report recorded it, a few steps, on the"
        " same virtual GPU; only a report memprof run wrote here, else --rerun-command) with"
        " each remedy memprof can apply itself (autocast,"
        " checkpointing of the repeated blocks, allocator settings, micro-batches with"
        " --batch-arg) and show the measured peaks next to the estimates.")] = False,
    batch_arg: Annotated[str | None, typer.Option(
        "--batch-arg", metavar="NAME", help="The script's batch-size flag (e.g. batch for"
        " --batch 8): lets --verify measure micro-batches.", show_default=False)] = None,
    fit_batch: Annotated[str | None, typer.Option(
        "--fit-batch", metavar="NAME", help="Find the largest value of the script's --NAME"
        " whose peak fits the budget, by re-running it (doubling, then bisection).",
        show_default=False)] = None,
    predict: Annotated[bool, flag(
        "--predict", help="For a run that ran out of memory where memprof run could not tell"
        " what it needs (a real GPU, or --no-need): re-run its script on the virtual GPU as"
        " the same card with the memory raised, write run.need into its report, and advise"
        " from that re-run.")] = False,
    rerun_command: Annotated[str | None, typer.Option(
        "--rerun-command", metavar="'SCRIPT ARGS'", help="What --verify, --fit-batch and"
        " --predict re-run, from this folder: the script and its arguments as after `memprof"
        " run`."
        " Needed for a report that memprof run did not write here, for you (one handed"
        " over): its recorded command is never run unasked.", show_default=False)] = None,
    as_json: Annotated[bool, flag(
        "--json", help="Print the advice as JSON (the report schema) instead.")] = False,
    html: Annotated[Path | None, typer.Option(
        "--html", metavar="FILE", help="Also write the advice as one offline page (remedies,"
        " the plan as a waterfall, the run's timeline with the budget) to FILE.",
        show_default=False)] = None,
) -> None:
    """Rank the remedies for a run's peak memory by the bytes each saves in THIS run, and
    plan the cheapest combination that fits the budget, with the code change for each step.

    Savings come from the run's own breakdown (parameters, gradients, optimizer state,
    activations, temporaries, the allocator's cache) and its model facts (parameter counts,
    optimizer, repeated blocks); each model's assumptions are printed with the plan.
    Exit 0 when the plan fits (or the run already does), 1 when nothing fits or what the
    run needs is unknown (it ran out of memory and was not re-run: --predict), 2 on bad
    input.

    Examples: `memprof suggest --budget 24GB`, `memprof suggest reports/train-1/ --budget
    A10`, `memprof suggest snapshot.pickle --budget 40GiB --gpus 8 --json`.
    """
    from memprof.advise.advice import advise
    from memprof.advise.budget import parse_budget
    from memprof.advise.render import as_json as to_json
    from memprof.advise.render import render
    from memprof.advise.source import is_snapshot, load_run, newest_run

    if not budget:
        raise MemprofError("--budget is required: the memory to fit in, e.g. --budget 24GB"
                           " or --budget A10")
    try:
        chosen = parse_budget(budget)
    except ValueError as exc:
        raise MemprofError(str(exc)) from None
    if rerun_command is not None and not (verify or fit_batch or predict or gpus > 1):
        raise MemprofError("--rerun-command names what --verify, --fit-batch, --predict or"
                           " --gpus re-run: give one of them too")
    source = source if source is not None else newest_run(Path("reports"))
    if ctx.obj and ctx.obj.get("own_process") and is_snapshot(source):
        from memprof.supervised import supervise, time_limit

        supervise(time_limit(source.stat().st_size), f"{source}: reading it takes far longer"
                  " than any snapshot of its size needs: a pathological file, refused")
    if html is not None:
        from memprof.report.files import check_writable

        check_writable(html, True)  # before any re-run
    run = load_run(source)
    notes = Console(stderr=True, soft_wrap=True, highlight=False)
    if predict:
        run = _predicted(run, source, rerun_command, notes)
    advice = advise(run, chosen, gpus)
    measured, batch = None, None
    if verify or fit_batch:
        from memprof.advise.rerun import RERUN_STEPS, Rerun, given_command

        rerun = Rerun.of(run, None if rerun_command is None else given_command(rerun_command))
        if batch_arg is not None:
            rerun.value_of(batch_arg)  # a flag neither set nor defaulted: its one line first
        if rerun.steps is None:
            took, done = run.facts.get("duration_s"), run.facts.get("optimizer_steps") or 0
            why = ("the run recorded no optimizer step" if not done else
                   f"the run ended on its own after {done} optimizer steps" if
                   done <= RERUN_STEPS else "the run's peak came after its first steps")
            notes.print(f"memprof: {why}, so each re-run runs the whole script"
                        f"{f' ({took:.0f} s as recorded)' if took else ''}")
        if verify:
            from memprof.advise.verify import BASELINE, unreproduced
            from memprof.advise.verify import verify as measure

            advice, measured = measure(advice, rerun, batch_arg,
                                       lambda what: notes.print(f"memprof: measuring {what} ..."))
            why = unreproduced(advice.start.reserved, measured.get(BASELINE),
                               "as recorded")
            if why is not None:
                notes.print(f"memprof: {why}: the measured peaks may not be this run's")
        if fit_batch:
            batch = _fit(rerun, fit_batch, chosen.bytes, notes, advice.start.reserved)
    elif gpus > int(run.facts.get("world_size") or 1) > 1:
        measured = _other_world(advice, run, gpus, rerun_command, notes)
    if html is not None:
        from memprof.report.html.assemble import write_page
        from memprof.report.html.pages import suggest_page

        write_page(suggest_page(to_json(advice, measured, batch), run.path, run.report), html,
                   overwrite=True)
        notes.print(f"memprof: the advice as a page: {html}")
    if as_json:
        typer.echo(json.dumps(to_json(advice, measured, batch), indent=2))
    else:
        render(advice, Console(soft_wrap=True), measured, batch)
    from memprof.advise.render import plan_fits

    # a peak that is a lower bound (an out-of-memory run not re-run) never fits: unknown
    fits = advice.fits_now or (not advice.run.lower_bound and bool(advice.plan.steps)
                               and plan_fits(advice, measured or {}))
    raise typer.Exit(0 if fits else 1)


def _predicted(run: Run, source: Path, rerun_command: str | None, notes: Console) -> Run:
    """``--predict``: the run as advised from its re-run with the memory raised."""
    from memprof.advise.predict import predict
    from memprof.advise.rerun import Rerun, given_command
    from memprof.advise.source import load_run

    if run.snapshot == run.path:  # a plain snapshot: no command was recorded
        raise MemprofError(f"{run.path}: a snapshot records no command to re-run; give"
                           " --predict the run folder memprof run wrote")
    if run.failed:
        raise MemprofError(f"{run.path}: --predict tells what a run that ran out of memory"
                           " needs; this run raised another error: fix it and run it again")
    if not run.out_of_memory:
        raise MemprofError(f"{run.path}: --predict tells what a run that ran out of memory"
                           " needs; this run did not, so its peak is what it needs")
    if not run.lower_bound:
        notes.print("memprof: what the run needs is known already (its re-run with the memory"
                    " raised): nothing to predict")
        return run
    given = None if rerun_command is None else given_command(rerun_command)
    predict(run, Rerun.of(run, given))
    return load_run(source)


def _other_world(advice: Advice, run: Run, gpus: int, rerun_command: str | None,
                 notes: Console) -> Measured | None:
    """``--gpus N`` of a rank of a distributed run: the world of N re-run on virtual cards
    (None, with a note, where it shards nothing or the report's command may not be re-run
    unasked)."""
    from memprof.advise.remedies import catalogue
    from memprof.advise.rerun import Rerun, given_command
    from memprof.advise.verify import attempt, measure_remedies, unreproduced

    world = [r for r in catalogue(advice.start, advice.context) if r.key == f"world_{gpus}"]
    if not world:
        notes.print(f"memprof: --gpus {gpus}: the run shards none of its model state over its"
                    " GPUs (DDP replicates it), so more GPUs hold as much each; see the FSDP"
                    " remedies")
        return None
    try:
        rerun = Rerun.of(run, None if rerun_command is None else given_command(rerun_command))
    except MemprofError as exc:
        notes.print(f"memprof: --gpus {gpus} is estimated only: {exc.message}")
        return None
    notes.print("memprof: measuring the run as recorded ...")
    why = unreproduced(advice.start.reserved, attempt(rerun, [], None),
                       "as recorded")
    if why is not None:
        notes.print(f"memprof: --gpus {gpus} is estimated only: {why}")
        return None
    return measure_remedies(world, rerun,
                            lambda what: notes.print(f"memprof: measuring {what} ..."))


def _fit(rerun: object, name: str, budget: int, notes: Console, recorded: int
         ) -> dict[str, object]:
    """``--fit-batch``: the largest value that fits, unless the re-run at the recorded value
    does not reproduce the recorded peak (then no answer: the re-runs measure something
    else, a phase they do not reach, say)."""
    from memprof.advise.rerun import fit_batch
    from memprof.advise.verify import unreproduced
    from memprof.report.units import format_bytes

    first: list[object] = []

    def progress(value: int, peak: object) -> None:
        shown = "out of memory" if peak is None else f"{format_bytes(peak.reserved)} reserved"
        notes.print(f"memprof: --{name} {value}: {shown}")
        if not first:
            first.append(peak)

    value, runs = fit_batch(rerun, name, budget, progress)  # type: ignore[arg-type]
    why = unreproduced(recorded, first[0] if first else None,  # type: ignore[arg-type]
                       f"at the recorded --{name}")
    if why is not None:
        why += ", so their answer is not used"
        notes.print(f"memprof: {why}")
        return {"arg": name, "largest": None, "runs": runs, "not_reproduced": why}
    return {"arg": name, "largest": value, "runs": runs, "not_reproduced": None}
