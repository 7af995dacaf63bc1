"""The hooks' identity map: found by identity, never by equality, and gone with its key."""

from __future__ import annotations

import gc

import torch

from memprof.collect.hooks.weak_ids import WeakIdMap


def test_keys_by_identity_not_equality() -> None:
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    paths: WeakIdMap[str] = WeakIdMap()
    paths[a] = "a"
    assert paths.get(a) == "a" and a in paths
    assert paths.get(b) is None and b not in paths
    paths[a] = "renamed"
    assert paths.get(a) == "renamed" and len(paths) == 1


def test_an_entry_goes_with_its_object() -> None:
    paths: WeakIdMap[str] = WeakIdMap()
    kept = torch.zeros(1)
    paths[kept] = "kept"
    for i in range(100):  # tensors die at once; their ids are reused by the next ones
        paths[torch.zeros(1)] = str(i)
    gc.collect()
    assert len(paths) == 1 and paths.get(kept) == "kept"
    fresh = torch.zeros(1)
    assert paths.get(fresh) is None
