"""Faults on the hot path, against engine simulators with fault injection."""

from __future__ import annotations

import math
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis

from metering.usage import UsageEvent
from serving.gateway.service import Gateway
from serving.router import ReplicaState
from tenants.limiter import tenant_tag
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


def usage_events(client: redis.Redis) -> list[UsageEvent]:
    return stream_events(client)


def chat(base: str, secret: str, **body) -> httpx.Response:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}
    return httpx.post(
        f"{base}/v1/chat/completions",
        json={**payload, **body},
        headers={"Authorization": f"Bearer {secret}"},
        timeout=30,
    )


@pytest.fixture
def setup(gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis):
    publish_catalog(redis_client)
    return gateway_server, fleet, make_key("acme"), redis_client


def test_a_failure_before_the_first_token_is_retried_on_another_replica(setup) -> None:
    server, fleet, key, _ = setup
    broken = fleet.start(extra=("--sim-error-rate", "1.0"))
    healthy = fleet.start()
    fleet.publish()
    for _ in range(6):
        reply = chat(server.url, key.secret, max_tokens=3)
        assert reply.status_code == 200, reply.text
    assert sample(healthy.metrics_text(), "vllm:request_success_total") == 6
    assert sample(broken.metrics_text(), "vllm:request_success_total") == 0


def test_the_circuit_breaker_ejects_a_failing_replica_for_a_growing_time(setup, settings) -> None:
    server, fleet, key, _ = setup
    broken = fleet.start(extra=("--sim-error-rate", "1.0"))
    fleet.start()
    fleet.publish()
    # Which replica serves a request is the router's draw; send until three have failed on
    # the broken one (each retried on the healthy one, so every client sees a 200).
    for _ in range(40):
        assert chat(server.url, key.secret, max_tokens=2).status_code == 200
        breaker = server.gateway().breakers.get(broken.replica_id)
        if breaker is not None and breaker.blocked_until > time.monotonic():
            break
    assert breaker is not None
    first_trip_until = breaker.blocked_until
    assert first_trip_until > time.monotonic(), "the failing replica should be ejected"
    state = server.gateway().routing.snapshot.state
    assert state.replica(broken.replica_id).breaker_open_until == first_trip_until
    # Once its ejection ends, the next failure (the half-open probe) ejects it for longer.
    open_for = first_trip_until - time.monotonic()
    time.sleep(max(0.0, open_for) + 0.1)
    attempts = 0
    while breaker.blocked_until <= time.monotonic() and attempts < 20:
        chat(server.url, key.secret, max_tokens=2)
        attempts += 1
    second_open_for = breaker.blocked_until - time.monotonic()
    assert second_open_for > open_for


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error_and_bills_what_was_delivered(
    setup,
) -> None:
    server, fleet, key, client = setup
    fleet.start(extra=("--sim-crash-after-tokens", "5"), time_scale=5)
    fleet.publish()
    openai_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key.secret, max_retries=0)
    received = 0
    with pytest.raises(openai.APIError) as raised:
        for chunk in openai_client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "long story"}],
            max_tokens=50,
            stream=True,
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
    assert "mid-stream" in str(raised.value)
    assert 1 <= received <= 5
    assert wait_until(lambda: len(usage_events(client)) == 1)
    event = usage_events(client)[0]
    assert event.status == "upstream_failed"
    assert event.completion_tokens == received
    assert event.price_charged_usd_micros >= 0


