"""Request handling on /v1: validation, idempotency, guardrails, headers, metrics, no SQL."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import pytest
import redis
from django.db import OperationalError
from django.db.backends.utils import CursorWrapper
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import (
    MODEL,
    Fleet,
    GatewayServer,
    publish_catalog,
    sample,
    wait_until,
)

pytestmark = pytest.mark.slow


BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "messages"),
        ({**BODY, "temperature": 7}, "temperature"),
        ({**BODY, "max_tokens": 0}, "max_tokens"),
        ({**BODY, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({**BODY, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_bad_bodies_get_a_400_naming_the_parameter(ready, body, param) -> None:
    _, _, http = ready
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


def test_invalid_json_is_a_400_not_a_500(ready) -> None:
    _, _, http = ready
    reply = http.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert reply.status_code == 400
    assert "not valid JSON" in reply.json()["error"]["message"]


def test_a_request_over_the_keys_max_tokens_cap_is_refused(ready) -> None:
    _, _, http = ready
    reply = http.post("/v1/chat/completions", json={**BODY, "max_tokens": 100_000})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "max_tokens_exceeded"


def test_responses_carry_a_request_id_and_rate_limit_headers(ready) -> None:
    _, _, http = ready
    reply = http.post("/v1/chat/completions", json=BODY)
    assert reply.status_code == 200
    assert len(reply.headers["x-request-id"]) == 32
    for name in ("requests", "tokens"):
        assert int(reply.headers[f"x-ratelimit-limit-{name}"]) > 0
        assert int(reply.headers[f"x-ratelimit-remaining-{name}"]) >= 0
        assert reply.headers[f"x-ratelimit-reset-{name}"]


def test_an_unknown_priority_tier_is_refused(ready) -> None:
    _, _, http = ready
    reply = http.post("/v1/chat/completions", json=BODY, headers={"x-priority": "urgent"})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "x-priority"


def test_the_same_idempotency_key_and_body_replays_the_first_response(ready) -> None:
    _, _, http = ready
    first = http.post("/v1/chat/completions", json=BODY, headers={"Idempotency-Key": "order-1"})
    again = http.post("/v1/chat/completions", json=BODY, headers={"Idempotency-Key": "order-1"})
    assert first.status_code == again.status_code == 200
    assert again.json() == first.json()
    assert again.headers["idempotent-replayed"] == "true"


def test_the_same_idempotency_key_with_another_body_is_a_422(ready) -> None:
    _, _, http = ready
    http.post("/v1/chat/completions", json=BODY, headers={"Idempotency-Key": "order-2"})
    other = {**BODY, "max_tokens": 5}
    reply = http.post("/v1/chat/completions", json=other, headers={"Idempotency-Key": "order-2"})
    assert reply.status_code == 422
    assert reply.json()["error"]["code"] == "idempotency_key_reused"


def test_the_same_idempotency_key_while_the_first_runs_is_a_409(
    gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis
) -> None:
    fleet.start(time_scale=1)  # real time: the first request runs for seconds
    fleet.publish()
    publish_catalog(redis_client)
    key = make_key("acme")
    headers = {"Authorization": f"Bearer {key.secret}", "Idempotency-Key": "order-3"}
    slow = {**BODY, "max_tokens": 300}
    url = f"{gateway_server.url}/v1/chat/completions"
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, url, json=slow, headers=headers, timeout=60)
        assert wait_until(lambda: redis_client.keys("idem:*") != [], timeout_s=10)
        reply = httpx.post(url, json=slow, headers=headers, timeout=60)
        assert reply.status_code == 409
        assert reply.json()["error"]["code"] == "idempotency_key_in_use"
        assert first.result().status_code == 200
    replay = httpx.post(url, json=slow, headers=headers, timeout=60)
    assert replay.status_code == 200
    assert replay.json() == first.result().json()


def test_a_blocked_pattern_is_refused_before_any_gpu_time(ready, fleet: Fleet, settings) -> None:
    _, key, http = ready
    from tenants.actions import do_update_tenant

    do_update_tenant(key.tenant, blocked_patterns=[r"project\s+falcon"])
    body = {**BODY, "messages": [{"role": "user", "content": "Tell me about Project  Falcon"}]}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "guardrail_refused"


def test_a_blocked_pattern_in_a_large_prompt_is_refused_too(ready, fleet: Fleet) -> None:
    _, key, http = ready
    from tenants.actions import do_update_tenant

    do_update_tenant(key.tenant, blocked_patterns=[r"project\s+falcon"])
    # Over the size checked on a worker thread rather than on the event loop.
    text = "lorem ipsum " * 6_000 + "Tell me about Project  Falcon"
    body = {**BODY, "messages": [{"role": "user", "content": text}]}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "guardrail_refused"
    assert "blocked" in error["message"]
    assert sample(fleet.sims[0].metrics_text(), "vllm:prompt_tokens_total") == 0


def test_a_prompt_over_the_context_cap_is_refused_before_any_gpu_time(
    gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis
) -> None:
    sim = fleet.start()
    fleet.publish()
    publish_catalog(redis_client)
    key = make_key("acme", max_context_tokens=50)
    long_prompt = "word " * 400
    reply = httpx.post(
        f"{gateway_server.url}/v1/completions",
        json={"model": MODEL, "prompt": long_prompt, "max_tokens": 2},
        headers={"Authorization": f"Bearer {key.secret}"},
    )
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "guardrail_refused"
    assert sample(sim.metrics_text(), "vllm:prompt_tokens_total") == 0


def test_the_gateway_serves_admitted_keys_with_no_database_query(ready) -> None:
    _, _, http = ready
    assert http.post("/v1/chat/completions", json=BODY).status_code == 200  # warm caches
    queries: list[str] = []

    def refuse(self, sql, *args, **kwargs):
        queries.append(sql)
        raise OperationalError("PostgreSQL is down")

    # Every SQL statement from any thread now fails as if PostgreSQL were stopped.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CursorWrapper, "execute", refuse)
        patch.setattr(CursorWrapper, "executemany", refuse)
        statuses = [
            http.post("/v1/chat/completions", json={**BODY, "stream": stream}).status_code
            for stream in (False, True, False)
        ]
        statuses.append(http.get("/v1/models").status_code)
    assert statuses == [200, 200, 200, 200]
    assert queries == []


def test_gateway_metrics_are_exposed_in_prometheus_format(ready) -> None:
    server, _, http = ready
    http.post("/v1/chat/completions", json={**BODY, "stream": True})
    text = httpx.get(f"{server.url}/metrics").text
    assert "platform_gateway_time_to_first_token_seconds_bucket" in text
    assert 'platform_router_decisions_total{policy="cost_aware"' in text
    assert (
        'platform_gateway_tokens_total{kind="completion",model="llama-3.1-8b",tenant="acme"}'
        in text
    )


def test_each_answer_is_judged_on_both_clocks_of_its_tier(ready) -> None:
    server, _, http = ready

    def judged() -> dict[tuple[str, str], float]:
        found: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
            for point in family.samples:
                if point.name == "platform_gateway_slo_requests_total":
                    key = (point.labels["tier"], point.labels["outcome"])
                    found[key] = found.get(key, 0.0) + point.value
                elif point.name == "platform_gateway_time_per_output_token_seconds_count":
                    key = (point.labels["tier"], "tpot observed")
                    found[key] = found.get(key, 0.0) + point.value
        return found

    before = judged()
    for tier, stream in (("interactive", True), ("interactive", False), ("batch", True)):
        reply = http.post(
            "/v1/chat/completions", json={**BODY, "stream": stream}, headers={"x-priority": tier}
        )
        assert reply.status_code == 200
    after = judged()

    def grew(key: tuple[str, str]) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    # Both interactive answers judged once each (met, on any machine not stalled for 50 ms a
    # token; the rule itself is tested in tests/serving/test_router.py), none failed.
    outcomes = [grew(("interactive", outcome)) for outcome in ("met", "ttft", "tpot", "failed")]
    assert sum(outcomes) == 2 and outcomes[3] == 0
    assert grew(("interactive", "tpot observed")) == 2
    assert grew(("batch", "tpot observed")) == 1
    # Batch has no objective: timed, never judged.
    assert not any(grew(("batch", outcome)) for outcome in ("met", "ttft", "tpot", "failed"))


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        (b"[1, 2]", "must be a JSON object", None),
        (b'{"model": "llama-3.1-8b", "prompt": 42}', "valid string", "prompt"),
    ],
)
def test_bad_completion_bodies_name_the_parameter_plainly(ready, body, message, param) -> None:
    _, _, http = ready
    reply = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert message in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"] == param


def test_best_of_cannot_sneak_several_choices_past_n(ready) -> None:
    _, _, http = ready
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "best_of": 3})
    assert reply.status_code == 400
    assert "best_of" in reply.json()["error"]["message"]


def test_settled_requests_time_to_first_token_reaches_the_autoscaler(
    ready, redis_client: redis.Redis
) -> None:
    """Against each request's own tier's objective: these carry no x-priority header, so they
    are standard requests, whose objective is 3 s."""
    from registry.rollout_metrics import quantile_from_buckets
    from serving.actions.autoscale import MIN_TTFT_REQUESTS, observed_ttft_p95_of_objective

    _, _, http = ready
    deployment_id = 1  # the fleet's routing table
    observed = partial(observed_ttft_p95_of_objective, redis_client, deployment_id, window_s=45.0)
    assert observed(now_s=1000.0) is None
    for stream in [False, True] * (MIN_TTFT_REQUESTS // 2):
        assert http.post("/v1/chat/completions", json={**BODY, "stream": stream}).status_code == 200
    stats = f"registry:rollout:stats:{deployment_id}"
    assert wait_until(lambda: int(redis_client.hget(stats, "requests") or 0) >= MIN_TTFT_REQUESTS)
    p95 = observed(now_s=1010.0)
    counters = {
        (name.decode() if isinstance(name, bytes) else name): int(count)
        for name, count in redis_client.hgetall(stats).items()
    }
    ttft = {int(k[5:]): n for k, n in counters.items() if k.startswith("ttft:")}
    raw_p95 = quantile_from_buckets(ttft, 0.95)
    assert p95 is not None and raw_p95 is not None
    assert raw_p95 / 3.0 / 1.25 < p95 < raw_p95 / 3.0 * 1.25  # each read within a 9 % bucket


def replay_of(server: GatewayServer, secret: str, idempotency_key: str, **headers: str):
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        json=BODY,
        headers={
            "Authorization": f"Bearer {secret}",
            "Idempotency-Key": idempotency_key,
            **headers,
        },
        timeout=30,
    )


def test_an_idempotent_replay_is_refused_to_a_key_not_allowed_the_model(ready, make_key) -> None:
    server, key, _ = ready
    assert replay_of(server, key.secret, "order-4").status_code == 200
    narrow = make_key("acme", allowlist=("another-model",))
    reply = replay_of(server, narrow.secret, "order-4")
    assert reply.status_code == 403
    assert reply.json()["error"]["code"] == "model_not_allowed"
    assert "idempotent-replayed" not in reply.headers


def test_an_idempotent_replay_is_refused_a_tier_the_tenant_may_no_longer_use(ready) -> None:
    from tenants.actions import do_update_quota

    server, key, http = ready
    assert replay_of(server, key.secret, "order-5", **{"x-priority": "interactive"}).is_success
    do_update_quota(key.tenant.quota, allowed_tiers=["batch"])
    fresh = {**BODY, "max_tokens": 2}
    assert wait_until(
        lambda: (
            http.post(
                "/v1/chat/completions", json=fresh, headers={"x-priority": "interactive"}
            ).status_code
            == 403
        )
    )
    reply = replay_of(server, key.secret, "order-5", **{"x-priority": "interactive"})
    assert reply.status_code == 403
    assert reply.json()["error"]["code"] == "tier_not_allowed"


def test_an_idempotent_replay_is_refused_to_a_suspended_tenant(ready) -> None:
    from tenants.actions import do_update_tenant

    server, key, _ = ready
    assert replay_of(server, key.secret, "order-6").status_code == 200
    do_update_tenant(key.tenant, status="suspended")
    assert wait_until(lambda: replay_of(server, key.secret, "order-6").status_code == 403)
    assert replay_of(server, key.secret, "order-6").json()["error"]["code"] == "tenant_suspended"


def test_another_tenants_key_never_gets_a_replay_of_acmes_response(ready, make_key) -> None:
    server, key, _ = ready
    first = replay_of(server, key.secret, "order-7")
    globex = make_key("globex")
    reply = replay_of(server, globex.secret, "order-7")
    assert first.status_code == reply.status_code == 200
    assert "idempotent-replayed" not in reply.headers
    assert reply.json()["id"] != first.json()["id"]


def test_a_non_streamed_request_holds_one_of_the_keys_concurrent_slots(
    gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis
) -> None:
    fleet.start(time_scale=1)  # real time: the first request runs for seconds
    fleet.publish()
    publish_catalog(redis_client)
    key = make_key("acme", concurrent_streams=1)
    headers = {"Authorization": f"Bearer {key.secret}"}
    url = f"{gateway_server.url}/v1/chat/completions"
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, url, json={**BODY, "max_tokens": 300}, headers=headers)
        assert wait_until(lambda: redis_client.zcard(f"rl:{{t:{key.tenant.pk}}}:streams") == 1)
        second = httpx.post(url, json=BODY, headers=headers, timeout=30)
        assert second.status_code == 429
        assert "concurrent requests" in second.json()["error"]["message"]
        assert first.result(timeout=60).status_code == 200
    assert httpx.post(url, json=BODY, headers=headers, timeout=30).status_code == 200


def test_a_blocked_pattern_in_a_tool_definition_or_in_disguise_is_refused(
    ready, fleet: Fleet
) -> None:
    _, key, http = ready
    from tenants.actions import do_update_tenant

    do_update_tenant(key.tenant, blocked_patterns=[r"project\s+falcon"])
    tool = {
        "type": "function",
        "function": {"name": "lookup", "description": "Files of Project Falcon", "parameters": {}},
    }
    disguised = [{"role": "user", "content": "Tell me about ｐｒｏｊｅｃｔ fal\u200bcon"}]
    for body in ({**BODY, "tools": [tool]}, {**BODY, "messages": disguised}):
        reply = http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400
        assert reply.json()["error"]["code"] == "guardrail_refused"
    assert sample(fleet.sims[0].metrics_text(), "vllm:prompt_tokens_total") == 0
