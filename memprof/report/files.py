"""Writing output files: atomically, and never over an existing file unless asked."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from memprof.errors import MemprofError


def check_writable(path: Path, force: bool) -> None:
    """Refuse to overwrite ``path`` without ``force``; create its folder."""
    if path.exists() and not force:
        raise MemprofError(f"{path}: already exists; pass --force to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write`` on a temporary file beside ``path``, then move it into place.

    A failure leaves nothing behind: never a partial file at ``path``.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        write(Path(tmp))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 is for the temporary file only
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
