"""The admission queue: a request held because nothing meets its SLO goes once capacity shows."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest
import redis

from serving.gateway.service import Gateway
from serving.redis_contracts import ROUTING_TELEMETRY_KEY
from tests.gateway.conftest import (
    MODEL,
    EngineSim,
    Fleet,
    GatewayServer,
    publish_catalog,
    wait_until,
)

pytestmark = pytest.mark.slow


def report_load(client: redis.Redis, sim: EngineSim, *, running: int, waiting: int) -> None:
    """The replica's telemetry as the control plane publishes it (here: as if the requests of
    other gateway processes filled or left it)."""
    row = {
        "running": running,
        "waiting": waiting,
        "kv": 0.95 if waiting else 0.0,
        "scraped_at": time.time(),
    }
    client.hset(ROUTING_TELEMETRY_KEY, sim.replica_id, orjson.dumps(row))


BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def started(
    gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis
) -> tuple[EngineSim, httpx.Client, Gateway]:
    """One replica published, acme's client, and the gateway after a first request started it."""
    sim = fleet.start()
    fleet.publish()
    publish_catalog(redis_client)
    key = make_key("acme")
    http = httpx.Client(
        base_url=gateway_server.url, timeout=30, headers={"Authorization": f"Bearer {key.secret}"}
    )
    assert http.post("/v1/chat/completions", json=BODY).status_code == 200  # gateway started
    return sim, http, gateway_server.gateway()


def test_a_queued_request_goes_when_telemetry_shows_capacity_freed_elsewhere(
    gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis
) -> None:
    sim, http, gateway = started(gateway_server, fleet, make_key, redis_client)
    # Past the queue timeout a waiter gets a 503 whatever happens: keep a failure short.
    gateway.config = dataclasses.replace(gateway.config, queue_timeout_s=10.0)

    # Another gateway's requests fill the replica: nothing meets the SLO, so the next waits.
    report_load(redis_client, sim, running=256, waiting=2000)
    replica = gateway.routing.snapshot.state.replica(sim.replica_id)
    assert replica is not None
    assert wait_until(lambda: replica.waiting == 2000)
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(http.post, "/v1/chat/completions", json=BODY)
        assert wait_until(lambda: len(gateway.queue) == 1)

        # Those requests finish there, not here: only the telemetry says so.
        report_load(redis_client, sim, running=0, waiting=0)
        freed_at = time.monotonic()
        reply = queued.result(timeout=15)
    assert reply.status_code == 200, reply.text
    # Released at a telemetry refresh (every second), not at the queue timeout.
    assert time.monotonic() - freed_at < 4
    assert len(gateway.queue) == 0
    http.close()


def test_a_standard_request_waits_out_a_queue_interactive_cannot_bear_then_goes(
    gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis
) -> None:
    """Telemetry shows about 1.3 s of prompts queued on the only replica: past half of
    interactive's 1 s TTFT, so a standard request (no x-priority header) is held at the
    gateway (`RouterConfig.defer_looser_after`) while an interactive one goes at once. The
    queue stays, so the standard request goes when it has been held its tier's deferral
    (`RouterConfig.deferral_s`: half of its 3 s objective), at the next telemetry refresh."""
    sim, http, gateway = started(gateway_server, fleet, make_key, redis_client)
    assert gateway.router_config.deferral_s("standard") == 0.0  # off unless configured
    gateway.configure_router(dataclasses.replace(gateway.router_config, defer_looser_after=0.5))
    deferral_s = gateway.router_config.deferral_s("standard")
    assert deferral_s == 1.5

    def queued_prompts() -> None:  # refreshed, so the telemetry never goes stale
        row = {"running": 0, "waiting": 100, "kv": 0.0, "scraped_at": time.time()}
        redis_client.hset(ROUTING_TELEMETRY_KEY, sim.replica_id, orjson.dumps(row))

    queued_prompts()
    replica = gateway.routing.snapshot.state.replica(sim.replica_id)
    assert replica is not None
    assert wait_until(lambda: replica.waiting == 100)
    interactive = http.post(
        "/v1/chat/completions", json=BODY, headers={"x-priority": "interactive"}
    )
    assert interactive.status_code == 200 and len(gateway.queue) == 0
    with ThreadPoolExecutor(1) as pool:
        sent_at = time.monotonic()
        standard = pool.submit(http.post, "/v1/chat/completions", json=BODY)
        assert wait_until(lambda: len(gateway.queue) == 1)
        while not standard.done() and time.monotonic() - sent_at < 10:
            queued_prompts()
            time.sleep(0.2)
        reply = standard.result(timeout=10)
    took = time.monotonic() - sent_at
    assert reply.status_code == 200, reply.text
    assert deferral_s <= took < deferral_s + 3.0  # a refresh a second, and some slack
    assert len(gateway.queue) == 0
    http.close()