def test_a_client_that_disconnects_aborts_the_engine_request_and_frees_its_slot(setup) -> None:
    server, fleet, key, client = setup
    sim = fleet.start(time_scale=1)
    fleet.publish()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + key.secret.encode() + b"\r\n"
    )
    body = orjson.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": 2000,
            "messages": [{"role": "user", "content": "tell me everything"}],
        }
    )
    raw = socket.create_connection(("127.0.0.1", server.port))
    raw.sendall(request + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    received = b""
    while b"data: " not in received:
        received += raw.recv(4096)
    assert sample(sim.metrics_text(), "vllm:num_requests_running") == 1
    leases = [k for k in client.keys("rl:*streams*")]
    assert leases and client.zcard(leases[0]) == 1
    raw.close()
    assert wait_until(lambda: sample(sim.metrics_text(), "vllm:num_requests_running") == 0)
    # Aborted, not finished: as vLLM 0.32, no finish of any reason is counted for it.
    assert sample(sim.metrics_text(), "vllm:request_success_total") == 0
    generated = sample(sim.metrics_text(), "vllm:generation_tokens_total")
    assert generated < 2000
    assert wait_until(lambda: client.zcard(leases[0]) == 0)
    assert wait_until(lambda: len(usage_events(client)) == 1)
    event = usage_events(client)[0]
    assert event.status == "client_cancelled"
    assert event.completion_tokens >= 1


def test_a_hung_replica_times_out_and_the_request_goes_elsewhere(setup, settings) -> None:
    settings.GATEWAY_READ_TIMEOUT_S = 1.0
    server, fleet, key, _ = setup
    fleet.start(extra=("--sim-hang",))
    healthy = fleet.start()
    fleet.publish()
    started = time.monotonic()
    replies = [chat(server.url, key.secret, max_tokens=2) for _ in range(3)]
    assert [r.status_code for r in replies] == [200, 200, 200]
    assert sample(healthy.metrics_text(), "vllm:request_success_total") == 3
    assert time.monotonic() - started < 10


def test_every_replica_failing_is_a_502_in_openai_shape(setup) -> None:
    server, fleet, key, client = setup
    fleet.start(extra=("--sim-error-rate", "1.0"))
    fleet.start(extra=("--sim-error-rate", "1.0"))
    fleet.publish()
    reply = chat(server.url, key.secret, max_tokens=2)
    assert reply.status_code == 502
    assert reply.json()["error"]["code"] == "upstream_error"
    assert reply.headers["x-request-id"]
    assert wait_until(lambda: len(usage_events(client)) == 1)
    assert usage_events(client)[0].status == "upstream_failed"


def test_content_that_fails_on_every_replica_ejects_none_of_them(setup, make_key) -> None:
    server, fleet, key, _ = setup
    replicas = [fleet.start(extra=("--sim-error-on-text", "poison")) for _ in range(2)]
    fleet.publish()
    other = make_key("globex")
    for _ in range(6):
        bad = chat(
            server.url, key.secret, max_tokens=2, messages=[{"role": "user", "content": "poison"}]
        )
        assert bad.status_code == 502
        assert "content is the likely cause" in bad.json()["error"]["message"]
    breakers = server.gateway().breakers
    now = time.monotonic()
    assert all(
        breakers.get(r.replica_id) is None or breakers[r.replica_id].blocked_until <= now
        for r in replicas
    ), "one tenant's bad requests must not eject a replica"
    for _ in range(6):
        assert chat(server.url, other.secret, max_tokens=2).status_code == 200


def test_in_flight_accounting_returns_to_zero_after_successes_failures_and_aborts(
    setup, monkeypatch
) -> None:
    server, fleet, key, _ = setup
    fleet.start(extra=("--sim-error-rate", "0.5"))
    fleet.start()
    fleet.publish()
    objectives: list[float | None] = []
    started = Gateway.request_started

    def spy(self: Gateway, *args: Any, **kwargs: Any) -> None:
        objectives.append(kwargs.get("tpot_objective_s"))
        started(self, *args, **kwargs)

    monkeypatch.setattr(Gateway, "request_started", spy)
    for stream in (False, True) * 5:
        assert chat(server.url, key.secret, max_tokens=3, stream=stream).status_code == 200
    gateway = server.gateway()
    # Each request told the router the TPOT objective its decode runs under (its tier's):
    # what later requests must not push the replica past.
    standard = gateway.router_config.tier("standard").tpot_s
    assert len(objectives) >= 10 and set(objectives) == {standard}
    state = gateway.routing.snapshot.state
    for sim in fleet.sims:
        replica = state.replica(sim.replica_id)
        assert replica is not None
        # The client has its last [DONE] before the gateway's generator finishes: wait for it.
        assert wait_until(partial(_settled_on, replica))


def _settled_on(replica: ReplicaState) -> bool:
    counts = (replica.inflight, replica.inflight_prompt_tokens, replica.prefill_pending_tokens)
    objectives = (replica.inflight_tpot_objectives, replica.tightest_tpot_s)
    return counts == (0, 0, 0) and objectives == ({}, math.inf)


def test_a_stream_longer_than_its_lease_renews_it(setup, settings) -> None:
    settings.GATEWAY_STREAM_LEASE_TTL_S = 2
    server, fleet, key, client = setup
    fleet.start("L4-24GB", time_scale=1)  # ~76 ms a token: 60 tokens take ~4.5 s
    fleet.publish()
    scores: list[float] = []

    def watch() -> None:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            for lease in client.keys("rl:*streams*"):
                for _, score in client.zrange(lease, 0, -1, withscores=True):
                    scores.append(score)
            time.sleep(0.2)

    with ThreadPoolExecutor(1) as pool:
        watcher = pool.submit(watch)
        reply = chat(server.url, key.secret, max_tokens=60, stream=True)
        watcher.result()
    assert reply.status_code == 200
    assert scores, "the stream never held a lease"
    # Renewed every TTL/2 = 1 s: the expiry moved on while the stream ran.
    assert max(scores) - min(scores) >= 1.5


def test_a_client_gone_while_connecting_leaves_no_in_flight_count_or_blocked_probe(setup) -> None:
    server, fleet, key, _ = setup
    hung = fleet.start(extra=("--sim-hang",))
    fleet.publish()
    for _ in range(3):  # the client gives up while the replica never answers
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{server.url}/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 2,
                    "stream": True,
                },
                headers={"Authorization": f"Bearer {key.secret}"},
                timeout=0.5,
            )
    state = server.gateway().routing.snapshot.state
    replica = state.replica(hung.replica_id)
    assert wait_until(lambda: replica.inflight == 0 and replica.prefill_pending_tokens == 0)
    gateway_breakers = server.gateway().breakers.get(hung.replica_id)
    assert gateway_breakers is None or gateway_breakers.blocked_until != float("inf")


