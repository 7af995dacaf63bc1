"""The child process of `background_plot`: load matplotlib, then draw the job on stdin."""

from __future__ import annotations

import json
import os
import pickle
import sys

from memprof.errors import MemprofError
from memprof.report.background_plot import RESULT
from memprof.report.plot import draw_timeline, load_matplotlib


def main() -> None:
    """Draw the pickled ``(panels, title, path, overwrite)`` read from stdin; end stdout
    with the result (`background_plot`)."""
    load_matplotlib()  # while the parent still analyses the trace
    job = sys.stdin.buffer.read()
    if not job:
        return  # the parent had nothing to draw, or stopped
    panels, title, path, overwrite = pickle.loads(job)  # from memprof's own pipe, never a file
    try:
        draw_timeline(panels, title, path, overwrite)
    except MemprofError as exc:
        error: str | None = exc.message
    else:
        error = None
    sys.stdout.buffer.write(b"\n" + RESULT + json.dumps({"error": error}).encode() + b"\n")
    sys.stdout.flush()
    os._exit(0)  # the parent waits for the exit: skip the teardown of matplotlib's modules
