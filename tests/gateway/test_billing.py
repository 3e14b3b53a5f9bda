"""Usage reaches billing exactly as delivered, through the real stream and ingest."""

from __future__ import annotations

import re
import socket
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import openai
import orjson
import pytest
import redis

from metering.ingest import Consumer
from metering.models import PriceSheet, UsageEvent
from metering.prices import publish_price_book
from metering.pricing import charge_usd_micros
from tenants.limiter import month_spend_key
from tests.gateway.conftest import MODEL, Fleet, GatewayServer, publish_catalog, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def priced(gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis):
    PriceSheet.objects.create(
        model=MODEL,
        input_usd_per_mtok=Decimal("0.20"),
        cached_input_usd_per_mtok=Decimal("0.05"),
        output_usd_per_mtok=Decimal("0.60"),
        effective_from=datetime.now(UTC) - timedelta(days=1),
    )
    book = publish_price_book(redis_client)
    publish_catalog(redis_client)
    return gateway_server, fleet, make_key, redis_client, book


def ingest_all(client: redis.Redis, expected: int) -> list[UsageEvent]:
    consumer = Consumer(client, "test-consumer")
    assert wait_until(lambda: client.xlen("usage:events") >= expected)
    consumer.drain(max_seconds=5)
    return list(UsageEvent.objects.order_by("started_at"))


def expected_charge(book, event: UsageEvent) -> int:
    price = book.price_for(
        MODEL, None, event.priority, event.tenant_id, event.started_at.timestamp()
    )
    return charge_usd_micros(
        price, event.prompt_tokens, event.cached_prompt_tokens, event.completion_tokens
    )


def test_a_stream_cut_by_a_dying_replica_is_billed_for_the_tokens_delivered(priced) -> None:
    server, fleet, make_key, client, book = priced
    fleet.start(extra=("--sim-crash-after-tokens", "7"), time_scale=5)
    fleet.publish()
    key = make_key("acme")
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key.secret, max_retries=0)
    delivered = 0
    with pytest.raises(openai.APIError):
        for chunk in api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a long answer please"}],
            max_tokens=100,
            stream=True,
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                delivered += 1
    [event] = ingest_all(client, 1)
    assert event.status == "upstream_failed"
    assert event.completion_tokens == delivered > 0
    assert event.price_charged_usd_micros == expected_charge(book, event) > 0


def test_a_stream_the_engine_fails_mid_generation_is_billed_for_the_tokens_delivered(
    priced,
) -> None:
    server, fleet, make_key, client, book = priced
    fleet.start(extra=("--sim-error-after-tokens", "6"), time_scale=5)
    fleet.publish()
    key = make_key("acme")
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key.secret, max_retries=0)
    delivered = 0
    with pytest.raises(openai.APIError, match="simulated engine failure after 6 tokens"):
        for chunk in api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a long answer please"}],
            max_tokens=100,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                delivered += 1
    [event] = ingest_all(client, 1)
    assert event.status == "upstream_failed"
    assert event.completion_tokens == delivered == 6
    assert event.price_charged_usd_micros == expected_charge(book, event) > 0


def test_a_stream_cut_by_the_client_is_billed_for_the_tokens_delivered(priced) -> None:
    server, fleet, make_key, client, book = priced
    fleet.start(time_scale=1)
    fleet.publish()
    key = make_key("acme")
    body = orjson.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": 3000,
            "messages": [{"role": "user", "content": "go on"}],
        }
    )
    raw = socket.create_connection(("127.0.0.1", server.port))
    raw.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer "
        + key.secret.encode()
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    received = b""
    while len(re.findall(rb'"content":"[^"]', received)) < 5:
        received += raw.recv(65536)
    raw.close()
    seen = len(re.findall(rb'"content":"[^"]', received))
    [event] = ingest_all(client, 1)
    assert event.status == "client_cancelled"
    # At least what this client saw; the gateway may have relayed a few more before it
    # noticed the close. Never the 3000 asked for.
    assert seen <= event.completion_tokens < 3000
    assert event.price_charged_usd_micros == expected_charge(book, event) > 0


def test_a_spent_hard_budget_is_refused_with_insufficient_quota(priced) -> None:
    server, fleet, make_key, client, _ = priced
    fleet.start()
    fleet.publish()
    key = make_key("acme", monthly_spend_budget_usd=Decimal("0.01"), hard_budget=True)
    # acme's own price: 20 output tokens cost more than its whole budget of one cent.
    PriceSheet.objects.create(
        model=MODEL,
        tenant=key.tenant,
        input_usd_per_mtok=Decimal("1"),
        cached_input_usd_per_mtok=Decimal("1"),
        output_usd_per_mtok=Decimal("1000"),
        effective_from=datetime.now(UTC) - timedelta(hours=1),
    )
    publish_price_book(client)
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key.secret, max_retries=0)
    api.models.list()  # starts the gateway, which then refreshes the price book
    assert wait_until(
        lambda: (
            server.gateway()
            .price_book.price_for(
                MODEL, None, "standard", key.tenant.pk, datetime.now(UTC).timestamp()
            )
            .output_micros_per_m
            == 1_000_000_000
        )
    )
    api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=20
    )
    # The settle that adds its spend follows the response (it never delays the client's
    # end of stream): the budget refuses what arrives after it.
    spend = month_spend_key(key.tenant.pk, datetime.now(UTC).strftime("%Y-%m"))
    assert wait_until(lambda: int(client.get(spend) or 0) > 0)
    with pytest.raises(openai.RateLimitError) as raised:
        api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=20
        )
    assert raised.value.code == "insufficient_quota"


@pytest.mark.parametrize(
    "failure", ["--sim-crash-after-tokens", "--sim-error-after-tokens"], ids=["crash", "error"]
)
def test_a_non_streamed_request_the_replica_fails_midway_bills_only_its_prompt(
    priced, failure: str
) -> None:
    # The client gets a 502 and none of the tokens generated before the failure: none of them
    # is billed. The prompt the engine read is, as for a stream cut before its first token.
    server, fleet, make_key, client, book = priced
    fleet.start(extra=(failure, "7"), time_scale=5)
    fleet.publish()
    key = make_key("acme")
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key.secret, max_retries=0)
    with pytest.raises(openai.APIStatusError) as raised:
        api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a long answer please"}],
            max_tokens=100,
        )
    assert raised.value.status_code == 502
    [event] = ingest_all(client, 1)
    assert (event.status, event.completion_tokens) == ("upstream_failed", 0)
    assert event.prompt_tokens > 0
    assert event.price_charged_usd_micros == expected_charge(book, event) > 0
