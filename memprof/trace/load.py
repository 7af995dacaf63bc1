"""Open a snapshot file without ever executing code from it, within bounded stack and memory."""

from __future__ import annotations

import errno
import os
import pickle
import stat
from pathlib import Path

from memprof.errors import MemprofError
from memprof.trace.model import Snapshot
from memprof.trace.normalize import NotASnapshot, normalize
from memprof.trace.unpickle import Refused, gc_paused, nesting_bound, unpickle, with_stack_for

__all__ = ["gc_paused", "load_raw", "load_snapshot"]

_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def load_raw(path: str | Path) -> object:
    """Unpickle ``path`` with every class reference refused; raise :class:`MemprofError`."""
    return _load(Path(path), lambda raw, size: raw)


def load_snapshot(path: str | Path) -> Snapshot:
    """Load and normalise a PyTorch memory snapshot (any format since PyTorch 2.0)."""
    return _load(Path(path), lambda raw, size: normalize(raw, max_items=size))


def _load(path: Path, then):
    """Open ``path`` (a regular file only: a FIFO would hang), unpickle it and apply ``then``
    on a thread with stack enough for the deepest nesting the file could hold."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise MemprofError(_open_error(path, exc)) from None
    try:
        info = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise MemprofError(f"{path}: cannot read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):  # checked before a file object is made of it
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else \
            next((k for test, k in _KINDS if test(info.st_mode)), "not a regular file")
        raise MemprofError(f"{path}: is {kind}, not a snapshot file")
    with os.fdopen(fd, "rb", buffering=0) as f:
        try:
            _check_ends(f, info.st_size)
            levels = nesting_bound(f)
        except OSError as exc:
            raise MemprofError(f"{path}: cannot read ({exc.strerror})") from None
        except Refused as exc:
            raise MemprofError(f"{path}: {_load_error(exc)}") from None

        def work():
            with gc_paused():  # one pause: a collection between the two would visit it all
                return then(unpickle(f, info.st_size), info.st_size)

        try:
            return with_stack_for(levels, work)
        except NotASnapshot as exc:
            raise MemprofError(f"{path}: not a PyTorch memory snapshot ({exc})") from None
        except Exception as exc:
            raise MemprofError(f"{path}: {_load_error(exc)}") from None


def _check_ends(f, size: int) -> None:
    """Refuse, before reading the whole file, what cannot be a pickle: one starts with the
    PROTO opcode of protocol 2 to 5 (PyTorch writes 2 or 4) and ends with STOP."""
    head = f.read(2)
    f.seek(max(size - 1, 0))
    tail = f.read(1)
    f.seek(0)
    if len(head) < 2 or head[0] != 0x80 or not 2 <= head[1] <= 5 or tail != b".":
        raise Refused("it does not begin and end as a pickle of protocol 2 to 5 does, as"
                      " torch.cuda.memory._dump_snapshot() writes")


def _open_error(path: Path, exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        return f"{path}: no such file"
    if exc.errno == errno.EISDIR:
        return f"{path}: is a directory; pass a snapshot file (.pickle)"
    return f"{path}: cannot open ({exc.strerror})"


def _load_error(exc: Exception) -> str:
    """What went wrong while unpickling, in words."""
    if isinstance(exc, pickle.UnpicklingError) and str(exc).startswith("refusing to load "):
        ref = str(exc).removeprefix("refusing to load ")
        return (f"the pickle references code ({ref}), which a memory snapshot never does;"
                " refusing to load it")
    if isinstance(exc, EOFError):
        return "the pickle is truncated (unexpected end of file)"
    if isinstance(exc, MemoryError):
        return ("unpickling it needs more memory than a snapshot of its size could: a pickle"
                " bomb, or too little memory here")
    if isinstance(exc, RecursionError):
        return "it nests containers too deeply for a snapshot"
    if isinstance(exc, Refused):
        return f"refusing to load it: {exc}"
    if isinstance(exc, OSError):
        return f"cannot read ({exc.strerror})"
    if isinstance(exc, pickle.UnpicklingError):
        return f"not a pickle file ({exc})"
    return f"not a readable pickle ({type(exc).__name__}: {exc})"
