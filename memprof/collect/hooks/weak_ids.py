"""A map keyed by object identity that holds its keys weakly, for the hooks' hot paths.

torch's ``WeakIdKeyDictionary`` makes a weak reference at every lookup (about 3 µs); a
module hook looks its module up at every call. This one keys a plain dict by ``id`` and
checks the stored weak reference, so a lookup is a dict get and a call.

    paths = WeakIdMap()
    paths[module] = "transformer.h.0"
    paths.get(module)  # "transformer.h.0"; None once the module is gone or never set
"""

from __future__ import annotations

import functools
import weakref
from typing import Generic, TypeVar

V = TypeVar("V")


class WeakIdMap(Generic[V]):
    """``object -> V`` by identity; an entry goes when its object is collected."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref, V]] = {}

    def get(self, obj: object) -> V | None:
        item = self._items.get(id(obj))
        return item[1] if item is not None and item[0]() is obj else None

    def __contains__(self, obj: object) -> bool:
        item = self._items.get(id(obj))
        return item is not None and item[0]() is obj

    def __setitem__(self, obj: object, value: V) -> None:
        key = id(obj)
        item = self._items.get(key)
        if item is not None and item[0]() is obj:
            ref = item[0]
        else:  # new, or an object at the address of a collected one whose callback is due
            ref = weakref.ref(obj, functools.partial(self._forget, key))
        self._items[key] = (ref, value)

    def __len__(self) -> int:
        return len(self._items)

    def _forget(self, key: int, ref: weakref.ref) -> None:
        item = self._items.get(key)
        if item is not None and item[0] is ref:
            del self._items[key]
