"""Shared test helpers: where the real snapshots are, and a raw loader independent of memprof."""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path

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
