"""The one error type the command line turns into a one-line message and an exit code."""

from __future__ import annotations


class MemprofError(Exception):
    """A user-facing failure: printed as one line, the process exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class Refusal(RuntimeError):
    """memprof refusing, inside the script's own call, to go on with a script as it was
    launched: the script ends there as if it raised, and the message is said in one line,
    without a traceback (by rank 0 alone)."""


class Unsupported(NotImplementedError):
    """What memprof cannot model, raised inside the script's call: the script ends there as
    if it raised, its traceback shown with the script's frames only."""
