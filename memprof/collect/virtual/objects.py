"""Object collectives on the virtual GPU: the pickles go through the group's store.

``all_gather_object``, ``gather_object``, ``broadcast_object_list``,
``scatter_object_list``, ``send_object_list`` and ``recv_object_list`` pickle objects
into byte tensors on the card and exchange them with tensor collectives; virtual tensors
hold no values to exchange, and a rank would unpickle its own bytes, or placeholders.
PyTorch's own function still runs, so its byte tensors are allocated on the card as on a
real one, but the objects are exchanged through the store the ranks met at (``c10d``'s
for that group), as pickles, and put where PyTorch puts them. Where ``memprof run
--ranks`` runs some ranks of the world only (``RANKS_RUN``), a rank not run sends what
this rank sends: its own objects (every rank runs the same program), and a broadcast,
scatter or send from it leaves this rank's objects as they were; said once. A small
tensor's values (``values.py``) that a broadcast, a send or a recv moves go through the
store too (``broadcast_values``, ``p2p_values``): pipeline schedules vote with them, and
their stages send each other their shapes.

    patches.update(ObjectCollectives().patches())  # by (module, attribute)
"""

from __future__ import annotations

import functools
import inspect
import os
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from memprof.collect.launch.endings import waiting
from memprof.collect.launch.ranks import RANKS_RUN
from memprof.collect.notices import say

_PREFIX = "memprof-objects"
# set by memprof's launcher and torchrun's agent: every rank a process, meeting at its store
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


