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


def fixture_files() -> list[Path]:
    """Every snapshot in the shared fixtures folder (empty when it is absent)."""
    if not FIXTURES.is_dir():
        return []
    return sorted(p for p in FIXTURES.iterdir() if p.suffix in (".pickle", ".pkl"))


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
