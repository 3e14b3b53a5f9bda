"""The gateway when its Redis is slow or away: what an admission took is given back, and a
model is not called unknown before the gateway could read what is known."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import httpx
import pytest
import redis
from django.conf import settings as django_settings

from metering.usage import UsageEvent
from serving.redis_contracts import ROUTING_TABLE_KEY
from tenants.limiter import (
    ADMIT_SCRIPT,
    month_of,
    month_tokens_key,
    request_state_key,
    tenant_tag,
)
from tests.gateway.conftest import MODEL, Fleet, GatewayServer, publish_catalog, wait_until
from tests.gateway.redis_proxy import RedisProxy
from tests.metering.helpers import stream_events

pytestmark = pytest.mark.slow


@pytest.fixture
def proxy(redis_client: redis.Redis) -> Iterator[RedisProxy]:
    running = RedisProxy(django_settings.REDIS_URL).start()
    yield running
    running.stop()


@pytest.fixture
def setup(
    settings,
    proxy: RedisProxy,
    gateway_server: GatewayServer,
    fleet: Fleet,
    make_key,
    redis_client: redis.Redis,
):
    # The gateway starts on its first request, and talks to Redis through the proxy.
    settings.REDIS_URL = proxy.url
    publish_catalog(redis_client)
    fleet.start()
    fleet.publish()
    key = make_key("acme", concurrent_streams=1)
    return gateway_server, proxy, key, redis_client


def stream(base: str, secret: str, max_tokens: int = 3) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/chat/completions",
        json={
            "model": MODEL,
            "stream": True,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello there"}],
        },
        headers={"Authorization": f"Bearer {secret}"},
        timeout=30,
    )


def events(client: redis.Redis) -> dict[str, UsageEvent]:
    return {event.request_id: event for event in stream_events(client)}


def leases(client: redis.Redis, tenant_id: int) -> int:
    return int(client.zcard(f"{tenant_tag(tenant_id)}:streams"))


def month_tokens(client: redis.Redis, tenant_id: int) -> int:
    return int(client.get(month_tokens_key(tenant_id, month_of(time.time()))) or 0)


def test_an_admission_that_timed_out_after_it_ran_holds_no_slot_for_the_next_stream(
    setup,
) -> None:
    server, proxy, key, client = setup
    assert stream(server.url, key.secret).status_code == 200  # warm: key cached, pool open
    # Its settle follows the last byte: slowing Redis before it lands would spool it.
    assert wait_until(lambda: len(events(client)) == 1)
    tenant_id = key.tenant.pk
    before = month_tokens(client, tenant_id)

    # Redis runs the admission script at once; its answer comes after the gateway's timeout.
    proxy.slow_for = hashlib.sha1(ADMIT_SCRIPT.encode()).hexdigest().encode()
    proxy.delay_s = 1.0
    refused = stream(server.url, key.secret, max_tokens=50)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "limiter_unavailable"
    proxy.delay_s = 0.0

    # The release went out at once and gave back what the admission took.
    state = request_state_key(tenant_id, refused.headers["x-request-id"])
    assert wait_until(lambda: client.get(state) == b"settled")  # 'cancelled': it never ran
    assert leases(client, tenant_id) == 0
    assert month_tokens(client, tenant_id) == before
    # The tenant's one stream slot is free: its next stream is served.
    assert stream(server.url, key.secret).status_code == 200


def test_after_redis_restarts_no_request_fails_on_a_connection_it_had_pooled(setup) -> None:
    server, proxy, key, client = setup
    for _ in range(4):  # a few pooled connections, each used and idle
        assert stream(server.url, key.secret).status_code == 200
    # Each settle follows its stream's last byte: the restart comes after the last of them,
    # or that one is spooled and holds the tenant's stream slot until it is replayed.
    assert wait_until(lambda: len(events(client)) == 4)
    # Redis restarts: every connection the gateway holds is closed by the server side.
    proxy.go_down()
    proxy.come_back()
    answers = [stream(server.url, key.secret).status_code for _ in range(6)]
    assert answers == [200] * 6
    # The settle (and its usage event) goes out just after the stream's last byte.
    assert wait_until(lambda: len(events(client)) == 10)


def test_a_settle_during_a_redis_outage_is_applied_when_redis_is_back(
    settings,
    tmp_path,
    proxy: RedisProxy,
    gateway_server: GatewayServer,
    fleet: Fleet,
    make_key,
    redis_client: redis.Redis,
) -> None:
    settings.REDIS_URL = proxy.url
    settings.GATEWAY_SPOOL_PATH = str(tmp_path / "usage-spool.jsonl")
    publish_catalog(redis_client)
    fleet.start("L4-24GB", time_scale=1)  # ~76 ms a token: the stream outlasts the outage's start
    fleet.publish()
    key = make_key("acme", concurrent_streams=1)
    server, client, tenant_id = gateway_server, redis_client, key.tenant.pk
    assert stream(server.url, key.secret).status_code == 200
    before = month_tokens(client, tenant_id)

    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "stream": True,
            "max_tokens": 30,
            "messages": [{"role": "user", "content": "tell me a story"}],
        },
        headers={"Authorization": f"Bearer {key.secret}"},
        timeout=30,
    ) as reply:
        request_id = reply.headers["x-request-id"]
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        proxy.go_down()  # Redis goes away mid-stream: the settle at the end cannot reach it
        body = "\n".join(lines)
    assert body.rstrip().endswith("data: [DONE]")
    assert wait_until(lambda: server.gateway().limiter.deferred == 1)
    assert leases(client, tenant_id) == 1  # still held: the settle is waiting

    proxy.come_back()
    # Retried within a refresh or two: the slot is released and the unused tokens refunded.
    assert wait_until(lambda: leases(client, tenant_id) == 0)
    assert wait_until(lambda: request_id in events(client))  # the spooled event, replayed
    event = events(client)[request_id]
    used = event.prompt_tokens + event.completion_tokens
    assert month_tokens(client, tenant_id) == before + used
    assert stream(server.url, key.secret).status_code == 200


def test_a_model_is_a_503_to_retry_not_a_404_until_the_routing_table_was_first_read(
    settings,
    proxy: RedisProxy,
    gateway_server: GatewayServer,
    fleet: Fleet,
    make_key,
    redis_client: redis.Redis,
) -> None:
    settings.REDIS_URL = proxy.url
    publish_catalog(redis_client)
    fleet.start()
    fleet.publish()
    key = make_key("acme")
    server = gateway_server
    proxy.go_down()  # the gateway starts (on the first request) while Redis is unreachable

    refused = stream(server.url, key.secret)
    assert refused.status_code == 503, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert error["code"] == "routing_not_loaded"
    assert error["type"] == "service_unavailable_error"
    listing = httpx.get(
        f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key.secret}"}, timeout=30
    )
    assert listing.status_code == 503  # not an empty list
    assert not server.gateway().routing.loaded.is_set()

    proxy.come_back()
    # The background refresh reads the table and the catalog within a second or two.
    assert wait_until(lambda: stream(server.url, key.secret).status_code == 200, timeout_s=15)
    unknown = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
        headers={"Authorization": f"Bearer {key.secret}"},
        timeout=30,
    )
    assert unknown.status_code == 404  # once loaded, an unknown model is what it is
    assert unknown.json()["error"]["code"] == "model_not_found"


def test_a_served_model_is_a_503_not_model_not_deployed_while_the_routing_table_is_unread(
    settings,
    proxy: RedisProxy,
    gateway_server: GatewayServer,
    fleet: Fleet,
    make_key,
    redis_client: redis.Redis,
) -> None:
    settings.REDIS_URL = proxy.url
    publish_catalog(redis_client)
    fleet.start()
    fleet.publish()
    key = make_key("acme")
    server = gateway_server
    # Redis answers, but its answer to the routing table's read comes too late: the catalog
    # loads, the routing table does not.
    proxy.slow_for = ROUTING_TABLE_KEY.encode()
    proxy.delay_s = 1.0

    refused = stream(server.url, key.secret)
    assert server.gateway().catalog.loaded
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "routing_not_loaded"
    assert not server.gateway().routing.loaded.is_set()

    proxy.delay_s = 0.0
    assert wait_until(lambda: stream(server.url, key.secret).status_code == 200, timeout_s=15)


def test_a_key_revoked_while_redis_was_down_is_refused_soon_after_redis_is_back(
    setup, caplog
) -> None:
    from tenants.actions import do_revoke_api_key
    from tenants.keys import hash_key, key_record_name, principal_from_record

    server, proxy, key, client = setup
    assert stream(server.url, key.secret).status_code == 200  # warm: the key is cached

    proxy.go_down()
    do_revoke_api_key(key.key, None)  # PostgreSQL has it; the write to Redis fails
    assert "Could not write 1 API key records to Redis" in caplog.text
    record = key_record_name(hash_key(key.secret))
    assert principal_from_record(client.get(record), hash_key(key.secret)) is not None
    proxy.come_back()

    # Seconds, not the periodic republish's 300 s. The first refusal may come from PostgreSQL
    # while the gateway's Redis connections are still being remade; the key must stay refused
    # once its answer is read from Redis again (past the 5 s in-process cache): the gateway
    # rechecked it in PostgreSQL after resubscribing and corrected the record for everyone.
    assert wait_until(lambda: stream(server.url, key.secret).status_code == 401, timeout_s=15)
    time.sleep(5.5)  # the gateway's KeyAuthenticator caches an answer for 5 s
    assert stream(server.url, key.secret).status_code == 401
    assert principal_from_record(client.get(record), hash_key(key.secret)) is None
