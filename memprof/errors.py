"""The one error type the command line turns into a one-line message and an exit code."""

from __future__ import annotations


class MemprofError(Exception):
    """A user-facing failure: printed as one line, the process exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
