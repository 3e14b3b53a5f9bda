"""The gateway and the control plane with REDIS_CLUSTER on, against a local 3-master Redis
Cluster: the clients are cluster clients, and a request streamed with the `openai` client is
admitted, served and settled there, while the routing table follows its pub/sub updates."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from redis.asyncio import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

from config.gateway import build_gateway
from config.redis import redis_client
from metering.usage import USAGE_STREAM, UsageEvent
from serving.gateway.routing import RoutingCache
from tenants.limiter import month_of, tenant_tag
from tests.gateway.conftest import (
    MODEL,
    Fleet,
    GatewayServer,
    TenantKey,
    free_port,
    publish_catalog,
    wait_until,
)
from tests.redis_cluster import LocalRedisCluster

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster_gateway(
    redis_cluster: LocalRedisCluster, transactional_db: None
) -> Iterator[GatewayServer]:
    server = GatewayServer(free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def cluster_fleet(redis_cluster: LocalRedisCluster) -> Iterator[Fleet]:
    # The control plane's own client: with REDIS_CLUSTER on, a cluster client.
    fleet = Fleet(redis_client())
    yield fleet
    fleet.stop()


def test_the_control_planes_client_is_a_cluster_client_with_one_retry(
    redis_cluster: LocalRedisCluster,
) -> None:
    client = redis_client(worker=True)
    assert isinstance(client, RedisCluster)
    assert client.retry.get_retries() == 1
    client.set("{probe}:a", "1")
    assert client.get("{probe}:a") == b"1"


def test_the_gateways_client_is_a_cluster_client_with_the_short_timeouts(
    redis_cluster: LocalRedisCluster, settings: Any
) -> None:
    gateway = build_gateway()
    assert isinstance(gateway.redis, AsyncRedisCluster)
    assert gateway.redis.retry.get_retries() == 1
    node = gateway.redis.get_default_node() or gateway.redis.startup_nodes[0]
    assert node.connection_kwargs["socket_timeout"] == settings.REDIS_SOCKET_TIMEOUT_S
    assert node.connection_kwargs["socket_connect_timeout"] == settings.REDIS_SOCKET_TIMEOUT_S
    asyncio.run(gateway.redis.aclose())
    gateway.spool.release()


def test_a_request_streamed_through_the_gateway_on_a_cluster_is_admitted_served_and_settled(
    cluster_gateway: GatewayServer,
    cluster_fleet: Fleet,
    make_key,
    redis_cluster: LocalRedisCluster,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The table is reloaded only on a routing:updates message: no poll would hide a lost one.
    async def telemetry_only(self: RoutingCache) -> None:
        while True:
            await asyncio.sleep(self.telemetry_interval_s)
            await self.refresh_telemetry()

    monkeypatch.setattr(RoutingCache, "_poll", telemetry_only)
    cluster = redis_client()
    cluster_fleet.start()
    cluster_fleet.publish()
    publish_catalog(cluster)
    key: TenantKey = make_key("acme")
    api = openai.OpenAI(base_url=f"{cluster_gateway.url}/v1", api_key=key.secret, max_retries=0)

    stream = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello, cluster"}], stream=True
    )
    streamed = [c for c in stream if c.choices and c.choices[0].delta.content]
    assert streamed, "no tokens streamed"

    assert isinstance(cluster_gateway.gateway().redis, AsyncRedisCluster)
    assert wait_until(lambda: cluster.xlen(USAGE_STREAM) == 1)
    entries = cluster.xrange(USAGE_STREAM)
    assert entries is not None
    [(_, fields)] = entries
    assert fields is not None
    event = UsageEvent.from_json(fields[b"e"])
    assert (event.status, event.tenant_id) == ("ok", key.tenant.pk)
    assert event.completion_tokens == len(streamed)
    tag = tenant_tag(key.tenant.pk)
    tokens = event.prompt_tokens + event.completion_tokens
    # Settled: the reservation's unused tokens are refunded, its lease released.
    assert int(cluster.hget(f"{tag}:tpm:w", "s") or 0) == tokens
    assert cluster.zcard(f"{tag}:streams") == 0
    assert cluster.get(f"{tag}:req:{event.request_id}") == b"settled"
    assert int(cluster.get(f"{tag}:month:{month_of(event.started_at)}:tokens") or 0) == tokens

    routing = cluster_gateway.gateway().routing
    assert routing.snapshot.version == 1
    second = cluster_fleet.start()
    cluster_fleet.publish()
    assert wait_until(lambda: routing.snapshot.version == 2, timeout_s=10)
    assert second.replica_id in routing.snapshot.endpoints
