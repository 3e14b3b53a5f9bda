"""A Redis call with a deadline, on a plain Redis or a Redis Cluster. No Django.

Every data-plane call to Redis has a short deadline (`asyncio.wait_for`). On a plain Redis,
redis-py's asyncio client closes a connection whose command was cancelled, so the next user
of the pool gets a clean one. Its asyncio Cluster client does not do so soundly: a command
cancelled mid-flight (by the deadline, or by a client that hung up) leaves its connection
half-used in the node's free queue, and a later command on it fails (`'NoneType' object has
no attribute 'writelines'` in `_send_packed_command`, cf. redis/redis-py#3546) or reads the
cancelled command's answer. So on a Cluster the command is shielded: the caller still gets
its `TimeoutError` (or `CancelledError`) on time, while the command itself runs on in the
background until it answers or its own socket timeout ends it, and the client's own retry
and topology refresh are never interrupted half-way. The caller must treat a timeout as "may
have run", as it already does.

One more race of that client is not ours to prevent: after a node error it disconnects the
node's idle connections while other commands may already be using them, which surfaces in
those commands as an `AttributeError` on the cleared reader or writer (redis/redis-py#3546;
redis-py#4288 makes it the `ConnectionError` it is, in a release after 8.1). `bounded` raises
it as that `ConnectionError`: a lost connection, whose command may or may not have run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

T = TypeVar("T")

# Shielded commands still running after their caller stopped waiting: held here, since the
# event loop keeps only weak references to tasks.
_outliving: set[asyncio.Future[Any]] = set()


def is_cluster(client: aioredis.Redis | aioredis.RedisCluster) -> bool:
    return isinstance(client, aioredis.RedisCluster)


async def bounded(command: Awaitable[T], timeout_s: float, *, shield: bool) -> T:
    """`command`'s answer within `timeout_s` seconds, else `TimeoutError`. With `shield`, a
    deadline or a cancellation never cancels the command itself (see the module docstring)."""
    if not shield:
        return await asyncio.wait_for(command, timeout_s)
    task = asyncio.ensure_future(command)
    _outliving.add(task)
    task.add_done_callback(_forget)
    try:
        return await asyncio.wait_for(asyncio.shield(task), timeout_s)
    except AttributeError as error:
        # Only redis-py runs in `command`: its connection was cleared under it (see above).
        raise RedisConnectionError(f"connection closed under the command ({error})") from error


def _forget(task: asyncio.Future[Any]) -> None:
    _outliving.discard(task)
    if not task.cancelled():
        # Retrieved, so that an error nobody waited for is not logged as never retrieved:
        # the caller that stopped waiting has already handled the timeout.
        task.exception()
