"""Object collectives on the virtual GPU: the pickles go through the group's store.

``all_gather_object``, ``gather_object``, ``broadcast_object_list`` and
``scatter_object_list`` pickle objects into byte tensors on the card and exchange them
with tensor collectives; virtual tensors hold no values to exchange, and a rank would
unpickle its own bytes, or placeholders. PyTorch's own function still runs, so its byte
tensors are allocated on the card as on a real one, but the objects are exchanged through
the store the ranks met at (``c10d``'s for that group), as pickles, and put where PyTorch
puts them. Every rank of the group must run (``memprof run --nproc-per-node`` and
``torchrun`` run them all).

    patches.update(ObjectCollectives().patches())  # by (module, attribute)
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_PREFIX = "memprof-objects"


class ObjectCollectives:
    """The object collectives, exchanging pickles through each group's store."""

    def __init__(self) -> None:
        self._calls: dict[str, int] = {}  # per group: object collectives so far

    def patches(self) -> dict[tuple[Any, str], Callable[..., Any]]:
        """Replacements by (module, attribute); PyTorch's bytes are not unpickled."""
        wrapped = {name: self._wrap(name, getattr(c10d, name), how) for name, how in (
            ("all_gather_object", self._all_gather), ("gather_object", self._gather),
            ("broadcast_object_list", self._broadcast), ("scatter_object_list", self._scatter))}
        return {**{(owner, name): fn for name, fn in wrapped.items() for owner in (c10d, dist)},
                (c10d, "_tensor_to_object"): _unread}

    def _wrap(self, name: str, original: Callable[..., Any],
              how: Callable[[Any, dict[str, Any]], None]) -> Callable[..., Any]:
        import inspect

        signature = inspect.signature(original)

        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)  # the card's byte tensors, as PyTorch makes them
            given = signature.bind(*args, **kwargs).arguments
            group = given.get("group") or c10d._get_default_group()
            if not c10d._rank_not_in_group(group):
                how(group, given)
            return out
        return collective

    def _key(self, group: Any) -> str:
        name = group.group_name
        self._calls[name] = n = self._calls.get(name, 0) + 1
        return f"{_PREFIX}/{n}"

    def _all_gather(self, group: Any, given: dict[str, Any]) -> None:
        given["object_list"][:] = _exchange(group, self._key(group), given["obj"], None)

    def _gather(self, group: Any, given: dict[str, Any]) -> None:
        dst = _group_rank(group, given.get("dst"), given.get("group_dst"))
        objects = _exchange(group, self._key(group), given["obj"], dst)
        if dist.get_rank(group) == dst:
            given["object_gather_list"][:] = objects

    def _broadcast(self, group: Any, given: dict[str, Any]) -> None:
        src = _group_rank(group, given.get("src"), given.get("group_src"))
        key, store = self._key(group), _store(group)
        if dist.get_rank(group) == src:
            store.set(key, pickle.dumps(list(given["object_list"])))
        else:
            given["object_list"][:] = pickle.loads(store.get(key))

    def _scatter(self, group: Any, given: dict[str, Any]) -> None:
        src = _group_rank(group, given.get("src"), given.get("group_src"))
        key, store, rank = self._key(group), _store(group), dist.get_rank(group)
        if rank == src:
            for r, obj in enumerate(given["scatter_object_input_list"]):
                store.set(f"{key}/{r}", pickle.dumps(obj))
        given["scatter_object_output_list"][0] = pickle.loads(store.get(f"{key}/{rank}"))


def _unread(tensor: Any, size: Any, group: Any) -> None:
    """``_tensor_to_object``: the bytes are placeholders; the object comes from the store."""
    return None


def _store(group: Any) -> Any:
    return c10d._world.pg_map[group][1]


def _group_rank(group: Any, rank: int | None, group_rank: int | None) -> int:
    """The group rank of a ``src``/``dst`` given as a global rank or a group rank."""
    if group_rank is not None:
        return group_rank
    return dist.get_group_rank(group, rank if rank is not None else 0)


def _exchange(group: Any, key: str, obj: Any, reader: int | None) -> list[Any]:
    """Every rank's ``obj``, by group rank (for ``reader`` only, where one is named)."""
    store, rank = _store(group), dist.get_rank(group)
    store.set(f"{key}/{rank}", pickle.dumps(obj))
    if reader is not None and rank != reader:
        return []
    return [pickle.loads(store.get(f"{key}/{r}")) for r in range(group.size())]
