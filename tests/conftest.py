"""Shared test helpers: where the real snapshots are, and a raw loader independent of memprof."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the samples import their shared helpers as Python does when it runs them: from their folder
sys.path.insert(0, str(ROOT / "sample_scripts"))
FIXTURES = Path(os.environ.get("MEMPROF_FIXTURES",
                               ROOT.parent / "shared" / "fixtures" / "snapshots"))


# the ground-truth runs' snapshots are real snapshots too
GROUNDTRUTH_SNAPSHOTS = FIXTURES.parent / "groundtruth" / "snapshots"


def fixture_files() -> list[Path]:
    """Every real snapshot in the shared fixtures folders (empty when they are absent)."""
    return sorted(p for folder in (FIXTURES, GROUNDTRUTH_SNAPSHOTS) if folder.is_dir()
                  for p in folder.iterdir() if p.suffix in (".pickle", ".pkl"))


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
