"""Start ``python -m memprof ...`` without importing torch again: a warm interpreter imports
it once and forks a child for each command (Linux).

Importing torch is most of a short ``memprof run``: about 1.5 s of CPU before the script's
first line, paid again by every re-run of ``suggest --verify`` and ``--fit-batch``. A warm
server (``python -m memprof.warm``) imports torch and memprof's command modules, then waits
on a socket. Each request brings its command line, folder, environment and standard streams
(as file descriptors); the server forks, and the child becomes the command: it takes the
streams, the folder and the environment, and runs the module as ``python -m`` does, so an
exception, ``sys.exit``, threads left running and ``atexit`` end it as they end a fresh
interpreter. PyTorch's DataLoader forks after importing torch in the same way.

A variable that the imports read (``OMP_NUM_THREADS``, ``PYTHONPATH``...) must be the
server's, so there is one server per environment, the variables read later (``MEMPROF_*``,
``PYTORCH_CUDA_ALLOC_CONF`` and pytest's ``PYTEST_CURRENT_TEST``) aside. The server ends
with the process that started it (its stdin, a pipe that process holds, closes), and its
children end with it.

    done = run(["-m", "memprof", "run", "train.py"], cwd=".", env=env)   # CompletedProcess
    started = server_for(env).start(["-m", "memprof", "run", "train.py"], ".", env,
                                    (0, out.fileno(), err.fileno()))    # started.wait()
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import gc
import importlib
import io
import json
import os
import random
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

# what a run imports before the script's first line, or lazily on the virtual GPU (fake
# tensors, DTensor and FSDP, dynamo's hooks): a second of CPU each run otherwise
PRELOADED = ("torch", "memprof.cli.app", "memprof.cli.run", "memprof.collect.recording",
             "memprof.collect.virtual.session", "memprof.collect.virtual.gpu",
             "memprof.report.run_folder", "memprof.report.html", "memprof.report.plot",
             "torch._dynamo", "torch.fx.experimental.symbolic_shapes",
             "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
             "torch.testing._internal.distributed.fake_pg", "torch.onnx", "typer._adapters",
             "pydantic", "numpy.random")
# variables no import reads: memprof's, the allocator's, and the one pytest sets anew for
# each test (``suggest`` under a test would otherwise start a server a test)
READ_LATER = ("MEMPROF_", "PYTORCH_CUDA_ALLOC_CONF", "PYTEST_CURRENT_TEST")
_STATUS = struct.Struct("q")  # the child's pid, then its return code (as Popen's)
_PR_SET_PDEATHSIG = 1
_MAX_REQUEST = 1 << 20


def available() -> bool:
    """Whether commands can start warm here: Linux (fork after importing torch is safe
    there, as DataLoader's workers show) and file descriptors over Unix sockets."""
    return sys.platform == "linux" and hasattr(socket, "send_fds")


def early(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables of ``env`` that starting an interpreter and its imports may read: the
    key of the server a command with ``env`` can use."""
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(READ_LATER)))


@dataclass
class Started:
    """A command a warm server started: its pid, and its return code once it ends."""

    pid: int
    _reply: socket.socket
    returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        """The return code (negative: the signal that ended it); TimeoutError after
        ``timeout`` seconds, the command still running."""
        if self.returncode is None:
            self._reply.settimeout(timeout)
            try:
                data = _receive(self._reply, _STATUS.size)
            except TimeoutError:
                raise TimeoutError(f"process {self.pid} still running") from None
            self._reply.close()
            # the server ended before the command did: its children end with it (SIGTERM)
            self.returncode = _STATUS.unpack(data)[0] if data else -signal.SIGTERM
        return self.returncode


class WarmPython:
    """A warm server for commands with the environment ``env`` (its early variables)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self._lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._control = ours
        self._server = subprocess.Popen(
            [sys.executable, "-m", "memprof.warm", str(theirs.fileno())], env=self.env,
            cwd="/", stdin=subprocess.PIPE, pass_fds=(theirs.fileno(),),
            preexec_fn=die_with_parent)
        theirs.close()

    def start(self, args: Sequence[str], cwd: str | os.PathLike[str], env: Mapping[str, str],
              streams: tuple[int, int, int], new_session: bool = False) -> Started:
        """Start ``python ARGS`` (``-m MODULE ...``) in ``cwd`` with ``env`` (its early
        variables this server's) and ``streams`` as its stdin, stdout and stderr."""
        if list(args[:1]) != ["-m"] or len(args) < 2:
            raise ValueError(f"a warm start runs -m MODULE ..., not {list(args)!r}")
        if early(env) != early(self.env):
            raise ValueError("the command's early environment is not this server's")
        request = json.dumps({"args": list(args), "cwd": os.fspath(cwd), "env": dict(env),
                              "new_session": new_session}).encode()
        ours, theirs = socket.socketpair()
        with theirs, self._lock:
            socket.send_fds(self._control, [request], [*streams, theirs.fileno()])
        data = _receive(ours, _STATUS.size)
        if not data:
            ours.close()
            raise OSError("the warm interpreter has ended")
        return Started(_STATUS.unpack(data)[0], ours)

    def alive(self) -> bool:
        """Whether the server still runs."""
        return self._server.poll() is None


_servers: dict[tuple[tuple[str, str], ...], WarmPython] = {}
_servers_lock = threading.Lock()


def server_for(env: Mapping[str, str]) -> WarmPython:
    """This process's warm server for commands with ``env``, started on first use and ended
    when this process ends."""
    key = early(env)
    with _servers_lock:
        server = _servers.get(key)
        if server is None or not server.alive():
            server = _servers[key] = WarmPython(dict(key))
    return server


def run(args: Sequence[str], cwd: str | os.PathLike[str], env: Mapping[str, str],
        timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` in ``cwd`` with ``env`` in a session of its own, stdin empty,
    and capture its output (text) as ``subprocess.run`` does: warm where it can
    (``-m MODULE``, here), else a fresh interpreter. After ``timeout`` seconds its whole
    session is killed and ``subprocess.TimeoutExpired`` raised."""
    argv = [sys.executable, *args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            open(os.devnull, "rb") as empty:
        streams = (empty.fileno(), out.fileno(), err.fileno())
        started: Started | subprocess.Popen[bytes] | None = None
        if available() and list(args[:1]) == ["-m"] and len(args) > 1:
            with contextlib.suppress(OSError):  # no server here: the command starts fresh
                started = server_for(env).start(args, cwd, env, streams, new_session=True)
        if started is None:
            started = subprocess.Popen(argv, cwd=cwd, env=dict(env), stdin=empty, stdout=out,
                                       stderr=err, start_new_session=True,
                                       preexec_fn=die_with_parent)
        try:
            code = started.wait(timeout)
        except (TimeoutError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(started.pid, signal.SIGKILL)
            started.wait()
            raise subprocess.TimeoutExpired(argv, timeout or 0, _text(out), _text(err)) \
                from None
        return subprocess.CompletedProcess(argv, code, _text(out), _text(err))


def _text(file: IO[bytes]) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


def _receive(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


@dataclass(frozen=True)
class _Request:
    args: list[str]
    cwd: str
    env: dict[str, str]
    new_session: bool
    streams: list[int]


def _serve(control: socket.socket) -> _Request:
    """Wait for requests and fork a child for each; return in the child only. The server
    exits when the process that started it ends (EOF on stdin or on ``control``)."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    waiting: dict[int, socket.socket] = {}
    while True:
        readable = select.select([control, sys.stdin, wake_read], [], [])[0]
        if wake_read in readable:
            os.read(wake_read, 4096)
        _reap(waiting)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
            sys.exit(0)
        if control not in readable:
            continue
        message, fds, _, _ = socket.recv_fds(control, _MAX_REQUEST, 4)
        if not message:
            sys.exit(0)
        reply = socket.socket(fileno=fds[3])
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_read, wake_write):
                os.close(fd)
            control.close()
            reply.close()
            for other in waiting.values():
                other.close()
            fields = json.loads(message)
            return _Request(fields["args"], fields["cwd"], fields["env"],
                            fields["new_session"], fds[:3])
        for fd in fds[:3]:
            os.close(fd)
        with contextlib.suppress(OSError):
            reply.sendall(_STATUS.pack(pid))
        waiting[pid] = reply


def _reap(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        reply = waiting.pop(pid, None)
        if reply is not None:
            with contextlib.suppress(OSError):
                reply.sendall(_STATUS.pack(os.waitstatus_to_exitcode(status)))
            reply.close()


def die_with_parent() -> None:
    """In a new process: end it (SIGTERM) when the process that started it ends, however
    (Linux; elsewhere it is left to finish)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _become(request: _Request) -> None:
    """In the child: take the request's streams, session, folder and environment, as a
    fresh ``python`` started with them would have them."""
    die_with_parent()
    if request.new_session:
        os.setsid()
    for target, fd in enumerate(request.streams):
        os.dup2(fd, target)
        os.close(fd)
    unbuffered = sys.__stdout__ is not None and sys.__stdout__.write_through  # -u, or so set
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        # as the interpreter makes them at start (create_stdio): this server's encoding and
        # errors, which its environment chose; buffering by what the stream now is
        made = getattr(sys, name)
        raw = io.FileIO(fd, "w" if fd else "r", closefd=False)
        buffer = io.BufferedReader(raw) if not fd else raw if unbuffered \
            else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(buffer, encoding=made.encoding, errors=made.errors,
                                  newline="\n", write_through=unbuffered,
                                  line_buffering=not unbuffered and (fd == 2 or os.isatty(fd)))
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    sys.path[0] = os.getcwd()  # as ``python -m`` puts the current folder first
    sys.orig_argv = [sys.executable, *request.args]
    random.seed()  # a fresh interpreter's seed, not the server's
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def main() -> None:
    """The server: import what commands need, serve, and in each child run its command."""
    control = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOADED:  # what this torch lacks, a command imports (and fails on) itself
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    # what the imports made stays: the collector never walks it again, in this server or its
    # children, whose pages it would otherwise copy (as the gc docs advise before forking)
    gc.collect()
    gc.freeze()
    request = _serve(control)
    _become(request)
    sys.argv = [request.args[1], *request.args[2:]]
    fresh = types.ModuleType("__main__")  # the command's, not this server's
    fresh.__builtins__ = builtins
    sys.modules["__main__"] = fresh
    try:
        runpy._run_module_as_main(request.args[1])  # as ``python -m`` runs it
    except SystemExit:
        raise
    except BaseException as exc:  # as the interpreter ends on it, without this file's frames
        trace = exc.__traceback__
        while trace is not None and trace.tb_frame.f_code.co_filename == __file__:
            trace = trace.tb_next
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, trace
        sys.excepthook(type(exc), exc.with_traceback(trace), trace)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
