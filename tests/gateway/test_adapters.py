"""LoRA adapters missing on the replica the router chose (unloaded, or the replica restarted):
the engine answers 404 for an unknown model name, as vLLM does; the client must not see it."""

from __future__ import annotations

import httpx
import openai
import pytest
import redis

from tests.gateway.conftest import EngineSim, Fleet, GatewayServer, publish_catalog, sample

pytestmark = pytest.mark.slow

ADAPTER = "acme-support"
LORA = ("--enable-lora", "--max-loras", "2")


def unload(sim: EngineSim, name: str) -> None:
    reply = httpx.post(f"{sim.url}/v1/unload_lora_adapter", json={"lora_name": name})
    assert reply.status_code == 200, reply.text


def ask(client: openai.OpenAI) -> str:
    reply = client.chat.completions.create(
        model=ADAPTER, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    return reply.model


def test_the_engine_answers_404_for_an_adapter_it_has_not_loaded(fleet: Fleet) -> None:
    sim = fleet.start(extra=LORA)
    reply = httpx.post(
        f"{sim.url}/v1/chat/completions",
        timeout=10,
        json={"model": ADAPTER, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert reply.status_code == 404
    assert reply.json()["error"]["type"] == "NotFoundError"


def test_an_adapter_gone_from_the_chosen_replica_is_served_by_another(
    gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis
) -> None:
    holder = fleet.start(price_per_hour=3.49, extra=LORA)
    emptied = fleet.start(price_per_hour=1.0, extra=LORA)  # cheaper: the router's first pick
    for sim in (holder, emptied):
        sim.load_adapter(ADAPTER)
    fleet.publish()
    key = make_key("acme")
    publish_catalog(redis_client, adapters={ADAPTER: (key.tenant.pk,)})
    unload(emptied, ADAPTER)  # the routing table has not caught up
    client = openai.OpenAI(base_url=f"{gateway_server.url}/v1", api_key=key.secret, max_retries=0)

    assert [ask(client) for _ in range(4)] == [ADAPTER] * 4
    assert sample(holder.metrics_text(), "vllm:request_success_total") == 4
    # The replica itself is healthy (its base model serves): no breaker verdict against it.
    breaker = gateway_server.gateway().breakers.get(emptied.replica_id)
    assert breaker is None or breaker.blocked_until == 0


def test_an_adapter_loaded_nowhere_is_a_503_to_retry_not_a_404(
    gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis
) -> None:
    sim = fleet.start(extra=LORA)
    sim.load_adapter(ADAPTER)
    fleet.publish()
    key = make_key("acme")
    publish_catalog(redis_client, adapters={ADAPTER: (key.tenant.pk,)})
    unload(sim, ADAPTER)
    reply = httpx.post(
        f"{gateway_server.url}/v1/chat/completions",
        json={"model": ADAPTER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        headers={"Authorization": f"Bearer {key.secret}"},
        timeout=30,
    )
    assert reply.status_code == 503, reply.text
    assert int(reply.headers["retry-after"]) >= 1
    assert reply.json()["error"]["code"] == "model_not_loaded"
