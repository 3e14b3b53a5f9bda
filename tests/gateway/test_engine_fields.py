"""What of a body reaches the engine: an allowlist. The engine's own controls are refused with
a 400 naming the field and change nothing; OpenAI-only fields are accepted and not forwarded;
the gateway sets the tenant's prefix-cache salt itself."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest
import redis

from metering.usage import USAGE_STREAM
from serving.gateway.contracts import ExchangeServices
from serving.gateway.pipeline import Exchange, engine_cache_salt
from serving.gateway.routing import ReplicaEndpoint
from serving.gateway.schemas import (
    ENGINE_INTERNAL_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from tenants.keys import KeyPrincipal
from tests.gateway.conftest import MODEL

BODY: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
ENDPOINT = ReplicaEndpoint(
    replica_id="r-1",
    deployment_id="1",
    endpoint="http://127.0.0.1:1",
    pool="p",
    gpu_class="L4-24GB",
    model=MODEL,
    served_model_name=MODEL,
    version="v1",
    version_id=None,
    price_per_hour=1.0,
    max_model_len=4096,
)


def _payload(body: dict[str, Any], tenant_id: int = 7) -> dict[str, Any]:
    import orjson

    request = parse_body(CompletionRequest, orjson.dumps(body))
    exchange = Exchange(
        gateway=cast(ExchangeServices, None),
        kind="completion",
        body=request,
        principal=cast(KeyPrincipal, SimpleNamespace(tenant_id=tenant_id)),
        tier="standard",
        max_tokens=4,
    )
    return exchange.upstream_payload(ENDPOINT)


@pytest.mark.slow
@pytest.mark.parametrize(
    "field",
    [
        "cache_salt",
        "kv_transfer_params",
        "chat_template",
        "chat_template_kwargs",
        "vllm_xargs",
        "guided_decoding_backend",
        "structured_outputs",
        "priority",
    ],
)
def test_an_engine_internal_field_is_refused_and_nothing_is_admitted(
    ready,
    redis_client: redis.Redis,
    field: str,
) -> None:
    _, _, http = ready

    reply = http.post("/v1/completions", json={**BODY, field: {"x": 1}})

    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == (field, "forbidden_parameter")
    assert "set by the platform" in error["message"]
    assert redis_client.xlen(USAGE_STREAM) == 0


@pytest.mark.slow
def test_an_unknown_field_is_refused_as_openai_does(ready) -> None:
    _, _, http = ready

    reply = http.post("/v1/completions", json={**BODY, "temperatur": 0.5})

    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == (
        "Unrecognized request argument supplied: temperatur."
    )
    assert reply.json()["error"]["param"] == "temperatur"


def test_the_internal_fields_cover_what_the_engine_must_not_take_from_a_tenant() -> None:
    assert {"cache_salt", "kv_transfer_params", "chat_template", "vllm_xargs"} <= (
        ENGINE_INTERNAL_FIELDS
    )


def test_the_engine_gets_the_tenants_salt_and_the_sampling_extensions_only() -> None:
    payload = _payload({**BODY, "top_k": 5, "min_p": 0.1, "store": True, "metadata": {"a": 1}})

    assert payload["cache_salt"] == engine_cache_salt(7) != engine_cache_salt(8)
    assert (payload["top_k"], payload["min_p"]) == (5, 0.1)
    assert "store" not in payload and "metadata" not in payload
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}


def test_chat_bodies_follow_the_same_allowlist() -> None:
    import orjson

    from serving.gateway.errors import ApiError

    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": []}
    assert parse_body(ChatCompletionRequest, orjson.dumps(ok)).engine_fields()["tools"] == []
    with pytest.raises(ApiError) as refused:
        parse_body(ChatCompletionRequest, orjson.dumps({**ok, "chat_template": "{{x}}"}))
    assert refused.value.param == "chat_template"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**BODY, "max_tokens": 2**63}, "max_tokens"),
        ({**BODY, "seed": -(2**63) - 1}, "seed"),
        ({**BODY, "logit_bias": {"5": 2**70}}, "logit_bias"),
    ],
)
def test_an_integer_past_64_bits_is_a_400_naming_its_field(
    body: dict[str, Any], param: str
) -> None:
    from serving.gateway.errors import ApiError

    raw = json.dumps(body).encode()  # orjson cannot write integers past 64 bits either
    with pytest.raises(ApiError) as refused:
        parse_body(CompletionRequest, raw)
    assert (refused.value.status, refused.value.param) == (400, param)
    assert "64-bit" in str(refused.value)


def test_a_text_part_without_string_text_is_refused_before_admission() -> None:
    import orjson

    from serving.gateway.errors import ApiError

    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}],
    }
    with pytest.raises(ApiError) as refused:
        parse_body(ChatCompletionRequest, orjson.dumps(body))
    assert refused.value.status == 400
    assert refused.value.param == "messages.0.content"
    ok = {**body, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert parse_body(ChatCompletionRequest, orjson.dumps(ok)).prompt_text()


@pytest.mark.parametrize(
    ("raw", "param", "says"),
    [
        (b'{"model": "m", "messages": ["hi"]}', "messages.0", "expected a JSON object"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 0}', "n", "n=1"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}', "n", "n=1"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
            "temperature",
            "finite",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
            "top_p",
            "finite",
        ),
    ],
)
def test_a_bad_part_of_a_body_is_named_and_said_plainly(raw: bytes, param: str, says: str) -> None:
    from serving.gateway.errors import ApiError

    with pytest.raises(ApiError) as refused:
        parse_body(ChatCompletionRequest, raw)
    assert (refused.value.status, refused.value.param) == (400, param)
    assert says in refused.value.message, refused.value.message
    assert "ChatMessage" not in refused.value.message  # no class name of ours


def test_a_body_that_is_no_object_is_said_so() -> None:
    from serving.gateway.errors import ApiError

    with pytest.raises(ApiError) as refused:
        parse_body(ChatCompletionRequest, b'["hi"]')
    assert refused.value.message == "The request body must be a JSON object."


@pytest.mark.parametrize("prompt", [[1, 2, 3], [[1, 2], [3, 4]]])
def test_a_prompt_of_token_ids_is_refused_as_such(prompt: list[Any]) -> None:
    from serving.gateway.errors import ApiError

    body = orjson.dumps({"model": MODEL, "prompt": prompt})
    with pytest.raises(ApiError) as refused:
        parse_body(CompletionRequest, body)
    assert (refused.value.status, refused.value.param) == (400, "prompt")
    assert "token ids are not accepted" in refused.value.message
