"""Unpickling a file anyone can write: no code, bounded nesting, bounded memory.

- No code: every class reference is refused (a snapshot never holds one).
- Nesting: a dict key that is a tuple nested 200,000 deep overflows the C stack while the
  unpickler hashes it (a segfault, no exception). Only the tuple opcodes nest what gets
  hashed, and each runs once, so their byte count bounds the depth; one pass over the
  file counts them at C speed, and the stack is made to fit the bound while unpickling
  (see :func:`with_stack_for`).
- Memory: a 10-byte pickle can ask the unpickler for gigabytes (``LONG_BINPUT`` of a huge
  memo index); the address space is capped at a multiple of the file size while it loads.
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import BinaryIO, TypeVar

T = TypeVar("T")

TUPLE_OPCODES = b"t\x85\x86\x87"  # TUPLE, TUPLE1, TUPLE2, TUPLE3
_OTHER_BYTES = bytes(sorted(set(range(256)) - set(TUPLE_OPCODES)))
STACK_PER_LEVEL = 256  # C stack bytes per level of tuple hashing; 64 measured (CPython 3.11)
CALLER_LEVELS = 2_048  # nesting any thread can hash (512 KiB of stack at this rate)
MAX_STACK = 1 << 31
MAIN_STACK_MAX = 96 << 20  # below the 128 MiB Linux keeps free under the main stack
MEMORY_PER_BYTE = 64  # address space allowed per byte of file while unpickling
MEMORY_FLOOR = 1 << 30


class Refused(Exception):
    """The file is refused before or while unpickling; the message says why."""


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


def nesting_bound(f: BinaryIO) -> int:
    """How deep the pickle in ``f`` could nest tuples at most (rewinds ``f``)."""
    count = 0
    while chunk := f.read(1 << 22):
        count += len(chunk.translate(None, _OTHER_BYTES))
    f.seek(0)
    return count


def unpickle(f: BinaryIO, size: int) -> object:
    """Unpickle ``f`` (a file of ``size`` bytes) with every class reference refused."""
    with memory_cap(max(MEMORY_FLOOR, MEMORY_PER_BYTE * size)), gc_paused(), _quiet():
        return _NoClassesUnpickler(io.BufferedReader(f, 1 << 20)).load()  # type: ignore[arg-type]


@contextmanager
def _quiet() -> Iterator[None]:
    """Nothing printed by objects the unpickler drops after a failure (a bytearray it could
    not fill prints a SystemError through ``sys.excepthook`` as it goes): the failure itself
    is reported, in one line."""
    hooks = sys.excepthook, sys.unraisablehook
    sys.excepthook = lambda kind, value, tb: None
    sys.unraisablehook = lambda unraisable: None
    try:
        yield
    finally:
        sys.excepthook, sys.unraisablehook = hooks


def with_stack_for(levels: int, work: Callable[[], T]) -> T:
    """``work()`` with C stack enough to hash tuples nested ``levels`` deep.

    On the main thread (Linux) the stack grows on demand up to ``RLIMIT_STACK``, checked
    when it grows, and the kernel keeps at least 128 MiB free below it: raising the soft
    limit is enough (and Ctrl-C still interrupts the load). Elsewhere, or deeper, ``work``
    runs on a thread with a stack that fits.
    """
    stack = levels * STACK_PER_LEVEL + (1 << 20)
    if levels <= CALLER_LEVELS:
        return work()
    if stack > MAX_STACK:
        raise Refused(f"it could nest tuples {levels:,} deep, more than memprof can check")
    if threading.current_thread() is threading.main_thread():
        with _main_stack(stack) as raised:
            if raised:
                return work()
    return _on_thread(stack + (8 << 20), work)


@contextmanager
def _main_stack(size: int) -> Iterator[bool]:
    """Let the main thread's stack grow to ``size`` bytes; yield whether it can."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    except (ImportError, OSError, ValueError):
        yield False
        return
    if soft == resource.RLIM_INFINITY or soft >= size:
        yield True
        return
    if size > MAIN_STACK_MAX or (hard != resource.RLIM_INFINITY and hard < size) \
            or not sys.platform.startswith("linux"):
        yield False
        return
    resource.setrlimit(resource.RLIMIT_STACK, (size, hard))
    try:
        yield True
    finally:
        resource.setrlimit(resource.RLIMIT_STACK, (soft, hard))


def _on_thread(stack: int, work: Callable[[], T]) -> T:
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append((False, exc))

    previous = threading.stack_size(stack)
    try:
        worker = threading.Thread(target=run, name="memprof-unpickle", daemon=True)
        worker.start()
    except (RuntimeError, MemoryError):
        raise Refused(f"checking its nesting needs a thread with {stack >> 20:,} MiB of stack,"
                      " which this machine did not give") from None
    finally:
        threading.stack_size(previous)
    worker.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


@contextmanager
def memory_cap(budget: int) -> Iterator[None]:
    """Cap the process's address space at its current size plus ``budget`` (Linux)."""
    try:
        import resource

        with open("/proc/self/statm") as statm:
            current = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        yield
        return
    cap = current + budget
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
