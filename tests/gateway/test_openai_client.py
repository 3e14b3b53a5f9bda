"""The official `openai` client, unmodified, against the running gateway."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest
import redis

from serving.redis_contracts import VISIBILITY_HASH
from tests.gateway.conftest import (
    MODEL,
    EngineSim,
    Fleet,
    GatewayServer,
    TenantKey,
    publish_catalog,
    sample,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def client(gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis):
    fleet.start()
    fleet.publish()
    publish_catalog(redis_client)
    key = make_key("acme")
    return openai.OpenAI(base_url=f"{gateway_server.url}/v1", api_key=key.secret, max_retries=0)


def test_chat_completion_without_streaming(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello"}], max_tokens=12
    )
    assert reply.object == "chat.completion"
    assert reply.model == MODEL
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason in {"stop", "length"}
    assert reply.usage is not None
    assert 0 < reply.usage.completion_tokens <= 12
    assert reply.usage.prompt_tokens > 0


def test_chat_completion_streamed_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to five"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert content, "no tokens streamed"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(content)
    assert all(c.usage is None for c in chunks[:-1])
    assert {c.id for c in chunks} == {chunks[0].id}


def test_completion_streamed_and_not(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6)
    assert whole.object == "text_completion"
    assert whole.choices[0].text
    assert whole.usage is not None and whole.usage.completion_tokens <= 6
    pieces = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, stream=True))
    assert pieces and all(p.usage is None for p in pieces)
    assert "".join(p.choices[0].text for p in pieces if p.choices)


def test_models_list_shows_what_the_key_may_use(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]


def test_a_wrong_key_raises_authentication_error(gateway_server: GatewayServer) -> None:
    bad = openai.OpenAI(base_url=f"{gateway_server.url}/v1", api_key="sk-nope-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        bad.models.list()
    assert raised.value.code == "invalid_api_key"


def test_an_unknown_model_raises_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    assert raised.value.code == "model_not_found"


def test_a_model_outside_the_allowlist_raises_permission_denied(
    gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis
) -> None:
    fleet.start()
    fleet.publish()
    publish_catalog(redis_client)
    key = make_key("acme", allowlist=("qwen2.5-7b",))
    limited = openai.OpenAI(base_url=f"{gateway_server.url}/v1", api_key=key.secret, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        limited.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])


def test_n_above_one_raises_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], n=2
        )
    assert raised.value.param == "n"
    assert "only n=1 is supported" in str(raised.value)


def test_exhausted_rate_limit_raises_rate_limit_error(
    gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis
) -> None:
    fleet.start()
    fleet.publish()
    publish_catalog(redis_client)
    key = make_key("acme", requests_per_minute=1)
    client = openai.OpenAI(base_url=f"{gateway_server.url}/v1", api_key=key.secret, max_retries=0)
    client.completions.create(model=MODEL, prompt="one", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as raised:
        client.completions.create(model=MODEL, prompt="two", max_tokens=2)
    assert raised.value.code == "rate_limit_exceeded"
    headers = raised.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "1"
    assert headers["x-ratelimit-remaining-requests"] == "0"


def test_a_lora_adapter_is_called_by_its_name_and_routed_where_it_is_loaded(
    gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis
) -> None:
    plain = fleet.start(price_per_hour=0.5)
    with_lora = fleet.start(extra=("--enable-lora", "--max-loras", "2"))
    with_lora.load_adapter("acme-support")
    fleet.publish()
    key = make_key("acme")
    publish_catalog(redis_client, adapters={"acme-support": (key.tenant.pk,)})
    client = openai.OpenAI(base_url=f"{gateway_server.url}/v1", api_key=key.secret, max_retries=0)
    listed = {model.id: model for model in client.models.list()}
    assert set(listed) == {MODEL, "acme-support"}
    for _ in range(3):
        reply = client.chat.completions.create(
            model="acme-support", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert reply.model == "acme-support"
    assert sample(with_lora.metrics_text(), "vllm:request_success_total") == 3
    assert sample(plain.metrics_text(), "vllm:request_success_total") == 0


def test_another_tenant_cannot_call_an_adapter_it_was_not_granted(
    gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis
) -> None:
    sim = fleet.start(extra=("--enable-lora", "--max-loras", "2"))
    sim.load_adapter("acme-support")
    fleet.publish()
    acme = make_key("acme")
    globex = make_key("globex")
    publish_catalog(redis_client, adapters={"acme-support": (acme.tenant.pk,)})
    client = openai.OpenAI(
        base_url=f"{gateway_server.url}/v1", api_key=globex.secret, max_retries=0
    )
    assert [model.id for model in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="acme-support", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )


def test_a_model_is_retrieved_by_its_id(client: openai.OpenAI) -> None:
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_a_visible_model_without_a_deployment_is_a_404_not_a_retry(
    gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis
) -> None:
    fleet.publish()  # a routing table with no replica and no route for MODEL
    redis_client.hset(
        VISIBILITY_HASH,
        "undeployed-model",
        '{"kind": "model", "base_model": "undeployed-model", "public": true, "tenants": []}',
    )
    key = make_key("acme")
    api = openai.OpenAI(base_url=f"{gateway_server.url}/v1", api_key=key.secret, max_retries=0)
    with pytest.raises(openai.NotFoundError) as raised:
        api.chat.completions.create(
            model="undeployed-model", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    assert raised.value.code == "model_not_deployed"


ShortContext = tuple[GatewayServer, EngineSim, openai.OpenAI]


@pytest.fixture
def short_context(
    gateway_server: GatewayServer,
    fleet: Fleet,
    make_key: Callable[..., TenantKey],
    redis_client: redis.Redis,
) -> ShortContext:
    """One engine with a 256-token context, so max_tokens within the key's cap can overflow it."""
    sim = fleet.start(extra=("--max-model-len", "256"))
    fleet.publish()
    publish_catalog(redis_client)
    key = make_key("acme")
    api = openai.OpenAI(base_url=f"{gateway_server.url}/v1", api_key=key.secret, max_retries=0)
    return gateway_server, sim, api


