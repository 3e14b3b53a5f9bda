"""A disaggregated deployment through the gateway, against engine simulators: the prefill on
one replica (one token, the KV kept for a remote decode), the decode streamed from another
with the parameters the prefill returned, and each phase's faults."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import orjson
import pytest
import redis

from tests.gateway.conftest import (
    MODEL,
    EngineSim,
    Fleet,
    GatewayServer,
    publish_catalog,
    sample,
    wait_until,
)
from tests.metering.helpers import stream_events

pytestmark = pytest.mark.slow

NIXL = ("--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}')
LINK = "infiniband-ndr-400"
# Long enough for whole KV blocks to hand over, short enough for a fast simulator.
PROMPT = " ".join(f"Clause {i} of the contract restates the one before it." for i in range(40))


def prefill(fleet: Fleet, *, price: float = 3.49, extra: tuple[str, ...] = ()) -> EngineSim:
    return fleet.start(
        pool="h100-prefill", price_per_hour=price, extra=(*NIXL, *extra), phase="prefill",
        kv_link=LINK,
    )  # fmt: skip


def decode(fleet: Fleet, *, price: float = 3.49, extra: tuple[str, ...] = ()) -> EngineSim:
    return fleet.start(
        pool="h100-decode", price_per_hour=price, extra=(*NIXL, *extra), phase="decode",
        kv_link=LINK,
    )  # fmt: skip


@pytest.fixture
def setup(gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis):
    publish_catalog(redis_client)
    return gateway_server, fleet, make_key("acme"), redis_client


def chat(server: GatewayServer, secret: str, **body) -> httpx.Response:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5}
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        json={**payload, **body},
        headers={"Authorization": f"Bearer {secret}"},
        timeout=30,
    )


def generated(sim: EngineSim) -> float:
    return sample(sim.metrics_text(), "vllm:generation_tokens_total")


def test_the_openai_client_streams_the_decode_of_a_prompt_prefilled_elsewhere(setup) -> None:
    server, fleet, key, client = setup
    first, second = prefill(fleet), decode(fleet)
    fleet.publish()
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key.secret, max_retries=0)

    stream = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 8
    # The prefill replica generated the one token it was asked for; the decode replica
    # streamed every token the client got, and loaded the prompt's KV from the prefill.
    assert generated(first) == 1
    assert generated(second) == 8
    handed = sample(
        second.metrics_text(), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    assert 0 < handed <= usage.prompt_tokens
    assert wait_until(lambda: len(stream_events(client)) == 1)
    [event] = stream_events(client)
    assert (event.prefill_replica_id, event.prefill_pool) == (first.replica_id, "h100-prefill")
    assert (event.replica_id, event.pool) == (second.replica_id, "h100-decode")
    assert (event.status, event.completion_tokens) == ("ok", 8)
    assert event.prompt_tokens == usage.prompt_tokens
    # The decode engine reports the prompt it pulled as cached; the tenant's cached tokens
    # are what the prefill replica's prefix cache held (nothing, the first time).
    assert event.cached_prompt_tokens == 0
    state = server.gateway().routing.snapshot.state
    for sim in (first, second):
        replica = state.replica(sim.replica_id)
        assert replica is not None
        assert (replica.inflight, replica.prefill_pending_tokens) == (0, 0)


def test_a_failed_prefill_is_retried_on_another_prefill_replica(setup) -> None:
    server, fleet, key, client = setup
    # The cheaper prefill replica is chosen first, and fails every request.
    broken = prefill(fleet, price=1.0, extra=("--sim-error-rate", "1.0"))
    healthy = prefill(fleet)
    streaming = decode(fleet)
    fleet.publish()

    reply = chat(server, key.secret)

    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 5
    assert generated(broken) == 0
    assert generated(healthy) == 1
    assert generated(streaming) == 5
    assert wait_until(lambda: len(stream_events(client)) == 1)
    [event] = stream_events(client)
    assert (event.prefill_replica_id, event.replica_id) == (
        healthy.replica_id,
        streaming.replica_id,
    )


def test_a_decode_that_fails_before_its_first_token_runs_again_on_another_replica(setup) -> None:
    server, fleet, key, client = setup
    first = prefill(fleet)
    # The cheaper decode replica is chosen first, and refuses every request.
    broken = decode(
        fleet, price=1.0, extra=("--sim-error-rate", "1.0", "--sim-error-status", "503")
    )
    healthy = decode(fleet)
    fleet.publish()

    reply = chat(server, key.secret)

    assert reply.status_code == 200, reply.text
    assert generated(healthy) == 5
    assert generated(broken) == 0
    # The request ran again from its prefill (on the same replica: the only one).
    assert generated(first) == 2
    assert wait_until(lambda: len(stream_events(client)) == 1)
    [event] = stream_events(client)
    assert (event.prefill_replica_id, event.replica_id) == (first.replica_id, healthy.replica_id)


def test_every_prefill_replica_failing_is_a_502_in_openai_shape_and_bills_nothing(setup) -> None:
    server, fleet, key, client = setup
    failing = ("--sim-error-rate", "1.0", "--sim-error-status", "503")
    prefill(fleet, extra=failing)
    prefill(fleet, extra=failing)
    decode(fleet)
    fleet.publish()

    reply = chat(server, key.secret)

    assert reply.status_code == 502, reply.text
    assert reply.json()["error"]["type"] == "server_error"
    assert wait_until(lambda: len(stream_events(client)) == 1)
    [event] = stream_events(client)
    assert event.status == "upstream_failed"
    assert (event.prompt_tokens, event.completion_tokens) == (0, 0)


def test_a_client_gone_during_the_prefill_aborts_it_and_never_starts_the_decode(setup) -> None:
    server, fleet, key, client = setup
    slow = ("--sim-fixed-ttft-ms", "8000", "--sim-fixed-itl-ms", "10")
    first = prefill(fleet, extra=slow)
    second = decode(fleet)
    fleet.publish()
    started = time.monotonic()

    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": PROMPT}],
                "stream": True,
            },
            headers={"Authorization": f"Bearer {key.secret}"},
            timeout=1.0,
        )

    assert wait_until(lambda: sample(first.metrics_text(), "vllm:num_requests_running") == 0)
    assert time.monotonic() - started < 6  # aborted: its 8 s prefill did not run to its end
    assert sample(first.metrics_text(), "vllm:request_success_total") == 0
    assert sample(second.metrics_text(), "vllm:prompt_tokens_total") == 0
    assert wait_until(lambda: len(stream_events(client)) == 1)
    [event] = stream_events(client)
    assert event.status == "client_cancelled"
    assert event.prefill_replica_id == first.replica_id
    replica = server.gateway().routing.snapshot.state.replica(first.replica_id)
    assert replica is not None
    assert (replica.inflight, replica.prefill_pending_tokens) == (0, 0)


def test_a_client_gone_during_the_decode_aborts_it(setup) -> None:
    server, fleet, key, client = setup
    first = prefill(fleet)
    second = decode(fleet, extra=("--sim-fixed-ttft-ms", "20", "--sim-fixed-itl-ms", "100"))
    fleet.publish()
    body = orjson.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": 500,
            "messages": [{"role": "user", "content": PROMPT}],
        }
    )
    raw = socket.create_connection(("127.0.0.1", server.port))
    raw.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + key.secret.encode() + b"\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    received = b""
    while b"data: " not in received:
        received += raw.recv(4096)
    assert sample(second.metrics_text(), "vllm:num_requests_running") == 1
    raw.close()

    assert wait_until(lambda: sample(second.metrics_text(), "vllm:num_requests_running") == 0)
    assert sample(second.metrics_text(), "vllm:request_success_total") == 0
    assert generated(second) < 500
    assert sample(first.metrics_text(), "vllm:request_success_total") == 1
    assert wait_until(lambda: len(stream_events(client)) == 1)
    [event] = stream_events(client)
    assert event.status == "client_cancelled"
    assert (event.prefill_replica_id, event.replica_id) == (first.replica_id, second.replica_id)


def test_a_short_prompt_goes_to_a_colocated_replica_of_the_same_model(setup) -> None:
    """Where a model has colocated and disaggregated replicas, a short prompt stays colocated:
    the hand-over and the extra decode step cost more than the prefill they spare."""
    server, fleet, key, client = setup
    first, second = prefill(fleet), decode(fleet)
    colocated = fleet.start(pool="h100")
    fleet.publish()

    reply = chat(server, key.secret, messages=[{"role": "user", "content": "hi"}])

    assert reply.status_code == 200, reply.text
    assert generated(colocated) == 5
    assert generated(first) == generated(second) == 0
    assert wait_until(lambda: len(stream_events(client)) == 1)
    [event] = stream_events(client)
    assert (event.replica_id, event.prefill_replica_id) == (colocated.replica_id, "")