class ObjectCollectives:
    """The object collectives, exchanging pickles through each group's store."""

    def __init__(self) -> None:
        self._run = _ranks_run()
        self._told = False

    def patches(self) -> dict[tuple[Any, str], Callable[..., Any]]:
        """Replacements by (module, attribute); PyTorch's bytes are not unpickled."""
        wrapped = {name: self._wrap(name, getattr(c10d, name), how) for name, how in (
            ("all_gather_object", self._all_gather), ("gather_object", self._gather),
            ("scatter_object_list", self._scatter))}
        wrapped["broadcast_object_list"] = self._wrap_broadcast(c10d.broadcast_object_list)
        wrapped["send_object_list"] = self._wrap(
            "send_object_list", c10d.send_object_list, self._send, before=True)
        # waits for its objects however it receives them (use_batch: by irecv)
        wrapped["recv_object_list"] = _blocking_recv(self._wrap(
            "recv_object_list", c10d.recv_object_list, self._recv))
        wrapped["recv"] = _blocking_recv(c10d.recv)
        return {**{(owner, name): fn for name, fn in wrapped.items() for owner in (c10d, dist)},
                (c10d, "_tensor_to_object"): _unread}

    def _wrap(self, name: str, original: Callable[..., Any],
              how: Callable[[Any, dict[str, Any]], None], before: bool = False
              ) -> Callable[..., Any]:
        """``original`` (the card's byte tensors, as PyTorch makes them), then ``how``
        exchanges the objects (``before``: first, as a sender, which waits for no one)."""
        signature = inspect.signature(original)

        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            given, group = _bound(signature, args, kwargs)
            if before and group is not None:
                how(group, given)
            out = original(*args, **kwargs)
            if not before and group is not None:
                how(group, given)
            return out
        return collective

    def _wrap_broadcast(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``broadcast_object_list``: the objects come first, through the store, so that a
        receiving rank's byte tensor gets the size of the objects sent (PyTorch reads the
        sizes from a tensor a broadcast fills, and a virtual one fills nothing)."""
        signature = inspect.signature(original)

        @functools.wraps(original)
        def broadcast_object_list(*args: Any, **kwargs: Any) -> Any:
            given, group = _bound(signature, args, kwargs)
            if group is None:
                return original(*args, **kwargs)
            received = self._broadcast(group, given)
            if received is None:
                return original(*args, **kwargs)
            sizes = [len(pickle.dumps(obj)) for obj in received]
            tensor_broadcast = c10d.broadcast

            def sizes_filled(tensor: Any, *a: Any, **k: Any) -> Any:
                c10d.broadcast = tensor_broadcast  # the sizes' broadcast comes first
                out = tensor_broadcast(tensor, *a, **k)
                tensor.copy_(torch.tensor(sizes, dtype=tensor.dtype))
                return out

            c10d.broadcast = sizes_filled
            try:
                return original(*args, **kwargs)
            finally:
                c10d.broadcast = tensor_broadcast
                given["object_list"][:] = received
        return broadcast_object_list

    def _key(self, group: Any) -> str:
        """The next object collective's key in ``group``."""
        return _next(f"{_PREFIX}/{group.group_name}")

    def _all_gather(self, group: Any, given: dict[str, Any]) -> None:
        given["object_list"][:] = self._exchange(group, self._key(group), given["obj"], None)

    def _gather(self, group: Any, given: dict[str, Any]) -> None:
        dst = _group_rank(group, given.get("dst"), given.get("group_dst"))
        objects = self._exchange(group, self._key(group), given["obj"], dst)
        if dist.get_rank(group) == dst:
            given["object_gather_list"][:] = objects

    def _broadcast(self, group: Any, given: dict[str, Any]) -> list[Any] | None:
        """Send this rank's objects, or the objects a receiving rank gets (None: it sends)."""
        src = _group_rank(group, given.get("src"), given.get("group_src"))
        key, store = self._key(group), _store(group)
        objects = list(given["object_list"])
        if dist.get_rank(group) == src:
            store.set(key, pickle.dumps(objects))
            return None
        return pickle.loads(_get(store, key)) if self._runs(group, src) else objects

    def _scatter(self, group: Any, given: dict[str, Any]) -> None:
        src = _group_rank(group, given.get("src"), given.get("group_src"))
        key, store, rank = self._key(group), _store(group), dist.get_rank(group)
        if rank == src:
            for r, obj in enumerate(given["scatter_object_input_list"]):
                store.set(f"{key}/{r}", pickle.dumps(obj))
        if self._runs(group, src):
            given["scatter_object_output_list"][0] = pickle.loads(_get(store, f"{key}/{rank}"))

    def _send(self, group: Any, given: dict[str, Any]) -> None:
        dst = _group_rank(group, given.get("dst"), given.get("group_dst"))
        _store(group).set(_pair_key(group, "objects", dist.get_rank(group), dst),
                          pickle.dumps(list(given["object_list"])))

    def _recv(self, group: Any, given: dict[str, Any]) -> None:
        src = _group_rank(group, given.get("src"), given.get("group_src"))
        key = _pair_key(group, "objects", src, dist.get_rank(group))
        if self._runs(group, src):
            given["object_list"][:] = pickle.loads(_get(_store(group), key))

    def _exchange(self, group: Any, key: str, obj: Any, reader: int | None) -> list[Any]:
        """Every rank's ``obj``, by group rank (for ``reader`` only, where one is named)."""
        store, rank = _store(group), dist.get_rank(group)
        mine = pickle.dumps(obj)
        store.set(f"{key}/{rank}", mine)
        if reader is not None and rank != reader:
            return []
        return [pickle.loads(_get(store, f"{key}/{r}") if self._runs(group, r) else mine)
                for r in range(group.size())]

    def _runs(self, group: Any, group_rank: int) -> bool:
        """Whether the rank of ``group`` at ``group_rank`` runs (``--ranks``); the first
        time one does not, say what this rank takes from it instead."""
        if self._run is None or dist.get_global_rank(group, group_rank) in self._run:
            return True
        if not self._told:
            self._told = True
            say("memprof: an object collective involves ranks not run (--ranks): each is"
                " taken to send what the receiving rank sends, and a broadcast, scatter or"
                " send from one leaves the receiving rank's objects as they were (pipeline"
                " stages send each other their shapes: run every rank, --ranks all)")
        return False


_sequences: dict[str, int] = {}  # per group (and pair of ranks): exchanges so far


def _next(key: str) -> str:
    """``key`` numbered by how many exchanges under it came before: every rank numbers its
    own, and they agree, as the ranks make the same calls in the same order."""
    _sequences[key] = n = _sequences.get(key, 0) + 1
    return f"{key}/{n}"


def _pair_key(group: Any, what: str, src: int, dst: int) -> str:
    """The next key of ``what`` sent from group rank ``src`` to ``dst``."""
    return _next(f"{_PREFIX}/{what}/{group.group_name}/{src}>{dst}")


def _launched_store(group: Any) -> Any:
    """The group's store where a launcher started every rank as a process (None: the
    other ranks are no processes, one's own group)."""
    entry = c10d._world.pg_map.get(group) if group is not None else None
    return entry[1] if entry is not None and os.environ.get(AGENT_STORE) == "True" else None


