"""How many gateway processes share the traffic, counted through Redis.

The gateways tell each other of the requests they send (serving/gateway/inflight_sync.py);
what one sent that the others do not know of yet, the router takes once per gateway, as
each of the others, routing on the same view meanwhile, is assumed to have sent as much
(`RouterConfig.gateways`; all of its own while Redis is away). The
number changes as an autoscaler adds and removes gateway pods, so each gateway stamps its
id into one sorted set on every refresh and counts the stamps younger than `alive_s`:
a gateway that died stops counting once its stamp ages out, one that closes leaves at once.
"""

from __future__ import annotations

import time
import uuid

import redis.asyncio as aioredis

GATEWAYS_KEY = "gateway:alive"
ALIVE_S = 10.0  # five of the gateway's 2 s refreshes, so a slow refresh is not a departure


class GatewayPeers:
    def __init__(
        self,
        redis: aioredis.Redis | aioredis.RedisCluster,
        *,
        key: str = GATEWAYS_KEY,
        alive_s: float = ALIVE_S,
    ) -> None:
        self.redis = redis
        self.key = key
        self.alive_s = alive_s
        self.gateway_id = uuid.uuid4().hex

    async def beat(self) -> int:
        """Stamp this gateway alive and return how many are (at least 1: this one)."""
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(self.key, {self.gateway_id: now})
            pipe.zremrangebyscore(self.key, "-inf", now - self.alive_s)
            pipe.zcard(self.key)
            pipe.pexpire(self.key, max(1, int(self.alive_s * 3000)))  # no gateway left: no key
            _, _, count, _ = await pipe.execute()
        return max(1, int(count))

    async def leave(self) -> None:
        await self.redis.zrem(self.key, self.gateway_id)
