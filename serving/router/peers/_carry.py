"""State a peer keeps beside the router's prefix index, so it carries over as that index does.

A peer's own index (llm-d's per-endpoint LRU, production-stack's hash trie, Dynamo's radix
tree) lives as long as the router process in its project. Here a policy object is rebuilt
with every routing-table version (`RouterState` is rebuilt; its `prefix_index` is handed
over), so the peer's state is attached to that carried-over `PrefixIndex` by a weak
reference: it survives republishes and goes with the index.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast
from weakref import WeakKeyDictionary

from serving.router.index import RouterState
from serving.router.prefix import PrefixIndex

T = TypeVar("T")

_CARRIED: WeakKeyDictionary[PrefixIndex, dict[str, object]] = WeakKeyDictionary()


def carried(state: RouterState, key: str, factory: Callable[[], T]) -> T:
    """The object stored under `key` beside `state.prefix_index`, made by `factory` once."""
    slots = _CARRIED.get(state.prefix_index)
    if slots is None:
        slots = _CARRIED[state.prefix_index] = {}
    value = slots.get(key)
    if value is None:
        value = slots[key] = factory()
    return cast(T, value)
