"""The ``memprof`` command."""

from __future__ import annotations

import os
import sys
from typing import Annotated, NoReturn

import typer

try:  # typer from 0.2x vendors click; before, click's own
    from typer import TyperException as CommandLineError
except ImportError:  # pragma: no cover - older typer
    from click import ClickException as CommandLineError

from memprof import __version__
from memprof.cli import check, explain, run, suggest
from memprof.cli.options import flag
from memprof.errors import MemprofError
from memprof.report.text import visible

# ``ctx.obj`` of a command run by ``main``: the process is memprof's own, so a command may
# fork it to put a time limit on hostile input (``supervised.py``); not when it is called
# in-process, by a test's CliRunner or a user's code
OWN_PROCESS = {"own_process": True}

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
    """Entry point: run the app; a :class:`MemprofError` or a usage error (a bad option, a
    missing argument) becomes one line and an exit code."""
    try:
        code = app(standalone_mode=False, obj=OWN_PROCESS)
    except MemprofError as exc:
        _fail(exc.message, exc.exit_code)
    except CommandLineError as exc:  # a bad option or argument: click's usage error
        context = getattr(exc, "ctx", None)
        command = context.command_path if context is not None else "memprof"
        message = exc.format_message()
        if not message:  # no arguments at all: click has shown the help
            sys.exit(exc.exit_code)
        _fail(f"{message} (see {command} --help)", exc.exit_code)
    except typer.Abort:
        _fail("interrupted", 130)
    code = code if isinstance(code, int) else 0
    if sys.argv[1:2] == ["explain"]:
        _exit_now(code)
    sys.exit(code)


def _fail(message: str, code: int) -> NoReturn:
    print(f"memprof: error: {visible(message)}", file=sys.stderr)
    sys.exit(code)


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
