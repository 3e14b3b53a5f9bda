"""The control plane's synchronous Redis client: one factory, one pool per timeout.

Two timeouts, both declared in settings: `REDIS_SOCKET_TIMEOUT_S` (default) for everything on
or near a request's path, so a dead Redis fails fast; `REDIS_WORKER_TIMEOUT_S` for background
work (publishing tables, invoices, ingest) that would rather wait a little than fail.
With `REDIS_CLUSTER` the client is a `RedisCluster` that finds every node from the one
`REDIS_URL` names (Celery, Channels and Django's cache stay on that URL as a plain Redis).
The gateway's asyncio client is its own (serving/gateway/service.py): the same process may
hold both, but an event loop must not share a pool with threads.
"""

from __future__ import annotations

from functools import cache
from typing import cast

import redis
from django.conf import settings
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry


@cache
def _client(url: str, timeout_s: float, cluster: bool) -> redis.Redis:
    # A pooled connection to a Redis that restarted fails on first use: once more, on a new
    # connection. Timeouts are not retried: the command may have run.
    retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
    if cluster:
        # Typed as the plain client its callers take: `RedisCluster` has the same command
        # methods (it is not a subclass), and every key a script or MULTI touches together
        # shares a hash tag (serving/redis_contracts.py).
        return cast(
            redis.Redis,
            RedisCluster.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=retry
            ),
        )
    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=retry
    )


def redis_client(*, worker: bool = False) -> redis.Redis:
    """The shared client for this process (connections pooled, thread-safe)."""
    timeout = settings.REDIS_WORKER_TIMEOUT_S if worker else settings.REDIS_SOCKET_TIMEOUT_S
    return _client(settings.REDIS_URL, float(timeout), settings.REDIS_CLUSTER)


def get_many(client: redis.Redis, keys: list[str]) -> list[bytes | None]:
    """GET of each key in one round trip. Not MGET: on a Redis Cluster an MGET of keys in
    different slots is refused (CROSSSLOT), while a pipeline is split by node."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    values: list[bytes | None] = pipe.execute()
    return values
