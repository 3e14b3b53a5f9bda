"""Errors an engine reports inside a stream it already answered 200 for (vLLM sends an error
event, then [DONE]): the client gets the engine's error, the replica's breaker hears of it
when the engine was at fault, and the usage event bills the tokens delivered."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from metering.usage import UsageEvent
from serving.gateway.upstream import error_event
from tests.gateway.conftest import MODEL, Fleet, GatewayServer, publish_catalog, wait_until
from tests.gateway.test_websocket import chat_body, converse
from tests.metering.helpers import stream_events

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "a long story please"}]


def usage_events(client: redis.Redis) -> list[UsageEvent]:
    return stream_events(client)


def only_usage_event(client: redis.Redis) -> UsageEvent:
    assert wait_until(lambda: len(usage_events(client)) == 1)
    [event] = usage_events(client)
    return event


@pytest.fixture
def setup(gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis):
    publish_catalog(redis_client)
    key = make_key("acme")
    api = openai.OpenAI(base_url=f"{gateway_server.url}/v1", api_key=key.secret, max_retries=0)
    return gateway_server, fleet, api, key, redis_client


def stream_until_error(api: openai.OpenAI) -> tuple[list[str], openai.APIError]:
    contents: list[str] = []
    with pytest.raises(openai.APIError) as raised:
        for chunk in api.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=50,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                contents.append(chunk.choices[0].delta.content)
    return contents, raised.value


# --- the error event, as read from the engine's stream -----------------------------------------


def test_newer_vllms_nested_error_event_is_a_failure_with_its_message_and_code() -> None:
    failure = error_event(
        {
            "error": {
                "message": "CUDA error: an illegal memory access",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
    )
    assert failure is not None
    assert failure.kind == "error_event"
    assert failure.status == 500
    assert failure.engine_message == "CUDA error: an illegal memory access"


def test_the_flat_error_event_of_some_vllm_versions_is_a_failure_too() -> None:
    failure = error_event(
        {
            "object": "error",
            "message": "bad grammar",
            "type": "BadRequestError",
            "param": "response_format",
            "code": 400,
        }
    )
    assert failure is not None
    assert (failure.status, failure.engine_message, failure.param) == (
        400,
        "bad grammar",
        "response_format",
    )


def test_an_error_event_without_a_usable_code_is_taken_as_the_engines_fault() -> None:
    chunks: tuple[dict[str, Any], ...] = (
        {"error": {"message": "boom"}},
        {"error": "boom"},
        {"error": {"message": "boom", "code": "oops"}},
    )
    for chunk in chunks:
        failure = error_event(chunk)
        assert failure is not None
        assert (failure.status, failure.engine_message) == (500, "boom")


def test_an_ordinary_chunk_is_not_an_error_event() -> None:
    chunk: dict[str, Any] = {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": None,
    }
    assert error_event(chunk) is None
    assert error_event({**chunk, "error": None}) is None


# --- end to end ----------------------------------------------------------------------------------


def test_a_stream_the_engine_fails_after_n_tokens_raises_the_engines_error_in_the_client(
    setup,
) -> None:
    _, fleet, api, _, client = setup
    fleet.start(extra=("--sim-error-after-tokens", "4"), time_scale=5)
    fleet.publish()
    contents, error = stream_until_error(api)
    assert len(contents) == 4
    assert error.message == "simulated engine failure after 4 tokens"
    assert isinstance(error.body, dict)
    assert error.body["type"] == "server_error"
    assert error.body["code"] == "upstream_error"
    event = only_usage_event(client)
    assert event.status == "upstream_failed"
    assert event.completion_tokens == 4
    assert event.prompt_tokens > 0


def test_engine_errors_mid_stream_open_the_replicas_breaker(setup) -> None:
    server, fleet, api, _, _ = setup
    sim = fleet.start(extra=("--sim-error-after-tokens", "2"), time_scale=5)
    fleet.publish()
    stream_until_error(api)  # the gateway starts on its first request
    for _ in range(server.gateway().config.breaker_failures - 1):
        stream_until_error(api)
    breaker = server.gateway().breakers[sim.replica_id]
    assert breaker.blocked_until > time.monotonic()
    with pytest.raises(openai.APIStatusError) as raised:
        api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert raised.value.status_code == 503


def test_an_error_event_for_the_request_leaves_the_breaker_closed(setup) -> None:
    server, fleet, api, _, client = setup
    sim = fleet.start(
        extra=("--sim-error-after-tokens", "2", "--sim-error-status", "400"), time_scale=5
    )
    fleet.publish()
    failures = 5
    for _ in range(failures):
        contents, error = stream_until_error(api)
        assert len(contents) == 2
        assert error.message == "simulated engine failure after 2 tokens"
        assert isinstance(error.body, dict)
        assert error.body["type"] == "invalid_request_error"
    assert failures > server.gateway().config.breaker_failures
    breaker = server.gateway().breakers.get(sim.replica_id)
    assert breaker is None or breaker.blocked_until == 0
    assert wait_until(lambda: len(usage_events(client)) == failures)
    # The request's doing, not the replica's: refused, which the SLO does not judge; the two
    # tokens delivered are billed.
    events = usage_events(client)
    assert {(e.status, e.completion_tokens, e.slo_outcome) for e in events} == {
        ("refused", 2, None)
    }


def test_an_engine_error_before_the_first_token_is_retried_on_another_replica(setup) -> None:
    server, fleet, api, _, _ = setup
    broken = fleet.start(extra=("--sim-error-after-tokens", "0"), time_scale=5)
    fleet.start(time_scale=5)
    fleet.publish()
    # Which replica serves a request is the router's draw: send until the broken one was
    # tried (its breaker heard of it); every client still gets its whole answer.
    for _ in range(40):
        stream = api.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3, stream=True
        )
        assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) == 3
        if broken.replica_id in server.gateway().breakers:
            break
    assert broken.replica_id in server.gateway().breakers


def test_a_non_streaming_request_the_engine_fails_is_a_502_with_the_engines_message(
    setup,
) -> None:
    server, fleet, _, key, _ = setup
    fleet.start(extra=("--sim-error-after-tokens", "3"), time_scale=5)
    fleet.publish()
    reply = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 20},
        headers={"Authorization": f"Bearer {key.secret}"},
        timeout=30,
    )
    assert reply.status_code == 502
    assert reply.json()["error"] == {
        "message": "simulated engine failure after 3 tokens",
        "type": "server_error",
        "param": None,
        "code": "upstream_error",
    }


def test_a_websocket_chat_the_engine_fails_gets_the_engines_error_frame(setup) -> None:
    server, fleet, _, key, client = setup
    fleet.start(extra=("--sim-error-after-tokens", "3"), time_scale=5)
    fleet.publish()
    url = f"ws://127.0.0.1:{server.port}/v1/chat/completions/ws"
    replies = asyncio.run(
        converse(url, {"Authorization": f"Bearer {key.secret}"}, [chat_body(max_tokens=20)])
    )
    chunks = [r for r in replies if r["type"] == "chunk"]
    assert sum(1 for c in chunks if c["data"]["choices"][0]["delta"].get("content")) == 3
    assert replies[-1] == {
        "type": "error",
        "error": {
            "message": "simulated engine failure after 3 tokens",
            "type": "server_error",
            "param": None,
            "code": "upstream_error",
        },
    }
    assert only_usage_event(client).completion_tokens == 3


def test_the_sse_error_event_is_openais_shape_followed_by_done(setup) -> None:
    server, fleet, _, key, _ = setup
    fleet.start(extra=("--sim-error-after-tokens", "1"), time_scale=5)
    fleet.publish()
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 20, "stream": True},
        headers={"Authorization": f"Bearer {key.secret}"},
        timeout=30,
    ) as reply:
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert orjson.loads(events[-2].removeprefix("data: ")) == {
        "error": {
            "message": "simulated engine failure after 1 tokens",
            "type": "server_error",
            "param": None,
            "code": "upstream_error",
        }
    }


@pytest.mark.parametrize(
    "failure", ["--sim-error-after-tokens", "--sim-crash-after-tokens"], ids=["error", "crash"]
)
def test_a_stream_ending_in_an_error_sends_its_usage_chunk_first(setup, failure: str) -> None:
    # OpenAI's clients stop at the error event, so the usage (what was delivered) comes first.
    server, fleet, _, key, client = setup
    fleet.start(extra=(failure, "3"), time_scale=5)
    fleet.publish()
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 20,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        headers={"Authorization": f"Bearer {key.secret}"},
        timeout=30,
    ) as reply:
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert "error" in orjson.loads(events[-2].removeprefix("data: "))
    usage = orjson.loads(events[-3].removeprefix("data: "))
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 3
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 3
    assert only_usage_event(client).completion_tokens == 3


def test_a_stream_ending_in_an_error_without_include_usage_has_no_usage_chunk(setup) -> None:
    server, fleet, _, key, _ = setup
    fleet.start(extra=("--sim-error-after-tokens", "3"), time_scale=5)
    fleet.publish()
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 20, "stream": True},
        headers={"Authorization": f"Bearer {key.secret}"},
        timeout=30,
    ) as reply:
        chunks = [
            orjson.loads(line.removeprefix("data: "))
            for line in reply.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    assert all("usage" not in chunk for chunk in chunks)
