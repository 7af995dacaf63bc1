"""Writing output files: atomically, never over an existing file unless asked, and one
line when it fails."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from memprof.errors import MemprofError


def check_writable(path: Path, force: bool) -> None:
    """Refuse early, creating nothing: ``path`` exists (without ``force``) or is a folder,
    or its folder's place is taken by a file."""
    try:
        if path.is_dir():
            raise MemprofError(f"{path}: is a folder; name a file to write")
        if path.exists() and not force:
            raise MemprofError(f"{path}: already exists; pass --force to overwrite it")
        parent = next((p for p in path.parents if p.exists()), None)
    except OSError as exc:
        raise MemprofError(f"{path}: cannot write there ({exc.strerror})") from None
    if parent is not None and not parent.is_dir():
        raise MemprofError(f"{path}: cannot write there ({parent} is a file, not a folder)")


def write_atomic(path: Path, write: Callable[[Path], None], overwrite: bool = False) -> None:
    """Call ``write`` on a temporary file beside ``path``, then move it into place.

    A failure leaves nothing behind: never a partial file at ``path``. Without
    ``overwrite`` the move fails if ``path`` exists, even if another process created it
    a moment ago (two runs writing one file: the second is refused, not the first lost).
    Errors (a read-only folder, a full disk, ...) become one :class:`MemprofError` line.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MemprofError(f"{path}: cannot write ({exc.strerror})") from None
    tmp = None
    try:
        # named inside the try: a Ctrl-C right after it is made still removes it
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
        os.close(fd)
        write(Path(tmp))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 is for the temporary file only
        if overwrite:
            os.replace(tmp, path)
        else:
            _move_exclusive(tmp, path)
    except OSError as exc:
        if exc.errno == errno.EEXIST:
            raise MemprofError(f"{path}: already exists; pass --force to overwrite it") from None
        raise MemprofError(f"{path}: cannot write ({exc.strerror})") from None
    finally:
        if tmp is not None:
            _remove(tmp)


def _remove(tmp: str) -> None:
    """Remove ``tmp``, even if a Ctrl-C (a second one) arrives while it is being removed."""
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    except KeyboardInterrupt:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _move_exclusive(tmp: str, path: Path) -> None:
    """Rename ``tmp`` to ``path`` unless ``path`` exists, atomically (a hard link)."""
    try:
        os.link(tmp, path)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        # no hard links here: claim the name exclusively, then move over the claim
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        os.replace(tmp, path)
