"""An engine that answers 401, 403 or 429 refuses the gateway (a replica started with another
API key, the engine's own rate limit), not the client's request: the request goes to another
replica, the refusing one's breaker counts it, and with no replica left the client gets a 503
to retry, never the engine's 401/403/429 or a 400."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from metering.usage import USAGE_STREAM, UsageEvent
from tests.gateway.conftest import MODEL, Fleet, GatewayServer, publish_catalog, wait_until

pytestmark = pytest.mark.slow

REFUSALS = ("401", "403", "429")


@pytest.fixture
def setup(gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis):
    publish_catalog(redis_client)
    return gateway_server, fleet, make_key("acme"), redis_client


def chat(base: str, secret: str) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {secret}"},
        timeout=30,
    )


def refusing(status: str) -> tuple[str, ...]:
    return ("--sim-error-rate", "1", "--sim-error-status", status)


@pytest.mark.parametrize("status", REFUSALS)
def test_a_replica_refusing_the_gateway_is_skipped_for_another(setup, status: str) -> None:
    server, fleet, key, _ = setup
    refuser = fleet.start(extra=refusing(status))
    fleet.start()
    fleet.publish()
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key.secret, max_retries=0)
    # Which replica serves a request is the router's draw: send until the refusing one was
    # tried (its breaker counted it); every client still gets its answer.
    for _ in range(40):
        reply = api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.choices[0].message.content
        if refuser.replica_id in server.gateway().breakers:
            break
    assert refuser.replica_id in server.gateway().breakers


@pytest.mark.parametrize("status", REFUSALS)
def test_with_every_replica_refusing_the_client_gets_a_503_to_retry(setup, status: str) -> None:
    server, fleet, key, client = setup
    fleet.start(extra=refusing(status))
    fleet.start(extra=refusing(status))
    fleet.publish()
    reply = chat(server.url, key.secret)
    assert reply.status_code == 503
    assert reply.headers["retry-after"] == "2"
    error = reply.json()["error"]
    assert error["code"] == "no_capacity"
    assert error["type"] == "service_unavailable_error"
    assert wait_until(lambda: client.xlen(USAGE_STREAM) == 1)
    [(_, fields)] = client.xrange(USAGE_STREAM)
    event = UsageEvent.from_json(fields[b"e"])
    assert (event.status, event.completion_tokens) == ("upstream_failed", 0)


def test_a_lone_replica_refusing_the_gateway_is_ejected_by_its_breaker(setup) -> None:
    server, fleet, key, _ = setup
    sim = fleet.start(extra=refusing("401"))
    fleet.publish()
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key.secret, max_retries=0)
    with pytest.raises(openai.InternalServerError) as raised:
        api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert raised.value.status_code == 503
    for _ in range(server.gateway().config.breaker_failures - 1):
        assert chat(server.url, key.secret).status_code == 503
    assert server.gateway().breakers[sim.replica_id].blocked_until > time.monotonic()


def slo_and_status_counts(base: str) -> dict[tuple[str, ...], float]:
    found: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for point in family.samples:
            key: tuple[str, ...]
            if point.name == "platform_gateway_slo_requests_total":
                key = ("slo", point.labels["tier"], point.labels["outcome"])
            elif point.name == "platform_gateway_requests_total":
                key = ("status", point.labels["status"])
            else:
                continue
            found[key] = found.get(key, 0.0) + point.value
    return found


def test_a_request_the_engine_refuses_is_the_clients_and_the_slo_does_not_judge_it(
    setup,
) -> None:
    """A 400 is the engine refusing what the client wrote (longer than the context, say):
    the client gets it in OpenAI's shape, the usage event says refused, and neither the SLO
    counter nor the error-rate alert's statuses count it, so one client's bad requests page
    no one; the replica stays in service."""
    server, fleet, key, client = setup
    sim = fleet.start(extra=refusing("400"))
    fleet.publish()
    before = slo_and_status_counts(server.url)
    reply = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {key.secret}", "x-priority": "interactive"},
        timeout=30,
    )
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "invalid_request"
    assert wait_until(lambda: client.xlen(USAGE_STREAM) == 1)
    [(_, fields)] = client.xrange(USAGE_STREAM)
    event = UsageEvent.from_json(fields[b"e"])
    assert (event.status, event.priority, event.slo_outcome) == ("refused", "interactive", None)
    after = slo_and_status_counts(server.url)
    grew = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert grew == {("status", "refused"): 1.0}
    assert sim.replica_id not in server.gateway().breakers
