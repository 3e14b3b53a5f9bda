"""Process bodies for the multi-process tests. Imported by spawned children, so this module
imports nothing from Django: the children talk to Redis only, as gateway workers do."""

from __future__ import annotations

import asyncio
import random
import time
from multiprocessing.queues import Queue
from typing import Any

import redis.asyncio as aioredis

from tenants.keys import KeyAuthenticator, KeyPrincipal
from tenants.limiter import LimiterUnavailable, RateLimiter


def hammer(
    redis_url: str,
    principals: list[dict[str, Any]],
    seconds: float,
    seed: int,
    results: Queue[dict[str, Any]],
    cluster: bool = False,
) -> None:
    results.put(asyncio.run(_hammer(redis_url, principals, seconds, seed, cluster)))


async def _hammer(
    redis_url: str, principals: list[dict[str, Any]], seconds: float, seed: int, cluster: bool
) -> dict[str, Any]:
    client: aioredis.Redis | aioredis.RedisCluster = (
        aioredis.RedisCluster.from_url(redis_url, socket_timeout=2)
        if cluster
        else aioredis.Redis.from_url(redis_url, socket_timeout=2)
    )
    limiter = RateLimiter(client, timeout_s=2)
    rng = random.Random(seed)
    tenants = [KeyPrincipal.from_dict(p) for p in principals]
    stats = {
        p.tenant_slug: {"admitted": 0, "refused": 0, "unavailable": 0, "used_tokens": 0}
        for p in tenants
    }
    started = time.time()
    deadline = started + seconds
    counter = 0

    async def one_client() -> None:
        nonlocal counter
        while time.time() < deadline:
            principal = tenants[counter % len(tenants)]
            counter += 1
            prompt, max_tokens = rng.randint(20, 300), rng.randint(50, 400)
            row = stats[principal.tenant_slug]
            try:
                admission = await limiter.admit(
                    principal,
                    request_id=f"{seed}-{counter}",
                    prompt_tokens=prompt,
                    max_tokens=max_tokens,
                )
            except LimiterUnavailable:
                # Redis slower than the deadline (a loaded machine): a 503, and the limiter
                # releases whatever the admission may have taken.
                row["unavailable"] += 1
                continue
            if not admission.allowed:
                row["refused"] += 1
                continue
            assert admission.reservation is not None
            completion = rng.randint(0, max_tokens)
            row["admitted"] += 1
            row["used_tokens"] += prompt + completion
            await limiter.settle(
                admission.reservation, prompt_tokens=prompt, completion_tokens=completion
            )
            if counter % 5 == 0:  # a retried settle must change nothing
                await limiter.settle(
                    admission.reservation, prompt_tokens=prompt, completion_tokens=completion
                )

    await asyncio.gather(*(one_client() for _ in range(8)))
    finished = time.time()
    await limiter.close()
    for _ in range(20):  # settles and releases that met a timeout: sent again, as the gateway does
        if not limiter.deferred:
            break
        await limiter.retry_deferred()
        await asyncio.sleep(0.5)
    await client.aclose()
    return {
        "started": started,
        "finished": finished,
        "stats": stats,
        "deferred": limiter.deferred,
    }


async def _database_is_down(raw_key: str) -> KeyPrincipal | None:
    raise ConnectionError("PostgreSQL is down in this process")


def watch_key(
    redis_url: str, raw_key: str, results: Queue[tuple[str, float]], give_up_s: float
) -> None:
    asyncio.run(_watch_key(redis_url, raw_key, results, give_up_s))


async def _watch_key(
    redis_url: str, raw_key: str, results: Queue[tuple[str, float]], give_up_s: float
) -> None:
    """Authenticate the key every 5 ms, as a busy gateway would; report when it is refused."""
    client = aioredis.Redis.from_url(redis_url, socket_timeout=2)
    authenticator = KeyAuthenticator(client, cache_ttl_s=30.0, load_from_database=_database_is_down)
    await authenticator.start()
    if await authenticator.authenticate(raw_key) is None:
        results.put(("never admitted", time.time()))
        return
    results.put(("ready", time.time()))
    deadline = time.time() + give_up_s
    while time.time() < deadline:
        if await authenticator.authenticate(raw_key) is None:
            results.put(("refused", time.time()))
            break
        await asyncio.sleep(0.005)
    else:
        results.put(("still admitted", time.time()))
    await authenticator.close()
    await client.aclose()
