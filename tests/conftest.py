"""Shared test helpers: where the real snapshots are, and a raw loader independent of memprof."""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from memprof.collect.cpu.recorder import CpuRecorder
from memprof.collect.virtual.cards import parse_spec
from memprof.collect.virtual.gpu import VirtualGpu
from memprof.trace.model import AllocatorSettings

ROOT = Path(__file__).resolve().parent.parent
# the samples import their shared helpers as Python does when it runs them: from their folder
sys.path.insert(0, str(ROOT / "sample_scripts"))
FIXTURES = Path(os.environ.get("MEMPROF_FIXTURES",
                               ROOT.parent / "shared" / "fixtures" / "snapshots"))


# the ground-truth runs' snapshots are real snapshots too
GROUNDTRUTH_SNAPSHOTS = FIXTURES.parent / "groundtruth" / "snapshots"
# recorded by this project on a GPU (benchmarks/gpu_validation.py): a folder per sample run,
# its snapshots beside counters.json, what PyTorch and NVML measured in the same run
GPU_FIXTURES = ROOT / "tests" / "fixtures" / "gpu"


@pytest.fixture(autouse=True, scope="session")
def _own_config_folder(tmp_path_factory: pytest.TempPathFactory) -> None:
    """memprof's secret (``report/provenance.py``) in a folder of the suite's own, for the
    suite's processes and the ones they start, never the user's."""
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("config"))


@pytest.fixture(autouse=True, scope="session")
def _not_a_rank() -> None:
    """A runner that sets torchrun's variables (``RANK``, ``MASTER_PORT``...) would make
    every script the suite runs a rank of a distributed job; the suite's runs are single
    processes unless a test launches ranks itself."""
    for name in ("RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "ROLE_RANK", "WORLD_SIZE",
                 "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        os.environ.pop(name, None)


@pytest.fixture(autouse=True, scope="session")
def _bytecode_kept(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Under PYTHONDONTWRITEBYTECODE each of the suite's few hundred processes would compile
    memprof's modules again (about 0.3 s each): they keep the bytecode in a folder of the
    suite's own instead (PYTHONPYCACHEPREFIX), and the checkout stays as it is."""
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
        del os.environ["PYTHONDONTWRITEBYTECODE"]
        os.environ["PYTHONPYCACHEPREFIX"] = str(tmp_path_factory.mktemp("bytecode"))


WORKERS = max(2, min(6, os.cpu_count() or 2))  # processes a module's jobs run at once


class Jobs(dict[str, Callable[[Path], Any]]):
    """A test module's processes, started together so that they share the cores instead of
    taking turns: ``@jobs`` registers a function of an empty folder of its own, which runs
    its processes and returns what its test reads; ``yield from jobs.started(...)`` in a
    module fixture starts every job on a pool, in the order registered (the longest first),
    and gives each one's Future by name. A test reads ``runs[name].result()``: the job's
    value, or its exception (a failed assertion in the job fails the test that reads it).
    A job may wait for one registered before it (``jobs.result(name)``): the pool takes
    them in order, so that one has started; never for a later one."""

    futures: dict[str, Future[Any]]

    def __call__(self, fn: Callable[[Path], Any]) -> Callable[[Path], Any]:
        assert fn.__name__ not in self, fn.__name__
        self[fn.__name__] = fn
        return fn

    def started(self, tmp_path_factory: pytest.TempPathFactory, name: str,
                workers: int = WORKERS) -> Iterator[dict[str, Future[Any]]]:
        base = tmp_path_factory.mktemp(name)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            self.futures = {}
            for job, fn in self.items():
                (base / job).mkdir()
                self.futures[job] = pool.submit(fn, base / job)
            yield self.futures
            for future in self.futures.values():
                future.cancel()

    def result(self, name: str) -> Any:
        """The value of the job ``name`` (in a job: one registered before it)."""
        return self.futures[name].result()


def fixture_files() -> list[Path]:
    """Every real snapshot: the shared fixtures folders' (absent on a machine without
    them) and this project's GPU recordings."""
    shared = sorted(p for folder in (FIXTURES, GROUNDTRUTH_SNAPSHOTS) if folder.is_dir()
                    for p in folder.iterdir() if p.suffix in (".pickle", ".pkl"))
    return shared + sorted(GPU_FIXTURES.glob("*/*.pickle"))


def fixture_id(path: Path) -> str:
    """A test id for a snapshot: its name, with its folder's for the GPU recordings."""
    return f"gpu/{path.parent.name}/{path.name}" if path.parent.parent == GPU_FIXTURES \
        else path.name[:40]


needs_fixtures = pytest.mark.skipif(
    not fixture_files(), reason=f"real snapshots not found at {FIXTURES} (set MEMPROF_FIXTURES)")


def fixture(name_prefix: str) -> Path:
    """The fixture whose file name starts with ``name_prefix``."""
    matches = [p for p in fixture_files() if p.name.startswith(name_prefix)]
    if not matches:
        pytest.skip(f"fixture {name_prefix}* not found in {FIXTURES}")
    return matches[0]


class _Refuse(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"{module}.{name}")


def load_raw(path: Path) -> object:
    """The raw snapshot, loaded without memprof (for independent checks)."""
    with path.open("rb") as f:
        return _Refuse(f).load()


@pytest.fixture
def gpu() -> Iterator[VirtualGpu]:
    """A virtual H100 recording in this process, for the duration of the test: CUDA
    tensors made in it are virtual, and ``torch.cuda`` answers from the allocator model."""
    virtual = VirtualGpu(parse_spec("H100"), AllocatorSettings())
    with CpuRecorder(virtual.recorder), virtual:
        yield virtual
