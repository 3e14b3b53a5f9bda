"""State a peer keeps beside the router's prefix index, so it carries over as that index does.

A peer's own index (llm-d's per-endpoint LRU, production-stack's hash trie, Dynamo's radix
tree) lives as long as the router process in its project. Here a policy object is rebuilt
with every routing-table version (`RouterState` is rebuilt; its `prefix_index` is handed
over), so the peer's state is kept in that carried-over `PrefixIndex`'s `carried`: it
survives republishes and goes with the index.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

from serving.router.index import RouterState

T = TypeVar("T")


def carried(state: RouterState, key: str, factory: Callable[[], T]) -> T:
    """The object stored under `key` beside `state.prefix_index`, made by `factory` once."""
    slots = state.prefix_index.carried
    value = slots.get(key)
    if value is None:
        value = slots[key] = factory()
    return cast(T, value)
