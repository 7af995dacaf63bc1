"""The run's timeline PNG, drawn by a child python process.

Importing matplotlib costs about a third of a second, as much as analysing a short run's
trace. ``memprof run`` starts the child as soon as the script has ended: it loads
matplotlib while memprof analyses the trace, then draws what it is sent while memprof
writes the snapshot (``send``, then ``wait``). When the child cannot be started or dies,
the plot is drawn here instead.

Protocol: the child reads one pickled job from stdin, ``(panels, title, path, overwrite)``
(an empty stdin: nothing to draw), and ends its stdout with the line `RESULT` and a JSON
object: ``{"error": null}``, or the message of the `MemprofError` that writing the file
raised. (Whatever else lands on its stdout, a ``sitecustomize``'s output say, is ignored.)
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType

import memprof
from memprof.errors import MemprofError
from memprof.report.plot import Panel, draw_timeline

# sys.path[0] is memprof's own folder, not the current one (the user's: it may hold a
# module named like one matplotlib imports, or have been deleted by the script)
_ROOT = str(Path(memprof.__file__).resolve().parent.parent)
_CHILD = ("import sys; sys.path[0] = {root!r}; "
          "from memprof.report.plot_worker import main; main()")
RESULT = b"memprof-plot-result: "


class BackgroundPlot:
    """A child process that draws one timeline PNG; a context manager that stops it."""

    def __init__(self) -> None:
        self._owner = os.getpid()
        self._child: subprocess.Popen[bytes] | None = None
        self._job: tuple[list[Panel], str, Path, bool] | None = None  # sent, not yet drawn
        self._talk: threading.Thread | None = None  # feeds the job, reads the result
        self._out = b""  # the child's stdout

    def start(self) -> None:
        """Start the child (it loads matplotlib at once). Only in the process that made this
        object: a forked child of the script that returns into memprof draws nothing."""
        if self._child is not None or os.getpid() != self._owner or not sys.executable:
            return
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-c", _CHILD.format(root=_ROOT)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=os.path.abspath(os.sep),
                start_new_session=True)  # a Ctrl-C at the terminal is memprof's to handle
        except OSError:
            self._child = None

    def send(self, panels: list[Panel], title: str, path: Path, overwrite: bool = False
             ) -> None:
        """Hand the child ``panels`` to draw into ``path`` (`draw_timeline`) and return at
        once: it draws while memprof goes on; ``wait`` ends the drawing."""
        self._job = (panels, title, path, overwrite)
        if self._child is not None:
            payload = pickle.dumps(self._job)
            self._talk = threading.Thread(target=self._communicate,
                                          args=(self._child, payload), daemon=True)
            self._talk.start()

    def wait(self) -> None:
        """Wait for the drawing ``send`` asked for; drawn here if the child never started
        or died."""
        job, child, talk = self._job, self._child, self._talk
        self._job = self._child = self._talk = None
        if job is None:
            return
        if child is not None and talk is not None:
            try:
                talk.join()
            except BaseException:
                _stop(child)
                raise
            if child.returncode == 0 and (done := _result(self._out)) is not None:
                if done["error"] is not None:
                    raise MemprofError(done["error"])
                return
        draw_timeline(*job)  # no child, or it died

    def _communicate(self, child: subprocess.Popen[bytes], payload: bytes) -> None:
        try:
            self._out, _ = child.communicate(payload)
        except (OSError, ValueError):  # stopped meanwhile: the plot is drawn here
            self._out = b""

    def __enter__(self) -> BackgroundPlot:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        child, self._child = self._child, None
        if child is not None:
            _stop(child)


def _result(out: bytes) -> dict[str, str | None] | None:
    _, found, line = out.rpartition(RESULT)
    try:
        return json.loads(line) if found else None
    except ValueError:
        return None


def _stop(child: subprocess.Popen[bytes]) -> None:
    child.kill()
    child.wait()
