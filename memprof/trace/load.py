"""Open a snapshot file without ever executing code from it."""

from __future__ import annotations

import gc
import io
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from memprof.errors import MemprofError
from memprof.trace.model import Snapshot
from memprof.trace.normalize import NotASnapshot, normalize


class _NoClassesUnpickler(pickle.Unpickler):
    """The snapshot format holds only builtin containers and scalars: refuse every class."""

    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector.

    A snapshot unpickles into millions of dicts and lists, none in a cycle; without
    the pause the collector traverses them again and again as they are created, which
    triples the load time.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def load_raw(path: str | Path) -> object:
    """Unpickle ``path`` with every class reference refused; raise :class:`MemprofError`."""
    path = Path(path)
    if not path.exists():
        raise MemprofError(f"{path}: no such file")
    if path.is_dir():
        raise MemprofError(f"{path}: is a directory; pass a snapshot file (.pickle)")
    try:
        with path.open("rb") as f, gc_paused():
            return _NoClassesUnpickler(io.BufferedReader(f, 1 << 20)).load()
    except PermissionError as exc:
        raise MemprofError(f"{path}: cannot read ({exc.strerror})") from None
    except pickle.UnpicklingError as exc:
        if str(exc).startswith("refusing to load "):
            ref = str(exc).removeprefix("refusing to load ")
            raise MemprofError(
                f"{path}: the pickle references code ({ref}), which a memory snapshot never"
                " does; refusing to load it"
            ) from None
        raise MemprofError(f"{path}: not a pickle file ({exc})") from None
    except EOFError:
        raise MemprofError(f"{path}: the pickle is truncated (unexpected end of file)") from None
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, OverflowError) as exc:
        raise MemprofError(f"{path}: not a readable pickle ({exc})") from None
    except MemoryError:
        raise MemprofError(f"{path}: too large to load in the memory available") from None


def load_snapshot(path: str | Path) -> Snapshot:
    """Load and normalise a PyTorch memory snapshot (any format since PyTorch 2.0)."""
    raw = load_raw(path)
    try:
        with gc_paused():
            return normalize(raw)
    except NotASnapshot as exc:
        raise MemprofError(f"{path}: not a PyTorch memory snapshot ({exc})") from None
