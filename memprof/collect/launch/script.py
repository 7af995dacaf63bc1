"""Run a user's script, module or command in this process, exactly as ``python`` would."""

from __future__ import annotations

import atexit
import builtins
import importlib.util
import io
import itertools
import os
import runpy
import sys
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import memprof
from memprof.collect.launch.endings import HANDLER_CODES, Stop
from memprof.errors import MemprofError, Refusal, Unsupported


@dataclass(frozen=True, slots=True)
class Target:
    """What to run: a script path, a module name (``-m``) or a command's code (``-c``),
    and its arguments."""

    name: str
    args: tuple[str, ...]
    module: bool = False
    code: bool = False

    @property
    def stem(self) -> str:
        """A short name for output files: the script's file name or the module's last part."""
        if self.code:
            return "command"
        return self.name.rsplit(".", 1)[-1] if self.module else Path(self.name).stem

    @property
    def option(self) -> list[str]:
        """``-m`` or ``-c`` before the name on a command line, as python takes them."""
        return ["-m"] if self.module else ["-c"] if self.code else []

    def check(self) -> None:
        """Fail early, in one line, if there is nothing to run."""
        if self.code:
            try:
                compile(self.name, "<string>", "exec")
            except SyntaxError as exc:
                raise MemprofError(f"-c: the code does not compile: {exc.msg} (line"
                                   f" {exc.lineno})") from None
        elif self.module:
            sys.path.insert(0, os.getcwd())  # where `python -m` looks first
            try:
                found = importlib.util.find_spec(self.name) is not None
            except (ImportError, ValueError):
                found = False
            finally:
                sys.path.remove(os.getcwd())
            if not found:
                raise MemprofError(f"no module named {self.name!r}")
        elif not Path(self.name).is_file():
            raise MemprofError(f"{self.name}: no such script")


@dataclass(frozen=True, slots=True)
class Outcome:
    """How the script ended and the exit code ``python`` would have given."""

    status: str  # "completed", "exited", "raised", "interrupted", "stopped"
    exit_code: int
    error: str | None = None
    stopped_by: str | None = None  # "steps", "seconds" or "SIGTERM" when memprof stopped it
    # where an exception came from: the modules of its traceback's frames, outermost first
    raised_in: tuple[str, ...] = ()


def run(target: Target) -> Outcome:
    """Run ``target`` with ``sys.argv``, ``sys.path[0]`` and ``__main__`` set as Python sets them.

    The script's exceptions are printed as Python prints them (without memprof's frames)
    and turned into exit codes: ``sys.exit(n)`` gives n, an exception 1, Ctrl-C 130.
    """
    saved_argv, saved_path, hook = sys.argv[:], sys.path[:], sys.excepthook
    Stop.last = None
    sys.argv = ["-c" if target.code else target.name, *target.args]
    sys.path[0] = (os.getcwd() if target.module else "" if target.code
                   else str(Path(target.name).resolve().parent))
    try:
        if target.code:
            _run_code(compile(target.name, "<string>", "exec"), None)
        elif target.module:
            _SCRIPT_GLOBALS.append(runpy.run_module(target.name, run_name="__main__",
                                                    alter_sys=True))
        else:
            _run_script(target.name)
    except Stop as stop:
        return Outcome("stopped", stop.exit_code, None, stop.reason)
    except SystemExit as exc:
        stop = Stop.last  # a spawned process ends with the code a Stop gave it
        if stop is not None and exc.code == stop[1]:
            return Outcome("stopped", stop[1], None, stop[0])
        return _exit_outcome(exc.code)
    except KeyboardInterrupt:
        _print_user_traceback(hook)
        return Outcome("interrupted", 130, "KeyboardInterrupt")
    except Refusal as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"memprof: error: {exc}", file=sys.stderr)
        return Outcome("raised", 1, _described(exc))
    except BaseException as exc:  # the script's own failure, reported as Python would
        raised_in = _modules(exc.__traceback__)
        _print_user_traceback(hook)
        return Outcome("raised", 1, _described(exc), raised_in=raised_in)
    finally:
        sys.argv = saved_argv
        if sys.path:  # memprof's own folders back, where the script removed them
            sys.path[0] = saved_path[0]
        sys.path.extend(p for p in saved_path if p not in sys.path)
        _loaders_as_at_exit()
    return Outcome("completed", 0)


