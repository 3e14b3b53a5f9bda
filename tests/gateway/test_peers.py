"""Gateways count each other through Redis: the router scales its own in-flight counts by
how many deal the traffic (`RouterConfig.gateways`)."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aioredis
from django.conf import settings

from serving.gateway.peers import GATEWAYS_KEY, GatewayPeers
from serving.gateway.service import Gateway, GatewayConfig
from tenants.keys import KeyPrincipal


async def test_gateways_count_each_other_and_one_that_leaves_or_dies_stops_counting(
    redis_client: redis.Redis,
) -> None:
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    try:
        first, second = GatewayPeers(client), GatewayPeers(client)
        assert await first.beat() == 1
        assert await second.beat() == 2
        assert await first.beat() == 2
        await second.leave()
        assert await first.beat() == 1
        # One that stops beating (a killed pod) ages out after alive_s.
        dying = GatewayPeers(client, alive_s=0.3)
        watching = GatewayPeers(client, alive_s=0.3)
        assert await dying.beat() == 2  # with first, younger than 0.3 s
        await asyncio.sleep(0.4)
        assert await watching.beat() == 1  # first and dying are older than 0.3 s now
        assert 0 < redis_client.pttl(GATEWAYS_KEY) <= 900  # a fleet with no gateway leaves no key
    finally:
        await client.aclose()


async def test_the_gateway_routes_with_the_count_of_gateways_alive(
    redis_client: redis.Redis,
) -> None:
    gateway = Gateway(GatewayConfig(redis_url=settings.REDIS_URL), load_principal=no_principal)
    other = GatewayPeers(gateway.redis)
    try:
        await gateway.count_gateways()
        assert gateway.router_config.gateways == 1
        await other.beat()
        await gateway.count_gateways()
        assert gateway.router_config.gateways == 2
        assert gateway.policy().config.gateways == 2  # type: ignore[attr-defined]
        await other.leave()
        await gateway.count_gateways()
        assert gateway.router_config.gateways == 1
    finally:
        await gateway.peers.leave()
        await gateway.redis.aclose()


async def no_principal(secret: str) -> KeyPrincipal | None:
    return None  # no key is looked up here