def headers_then_close_server() -> tuple[int, threading.Event]:
    """A replica that answers 200 with SSE headers, then drops the connection before any
    chunk: as a vLLM whose GPU faults during prefill."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            with connection:
                connection.recv(65536)
                connection.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return int(listener.getsockname()[1]), stop


def test_a_replica_that_dies_before_its_first_token_is_retried_elsewhere(setup) -> None:
    server, fleet, key, _ = setup
    healthy = fleet.start()
    port, stop = headers_then_close_server()
    placeholder = subprocess.Popen(["sleep", "60"])
    fleet.sims.append(
        EngineSim(port, placeholder, "H100-SXM-80GB", "r-faulty", "h100", "us-east", 0.5)
    )
    fleet.publish()
    try:
        replies = [chat(server.url, key.secret, max_tokens=3, stream=True) for _ in range(6)]
    finally:
        stop.set()
    assert [r.status_code for r in replies] == [200] * 6
    assert all(b"[DONE]" in r.content and b'"error"' not in r.content for r in replies)
    assert sample(healthy.metrics_text(), "vllm:request_success_total") == 6
    # The cheaper faulty replica was tried (and failed over) until its breaker opened.
    assert server.gateway().breakers["r-faulty"].blocked_until > 0


def test_a_redis_that_lost_its_scripts_still_settles_every_request(setup) -> None:
    server, fleet, key, client = setup
    fleet.start()
    fleet.publish()
    assert chat(server.url, key.secret, max_tokens=2, stream=True).status_code == 200
    client.script_flush()  # as after a Redis restart
    assert chat(server.url, key.secret, max_tokens=2, stream=True).status_code == 200
    # The stream's slot is given back (the settle may have run before this line: by name, not
    # by looking for the key, which Redis drops once it is empty).
    lease = f"{tenant_tag(key.tenant.pk)}:streams"
    assert wait_until(lambda: client.zcard(lease) == 0)
    assert wait_until(lambda: client.xlen("usage:events") == 2)  # each request billed once


def test_a_client_that_stops_reading_and_then_leaves_still_aborts_the_engine(setup) -> None:
    """The gateway's writes back up while the client reads nothing; its disconnect must still
    cancel the stream and close the upstream, or the engine generates on for nobody."""
    server, fleet, key, client = setup
    sim = fleet.start(time_scale=50)
    fleet.publish()
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 4000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "tell me everything"}],
    }
    headers = {"Authorization": f"Bearer {key.secret}"}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        assert wait_until(lambda: sample(sim.metrics_text(), "vllm:num_requests_running") == 1)
        time.sleep(1.0)  # reading nothing, while the engine streams on
    assert wait_until(lambda: sample(sim.metrics_text(), "vllm:num_requests_running") == 0, 5)
    generated = sample(sim.metrics_text(), "vllm:generation_tokens_total")
    assert generated < 4000
    assert wait_until(lambda: len(usage_events(client)) == 1)
    assert usage_events(client)[0].status == "client_cancelled"


def test_a_replica_gone_before_the_table_says_so_is_served_from_the_table_read_again(
    setup,
) -> None:
    """A drained replica stops a moment after the table drops it; a gateway that has not yet
    read the new table reads it again on the refused connection instead of answering 503."""
    server, fleet, key, _ = setup
    leaving = fleet.start()
    fleet.publish()
    assert chat(server.url, key.secret, max_tokens=2).status_code == 200
    # This gateway stops following updates (its pub/sub and its poll), so its copy goes stale.
    routing = server.gateway().routing
    for task in routing._tasks:
        task.get_loop().call_soon_threadsafe(task.cancel)
    assert wait_until(lambda: all(task.done() for task in routing._tasks), 5)
    staying = fleet.start()
    fleet.sims.remove(leaving)
    fleet.publish()  # the new table names only `staying`; this gateway has not read it
    leaving.stop()
    assert leaving.replica_id in routing.snapshot.endpoints
    reply = chat(server.url, key.secret, max_tokens=2)
    assert reply.status_code == 200, reply.text
    assert sample(staying.metrics_text(), "vllm:request_success_total") == 1
    assert set(routing.snapshot.endpoints) == {staying.replica_id}
