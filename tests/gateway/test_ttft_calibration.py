"""The gateway feeds the router's TTFT calibration: at a request's first token it holds what
the replica did against what the decision predicted (`RouterState.observe_ttft`)."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest
import redis

from serving.redis_contracts import ROUTING_TELEMETRY_KEY
from serving.router import RouterConfig
from tests.gateway.conftest import MODEL, Fleet, GatewayServer, publish_catalog, wait_until

pytestmark = pytest.mark.slow


def test_a_first_token_sooner_than_predicted_moves_the_replicas_ttft_scale_down(
    gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis
) -> None:
    publish_catalog(redis_client)
    sim = fleet.start("L40S-48GB", pool="l40s", price_per_hour=0.99)
    fleet.publish()
    key = make_key("acme")
    http = httpx.Client(
        base_url=gateway_server.url, headers={"Authorization": f"Bearer {key.secret}"}, timeout=30
    )
    assert http.get("/v1/models").status_code == 200
    # The telemetry says 40 requests queue there; the engine is in fact idle, so the first
    # token comes far sooner than the prediction.
    queued = {"running": 0, "waiting": 40, "kv": 0.1, "scraped_at": time.time()}
    redis_client.hset(ROUTING_TELEMETRY_KEY, sim.replica_id, orjson.dumps(queued))
    routing = gateway_server.gateway().routing
    assert wait_until(
        lambda: getattr(routing.snapshot.state.replica(sim.replica_id), "waiting", 0) == 40
    )
    replica = routing.snapshot.state.replica(sim.replica_id)
    assert replica is not None and replica.ttft_scale == 1.0

    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
        },
    ) as reply:
        assert reply.status_code == 200
        body = reply.read().decode()
    http.close()
    assert "[DONE]" in body

    config = RouterConfig()
    assert config.ttft_quantile is not None
    # One step of the quantile, below: observed under the prediction.
    below = 1.0 + config.ttft_quantile_step * (config.ttft_quantile - 1.0)
    learned = routing.snapshot.state.replica(sim.replica_id)
    assert learned is not None and learned.ttft_scale == pytest.approx(below)
