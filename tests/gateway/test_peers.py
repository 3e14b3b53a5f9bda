"""Gateways count each other through Redis: the router scales its own in-flight counts by
how many deal the traffic (`RouterConfig.gateways`)."""

from __future__ import annotations

import asyncio
import uuid

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
    key = own_key()
    try:
        first, second = GatewayPeers(client, key=key), GatewayPeers(client, key=key)
        assert await first.beat() == 1
        assert await second.beat() == 2
        assert await first.beat() == 2
        await second.leave()
        assert await first.beat() == 1
        # One that stops beating (a killed pod) ages out after alive_s.
        dying = GatewayPeers(client, key=key, alive_s=0.3)
        watching = GatewayPeers(client, key=key, alive_s=0.3)
        assert await dying.beat() == 2  # with first, younger than 0.3 s
        await asyncio.sleep(0.4)
        assert await watching.beat() == 1  # first and dying are older than 0.3 s now
        assert 0 < redis_client.pttl(key) <= 900  # a fleet with no gateway leaves no key
    finally:
        await client.aclose()


async def test_the_gateway_routes_with_the_count_of_gateways_alive(
    redis_client: redis.Redis,
) -> None:
    gateway = Gateway(GatewayConfig(redis_url=settings.REDIS_URL), load_principal=no_principal)
    gateway.peers = GatewayPeers(gateway.redis, key=own_key())
    other = GatewayPeers(gateway.redis, key=gateway.peers.key)
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


def own_key() -> str:
    """A key of this test's own: a gateway still running in this process (a live server left
    by an earlier test) beats into GATEWAYS_KEY and would count here."""
    return f"{GATEWAYS_KEY}:test:{uuid.uuid4().hex}"


async def no_principal(secret: str) -> KeyPrincipal | None:
    return None  # no key is looked up here
