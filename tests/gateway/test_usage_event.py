"""Where a settled request's usage event says it ran, and where least load would have sent it
(the baseline metering prices the request's work at too)."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest
import redis

from serving.redis_contracts import ROUTING_TELEMETRY_KEY
from tests.gateway.conftest import MODEL, Fleet, GatewayServer, publish_catalog, wait_until
from tests.metering.helpers import stream_events

pytestmark = pytest.mark.slow


def test_the_usage_event_names_the_replica_least_load_would_have_chosen(
    gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis
) -> None:
    publish_catalog(redis_client)
    dear = fleet.start("H100-SXM-80GB", pool="h100", price_per_hour=3.49)
    cheap = fleet.start("L40S-48GB", pool="l40s", price_per_hour=0.99)
    fleet.publish()
    key = make_key("acme")
    http = httpx.Client(
        base_url=gateway_server.url, headers={"Authorization": f"Bearer {key.secret}"}, timeout=30
    )
    assert http.get("/v1/models").status_code == 200  # the gateway is up, nothing settled
    # The cheap replica is a little busier: cost-aware still sends the request there, least
    # load would have sent it to the idle dear one.
    busy = {"running": 3, "waiting": 0, "kv": 0.1, "scraped_at": time.time()}
    redis_client.hset(ROUTING_TELEMETRY_KEY, cheap.replica_id, orjson.dumps(busy))
    routing = gateway_server.gateway().routing
    assert wait_until(
        lambda: getattr(routing.snapshot.state.replica(cheap.replica_id), "running", 0) == 3
    )

    reply = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    http.close()

    assert reply.status_code == 200, reply.text
    assert wait_until(lambda: len(stream_events(redis_client)) == 1)
    [event] = stream_events(redis_client)
    assert (event.replica_id, event.pool) == (cheap.replica_id, "l40s")
    assert (event.baseline_replica_id, event.baseline_pool) == (dear.replica_id, "h100")