def broadcast_values(group: Any, root: int, tensors: list[torch.Tensor]) -> None:
    """A tensor broadcast's small values (``values.py``) from ``root`` (a group rank)
    through the group's store, as the objects go: the root's are set, a receiving rank's
    replaced where the root runs (``--ranks``) and its tensor holds values of that shape."""
    store = _launched_store(group)
    if store is None:
        return
    key = _next(f"{_PREFIX}/values/{group.group_name}")
    if group.rank() == root:
        store.set(key, pickle.dumps([getattr(t, "value", None) for t in tensors]))
    elif any(getattr(t, "value", None) is not None for t in tensors):
        _received(store, key, group, root, tensors)


def p2p_values(sending: bool, group: Any, peer: int, tensors: list[torch.Tensor]) -> None:
    """A send's or recv's small values (``values.py``; the tensors of both are the same
    size) through the group's store: the sender's set, the receiver's replaced where the
    sender runs (``--ranks``) and the recv waits (``dist.recv``, not ``irecv``). ``peer``:
    the other end's group rank."""
    from memprof.collect.virtual.values import SMALL

    store = _launched_store(group)
    if store is None or not tensors or any(t.numel() > SMALL for t in tensors):
        return
    me = group.rank()
    key = _pair_key(group, "values", *((me, peer) if sending else (peer, me)))
    if sending:
        store.set(key, pickle.dumps([getattr(t, "value", None) for t in tensors]))
    elif getattr(_waiting, "on", False):  # an irecv's key is numbered, never waited for
        _received(store, key, group, peer, tensors)


_waiting = threading.local()  # set while the script's dist.recv waits for its tensor


def _blocking_recv(original: Callable[..., Any]) -> Callable[..., Any]:
    """``dist.recv`` (or ``recv_object_list``), which waits for its tensor: its small values
    are waited for too. An ``irecv`` of the script's (a pipeline's batched sends and
    receives) waits for nothing, and gets none: two ranks that each receive before they
    send would wait on each other forever."""
    @functools.wraps(original)
    def recv(*args: Any, **kwargs: Any) -> Any:
        _waiting.on = True
        try:
            return original(*args, **kwargs)
        finally:
            _waiting.on = False
    return recv


def _received(store: Any, key: str, group: Any, sender: int, tensors: list[torch.Tensor]
              ) -> None:
    """Each of ``tensors`` given the values group rank ``sender`` set under ``key``, where
    it runs (``--ranks``) and they are values of the tensor's shape."""
    run = _ranks_run()
    if run is not None and dist.get_global_rank(group, sender) not in run:
        return
    for t, value in zip(tensors, pickle.loads(_get(store, key)), strict=False):
        if isinstance(value, torch.Tensor) and value.shape == t.shape:
            t.value = value.to(t.dtype)  # type: ignore[attr-defined]


def _ranks_run() -> set[int] | None:
    """The ranks of the world that run, where ``--ranks`` chose some (None: all)."""
    run = os.environ.get(RANKS_RUN)
    return None if run is None else {int(r) for r in run.split(",")}


def _bound(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
           ) -> tuple[dict[str, Any], Any]:
    """An object collective's arguments by name, and its group (None: this rank is not in
    it)."""
    given = signature.bind(*args, **kwargs).arguments
    group = given.get("group") or c10d._get_default_group()
    return given, None if c10d._rank_not_in_group(group) else group


def _unread(tensor: Any, size: Any, group: Any) -> None:
    """``_tensor_to_object``: the bytes are placeholders; the object comes from the store."""
    return None


def _store(group: Any) -> Any:
    return c10d._world.pg_map[group][1]


_POLL_S = 0.05  # the longest pause between looks at the store


@waiting
def _get(store: Any, key: str) -> bytes:
    """``store.get(key)``, looked for until it is set: a signal (the launcher stopping the
    ranks once one failed) is handled between looks, where one wait of the store's own
    timeout (30 minutes) would hold the rank until it ends."""
    pause = 0.001
    while not store.check([key]):
        time.sleep(pause)
        pause = min(2 * pause, _POLL_S)
    return store.get(key)


def _group_rank(group: Any, rank: int | None, group_rank: int | None) -> int:
    """The group rank of a ``src``/``dst`` given as a global rank or a group rank."""
    if group_rank is not None:
        return group_rank
    return dist.get_group_rank(group, rank if rank is not None else 0)

