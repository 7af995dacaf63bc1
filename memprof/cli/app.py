"""The ``memprof`` command."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from memprof import __version__
from memprof.cli import check, explain, run, suggest
from memprof.cli.options import flag
from memprof.errors import MemprofError
from memprof.report.text import visible

app = typer.Typer(
    name="memprof",
    help="GPU memory profiler and out-of-memory diagnoser for PyTorch training.\n\n"
    "Start with `memprof explain snapshot.pickle` on any snapshot written by"
    " torch.cuda.memory._dump_snapshot().",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
app.command(name="run", no_args_is_help=True,
            context_settings={"allow_interspersed_args": False,
                              "ignore_unknown_options": True})(run.run)
app.command(name="explain", no_args_is_help=True)(explain.explain)
app.command(name="check", no_args_is_help=True)(check.check)
app.command(name="suggest")(suggest.suggest)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"memprof {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, flag("--version", callback=_version, is_eager=True,
                                         help="Show the version and exit.")] = False) -> None:
    """GPU memory profiler and out-of-memory diagnoser for PyTorch training."""


def main() -> None:
    """Entry point: run the app, turning :class:`MemprofError` into one line and an exit code."""
    try:
        app()
    except MemprofError as exc:
        print(f"memprof: error: {visible(exc.message)}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except SystemExit as exc:
        if sys.argv[1:2] == ["explain"] and (exc.code is None or isinstance(exc.code, int)):
            _exit_now(exc.code or 0)
        raise


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown, which frees every module's objects (about
    0.1 s, a tenth of loading a million-event snapshot). Only for ``explain``, which has
    nothing left to do but flush its output; never for ``run``, whose script's exit
    handlers must run."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe or stream: the usual exit reports it
        return
    os._exit(code)