# vLLM 0.32 refuses a max_tokens over the context, and clamps one the prompt leaves no room for.
OVER_CONTEXT = "max_tokens=300 cannot be greater than max_model_len=256."


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_over_the_engines_context_raises_bad_request_with_the_engines_message(
    short_context: ShortContext, stream: bool
) -> None:
    _, _, api = short_context
    with pytest.raises(openai.BadRequestError) as raised:
        # Streamed or not, the refusal comes before any event: `create` raises.
        api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=300,
            stream=stream,
        )
    error = raised.value
    assert error.status_code == 400
    assert isinstance(error.body, dict)
    assert error.body["message"].startswith(OVER_CONTEXT), error.body
    assert error.message == f"Error code: 400 - {error.body['message']}"
    assert error.type == "invalid_request_error"
    assert error.param == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_over_the_engines_context_raises_bad_request_with_the_engines_message(
    short_context: ShortContext, stream: bool
) -> None:
    _, _, api = short_context
    with pytest.raises(openai.BadRequestError) as raised:
        api.completions.create(model=MODEL, prompt="hi", max_tokens=300, stream=stream)
    assert isinstance(raised.value.body, dict)
    assert raised.value.body["message"].startswith(OVER_CONTEXT), raised.value.body
    assert raised.value.param == "max_tokens"


def test_requests_the_engine_refuses_leave_its_circuit_breaker_closed(
    short_context: ShortContext,
) -> None:
    server, sim, api = short_context
    refusals = 5
    for _ in range(refusals):
        with pytest.raises(openai.BadRequestError):
            api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=300
            )
    assert refusals > server.gateway().config.breaker_failures
    breaker = server.gateway().breakers.get(sim.replica_id)
    assert breaker is None or breaker.blocked_until == 0
    reply = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.choices[0].message.content
    assert sample(sim.metrics_text(), "vllm:request_success_total") == 1