def _loaders_as_at_exit() -> None:
    """Tell the script's DataLoaders what Python's exit would: an iterator that memprof drops
    later (persistent workers, a run stopped mid-epoch) leaves its worker processes to the
    end of the process, which terminates them, instead of waiting on each to stop."""
    utils = sys.modules.get("torch.utils.data._utils")
    if utils is not None and hasattr(utils, "_set_python_exit_flag"):
        utils._set_python_exit_flag()


def _run_script(path: str) -> None:
    """Execute a script in a fresh ``__main__``, as ``python path`` does.

    Not ``runpy.run_path``: it would set ``sys.argv[0]`` to whatever path it is given,
    while Python keeps ``argv[0]`` as typed and makes ``__file__`` absolute.
    """
    filename = os.path.join(os.getcwd(), path)
    with io.open_code(filename) as f:
        _run_code(compile(f.read(), filename, "exec"), filename)


def _run_code(code: types.CodeType, filename: str | None) -> None:
    """Execute ``code`` in a fresh ``__main__`` (with ``__file__`` unless it is ``-c``'s)."""
    main = types.ModuleType("__main__")
    if filename is not None:
        main.__file__ = filename
    main.__builtins__ = builtins
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    _SCRIPT_GLOBALS.append(main)
    try:
        exec(code, main.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


# what the script's __main__ held: alive until memprof exits, as until python's exit, so
# that a __del__ (one that calls os._exit, say) runs after the report, not before it
_SCRIPT_GLOBALS: list[Any] = []


def _release_script() -> None:
    """Make the script's module ``__main__`` again for Python's exit to finalise as it
    would have (after the atexit handlers the script registered: registered before them,
    this runs after them)."""
    for held in _SCRIPT_GLOBALS:
        if isinstance(held, dict):  # run_module's globals
            module = types.ModuleType("__main__")
            vars(module).update(held)
            held = module
        sys.modules["__main__"] = held
    _SCRIPT_GLOBALS.clear()


atexit.register(_release_script)


def _described(exc: BaseException) -> str:
    """``Type: message``, and the first exception of its chain where this one was raised
    while handling it (a library's teardown failing after the real error), as Python's
    traceback shows both."""
    text = f"{type(exc).__name__}: {_text_of(exc)}"
    first, seen = exc, {id(exc)}
    while first.__context__ is not None and not first.__suppress_context__ \
            and id(first.__context__) not in seen:
        first = first.__context__
        seen.add(id(first))
    if first is exc:
        return text
    return f"{text} (raised while handling {type(first).__name__}: {_text_of(first)})"


def _text_of(exc: BaseException) -> str:
    """``str(exc)``, or what Python's traceback shows when that fails."""
    try:
        return str(exc)
    except Exception:
        return "<exception str() failed>"


def _modules(tb: types.TracebackType | None) -> tuple[str, ...]:
    """The module of each frame of ``tb``, outermost first (names only: no frame is kept)."""
    names = []
    while tb is not None:
        names.append(str(tb.tb_frame.f_globals.get("__name__", "")))
        tb = tb.tb_next
    return tuple(names)


def _exit_outcome(code: object) -> Outcome:
    if code is None:
        return Outcome("exited", 0)
    if isinstance(code, int):
        return Outcome("exited", code & 0xFF)  # as the process's status: sys.exit(256) is 0
    print(_text_of(code), file=sys.stderr)  # sys.exit("message") prints it and exits 1
    return Outcome("exited", 1, _text_of(code))


def _print_user_traceback(hook_before: object) -> None:
    """Print the current exception without memprof's frames (``_user_frames``), with the
    script's own ``sys.excepthook`` when it set one (not the hook it found)."""
    exc_type, exc, tb = sys.exc_info()
    tb = _user_frames(tb, isinstance(exc, Unsupported))
    if sys.excepthook is not hook_before and exc_type is not None and exc is not None:
        kept = exc.__traceback__
        try:  # the hook may print the exception's own traceback (torch.distributed's does)
            sys.excepthook(exc_type, exc.with_traceback(tb), tb)
        except BaseException as broken:  # as Python reports a hook that fails
            print("Error in sys.excepthook:", file=sys.stderr)
            hook_tb = broken.__traceback__.tb_next if broken.__traceback__ else None
            traceback.print_exception(type(broken), broken, hook_tb, chain=False)
            print("\nOriginal exception was:", file=sys.stderr)
            traceback.print_exception(exc_type, exc, tb)
        finally:
            exc.__traceback__ = kept
    else:
        traceback.print_exception(exc_type, exc, tb)
    # as Python keeps an uncaught exception until its exit: the script's objects in the
    # failing frames (a model, an optimizer with half its state) live on, for the
    # recorders' last look at them and for the run's end state
    sys.last_type, sys.last_value = exc_type, exc
    sys.last_traceback = exc.__traceback__ if exc is not None else None
    if sys.version_info >= (3, 12):
        sys.last_exc = exc  # type: ignore[attr-defined]


def _user_frames(tb: types.TracebackType | None, deliberate: bool = False
                 ) -> types.TracebackType | None:
    """``tb`` as Python alone would have printed it: from the first frame outside memprof
    and runpy, and, past a frame of memprof's inside the script (its dispatch mode, or the
    virtual GPU's), without memprof's frames or torch's under them: the operator's Python
    implementation there (the mode's call, fake tensors' reference kernels) is C++ in a
    plain run, which shows no frame. All are kept when memprof's own code raised, but for
    ``deliberate``: what memprof cannot model (:class:`~memprof.errors.Unsupported`)."""
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    ours = _package_test(Path(memprof.__file__).resolve().parent)
    torch = sys.modules.get("torch")
    torchs = _package_test(Path(torch.__file__).parent) if torch is not None else ours

    def launcher(t: types.TracebackType) -> bool:
        name = t.tb_frame.f_code.co_filename
        return ours(name) or name == runpy.__file__ or "<frozen runpy>" in name

    while frames and launcher(frames[0]):
        frames.pop(0)
    if frames and frames[-1].tb_frame.f_code in HANDLER_CODES:  # raised by a signal handler
        frames.pop()
    if frames and (deliberate or not ours(frames[-1].tb_frame.f_code.co_filename)):
        kept, inside = [], False
        for t in frames:
            name = t.tb_frame.f_code.co_filename
            inside = inside or ours(name)
            if not (inside and (ours(name) or torchs(name))):
                kept.append(t)
        frames = kept
    for t, after in itertools.pairwise(frames):
        t.tb_next = after
    if frames:
        frames[-1].tb_next = None
    return frames[0] if frames else None


def _package_test(folder: Path) -> Callable[[str], bool]:
    """Whether a code object's file name is in ``folder``."""
    prefix = str(folder) + os.sep
    return lambda name: name.startswith(prefix)


def torchrun_local(cards: int = 1) -> tuple[int, int]:
    """This process's ``LOCAL_RANK`` and the node's GPU count (``LOCAL_WORLD_SIZE``, at
    least one more than the rank) as torchrun sets them, else (0, ``cards``)."""
    if "LOCAL_RANK" not in os.environ:
        return 0, cards
    local = int(os.environ["LOCAL_RANK"])
    return local, max(local + 1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


# what launchers tell the processes they start, beyond torchrun's variables: accelerate
# launch's configuration (its FSDP, DeepSpeed and mixed-precision settings)
LAUNCHER_PREFIXES = ("ACCELERATE_", "FSDP_")


def launcher_env() -> dict[str, str] | None:
    """The variables a launcher's configuration set for this process (``accelerate
    launch``'s), for a re-run to set them again; None where there are none."""
    found = {k: v for k, v in os.environ.items() if k.startswith(LAUNCHER_PREFIXES)}
    return dict(sorted(found.items())) or None


def torchrun_rank() -> tuple[int, int]:
    """This process's (rank, world size) under torchrun; (0, 1) otherwise."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
