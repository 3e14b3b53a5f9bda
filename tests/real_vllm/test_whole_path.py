"""The whole path against real vLLM: a CPU node's agent launches vLLM's CPU build through the
argv builder, its telemetry reaches Redis and the router, and the official `openai` client
streams through the gateway, with the engine's own guards (key, cache salt) in force.

The tests share one fleet of two replicas (tests/real_vllm/conftest.py) and run in file order;
the SIGKILL test goes last because the restart it proves costs a vLLM start-up."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, TypedDict

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.completion_create_params import CompletionCreateParamsNonStreaming

from metering.usage import UsageEvent
from serving import telemetry
from serving.actions.reconcile import replica_spec
from serving.agent.gpus import CpuSlots
from serving.agent.launch import LaunchSettings, build_launch_command, engine_path
from serving.agent.specs import parse_replica_spec
from serving.gateway.pipeline import engine_cache_salt
from serving.models import Replica, ReplicaEvent
from tests.live import eventually
from tests.metering.helpers import stream_events
from tests.real_vllm.conftest import TINY_ADAPTER, TINY_MODEL, Engine, RealFleet, sample

pytestmark = [pytest.mark.real_vllm, pytest.mark.slow, pytest.mark.django_db]

# A prompt of well over four of the CPU backend's 128-token KV blocks.
LONG_PROMPT = " ".join(
    f"clause {i} of the shared policy document says nothing new." for i in range(80)
)


def _client(fleet: RealFleet, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.base_url, api_key=fleet.keys[tenant], max_retries=0)


def _events(fleet: RealFleet) -> dict[str, UsageEvent]:
    return {event.request_id: event for event in stream_events(fleet.redis)}


def _event(fleet: RealFleet, request_id: str) -> UsageEvent:
    return eventually(lambda: _events(fleet).get(request_id), 10, f"usage event {request_id}")


def _totals(engines: list[Engine], name: str, **labels: str) -> float:
    return sum(engine.metric(name, **labels) for engine in engines)


def _proc(pid: int, name: str) -> list[str]:
    return open(f"/proc/{pid}/{name}", "rb").read().decode().split("\0")[:-1]


# --- launch and readiness --------------------------------------------------------------------


def test_the_agent_launches_vllm_with_exactly_the_argv_builders_command(
    real_fleet: RealFleet,
) -> None:
    node = LaunchSettings(
        simulated=False,
        device="cpu",
        vllm_python=real_fleet.vllm_python,
        host="127.0.0.1",
        cpu_slots=CpuSlots(1, "any").slots,
        cpu_kv_cache_gib=1,
        otlp_traces_endpoint=real_fleet.traces.url,
    )
    for engine in real_fleet.engines():
        with real_fleet.db():
            replica = Replica.objects.select_related("node__pool__gpu_class").get(
                pk=engine.replica_id
            )
            spec = parse_replica_spec({**replica_spec(replica), "port": replica.port})
        argv, env = build_launch_command(spec, node)

        # vLLM took every flag (the process is up and Ready) and runs exactly this command.
        assert _proc(engine.pid, "cmdline") == argv
        environ = dict(item.split("=", 1) for item in _proc(engine.pid, "environ") if "=" in item)
        assert {name: environ.get(name) for name in env} == env
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert environ["VLLM_TARGET_DEVICE"] == "cpu"
        # The whole engine stays on its slot; the node's reserved core is left to the node.
        assert os.sched_getaffinity(engine.pid) == set(node.cpu_slots[0])


def test_readiness_was_a_real_one_token_generation(real_fleet: RealFleet) -> None:
    for engine in real_fleet.engines():
        at_ready = real_fleet.at_ready[engine.replica_id]
        # Before any test traffic, the engine had generated: the agent's probe, one token each.
        probes = at_ready["vllm:request_success_total"]
        assert probes >= 1
        assert at_ready["vllm:generation_tokens_total"] == probes
        with real_fleet.db():
            kinds = list(
                ReplicaEvent.objects.filter(replica_id=engine.replica_id).values_list(
                    "kind", flat=True
                )
            )
        assert "ready" in kinds


# --- the engine's own guards -----------------------------------------------------------------


def test_a_request_that_reaches_an_engine_directly_without_its_key_is_refused_by_vllm(
    real_fleet: RealFleet,
) -> None:
    engine = real_fleet.engines()[0]
    body = {"model": TINY_MODEL, "prompt": "hello", "max_tokens": 2}

    anonymous = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=30)
    wrong = engine.post("/v1/completions", body, key="ek_" + "0" * 64)
    listing = httpx.get(f"{engine.url}/v1/models", timeout=30)

    assert (anonymous.status_code, anonymous.json()) == (401, {"error": "Unauthorized"})
    assert wrong.status_code == 401
    assert listing.status_code == 401
    # The agent scrapes /metrics without a key; only the network keeps others from it.
    assert httpx.get(f"{engine.url}/metrics", timeout=30).status_code == 200
    assert engine.post("/v1/completions", body).status_code == 200


def test_one_tenants_prompt_is_a_prefix_cache_hit_for_itself_and_never_for_another(
    real_fleet: RealFleet,
) -> None:
    engines = real_fleet.engines()
    acme, globex = _client(real_fleet, "acme"), _client(real_fleet, "globex")

    def hits() -> float:
        return _totals(engines, "vllm:prefix_cache_hits_total")

    acme.completions.create(model=TINY_MODEL, prompt=LONG_PROMPT, max_tokens=1)
    before = hits()
    acme.completions.create(model=TINY_MODEL, prompt=LONG_PROMPT, max_tokens=1)
    same_tenant = hits() - before
    before = hits()
    globex.completions.create(model=TINY_MODEL, prompt=LONG_PROMPT, max_tokens=1)
    other_tenant = hits() - before

    assert same_tenant >= 4 * 128
    assert other_tenant == 0


def test_the_salt_in_the_engine_is_the_tenants_that_the_gateway_sets(
    real_fleet: RealFleet,
) -> None:
    """On the replica that cached acme's prompt (sent through the gateway), acme's salt hits
    and globex's does not: the gateway sent acme's, and only acme's requests carry it."""
    prompt = LONG_PROMPT.replace("policy", "handbook")
    raw = _client(real_fleet, "acme").completions.with_raw_response.create(
        model=TINY_MODEL, prompt=prompt, max_tokens=1
    )
    holder = real_fleet.engine(_event(real_fleet, raw.headers["x-request-id"]).replica_id)
    with real_fleet.db():
        from tenants.models import Tenant

        salts = {t.slug: engine_cache_salt(t.pk) for t in Tenant.objects.all()}
    body = {"model": TINY_MODEL, "prompt": prompt, "max_tokens": 1}
    for slug, expect_hit in (("globex", False), ("acme", True)):
        before = holder.metric("vllm:prefix_cache_hits_total")
        assert (
            holder.post("/v1/completions", {**body, "cache_salt": salts[slug]}).status_code == 200
        )
        gained = holder.metric("vllm:prefix_cache_hits_total") - before
        assert (gained >= 4 * 128) is expect_hit, (slug, gained)


def test_a_client_may_not_send_the_engines_own_fields(real_fleet: RealFleet) -> None:
    client = _client(real_fleet)
    for field in ("cache_salt", "kv_transfer_params", "chat_template", "vllm_xargs"):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(
                model=TINY_MODEL, prompt="hi", max_tokens=1, extra_body={field: "x"}
            )
        assert refused.value.body["param"] == field  # type: ignore[index]


def test_a_prompt_longer_than_the_context_is_vllms_refusal_not_a_missed_slo(
    real_fleet: RealFleet,
) -> None:
    """vLLM refuses a prompt past its context with a 400 the client gets as vLLM wrote it; the
    usage event says refused, which the SLO does not judge: the client's doing."""
    client = _client(real_fleet)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model=TINY_MODEL,
            prompt="word " * 4200,
            max_tokens=2,
            extra_headers={"x-priority": "interactive"},
        )
    assert "maximum context length" in refused.value.message
    event = _event(real_fleet, refused.value.response.headers["x-request-id"])
    assert (event.status, event.priority, event.slo_outcome) == ("refused", "interactive", None)


# --- the official client through the gateway ------------------------------------------------


def test_chat_and_completions_streamed_and_not_bill_exactly_what_vllm_counted(
    real_fleet: RealFleet,
) -> None:
    client = _client(real_fleet)
    engines = real_fleet.engines()
    calls: list[tuple[str, dict[str, Any]]] = [
        ("chat", {"messages": [{"role": "user", "content": "Tell me about ships"}]}),
        ("completion", {"prompt": "Once upon a time"}),
    ]
    for kind, body in calls:
        for stream in (False, True):
            prompt_before = _totals(engines, "vllm:prompt_tokens_total")
            generated_before = _totals(engines, "vllm:generation_tokens_total")
            usage, request_id = _call(client, kind, body, stream=stream)
            event = _event(real_fleet, request_id)

            assert event.status == "ok"
            assert (event.prompt_tokens, event.completion_tokens) == (
                usage["prompt_tokens"],
                usage["completion_tokens"],
            )
            # vLLM's own counters moved by exactly what was billed.
            prompt_after = _totals(engines, "vllm:prompt_tokens_total")
            generated_after = _totals(engines, "vllm:generation_tokens_total")
            assert prompt_after - prompt_before == event.prompt_tokens
            assert generated_after - generated_before == event.completion_tokens
            # Judged on both clocks, streamed or not: vLLM's first token timed, a TPOT over
            # its tokens (this CPU engine may well miss 50 ms a token; it never fails).
            assert event.ttft_ms is not None and 0 < event.ttft_ms <= event.total_ms
            assert event.completion_tokens >= 2 and event.tpot_ms is not None
            assert event.slo_outcome in ("met", "ttft", "tpot")


def _call(
    client: openai.OpenAI, kind: str, body: dict[str, Any], *, stream: bool, **extra: Any
) -> tuple[dict[str, int], str]:
    """One request through the official client: its usage block and the gateway's id."""
    api = client.chat.completions if kind == "chat" else client.completions
    options: dict[str, Any] = {"model": TINY_MODEL, "max_tokens": 12, **body, **extra}
    if stream:
        options |= {"stream": True, "stream_options": {"include_usage": True}}
    raw = api.with_raw_response.create(**options)
    request_id = raw.headers["x-request-id"]
    parsed = raw.parse()
    if not stream:
        return parsed.usage.model_dump(include={"prompt_tokens", "completion_tokens"}), request_id
    chunks = list(parsed)
    assert chunks[-1].usage is not None, "include_usage: the last chunk carries the usage"
    return chunks[-1].usage.model_dump(include={"prompt_tokens", "completion_tokens"}), request_id


class _ChatAsk(TypedDict):
    """A chat request's arguments but the model."""

    messages: list[ChatCompletionMessageParam]
    max_tokens: int
    temperature: float


def test_seed_repeats_a_sample_and_stop_cuts_it_where_vllm_finds_the_string(
    real_fleet: RealFleet,
) -> None:
    client = _client(real_fleet)
    ask: CompletionCreateParamsNonStreaming = {
        "model": TINY_MODEL,
        "prompt": "The harbour at dawn",
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 1234,
    }

    first = client.completions.create(**ask).choices[0].text
    again = client.completions.create(**ask).choices[0].text
    assert first == again and len(first) > 12

    stop = first[len(first) // 2 : len(first) // 2 + 3]
    cut = client.completions.create(**(ask | {"stop": [stop]})).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == first[: first.index(stop)]


def test_an_adapter_is_called_by_name_and_served_by_vllm_with_its_own_weights(
    real_fleet: RealFleet,
) -> None:
    client = _client(real_fleet)
    (engine,) = real_fleet.engines()
    ask: _ChatAsk = {
        "messages": [{"role": "user", "content": "Ahoy there"}],
        "max_tokens": 8,
        "temperature": 0,
    }

    raw = client.chat.completions.with_raw_response.create(model=TINY_ADAPTER, **ask)
    adapted = raw.parse()
    base = client.chat.completions.create(model=TINY_MODEL, **ask)

    assert adapted.model == TINY_ADAPTER
    assert adapted.choices[0].message.content != base.choices[0].message.content
    event = _event(real_fleet, raw.headers["x-request-id"])
    assert (event.adapter, event.replica_id) == (TINY_ADAPTER, engine.replica_id)


def test_an_adapter_missing_from_the_engine_is_not_routed_there(real_fleet: RealFleet) -> None:
    """The adapter vanishes from the replica behind the routing table's back (as when an
    engine restarts): vLLM's own 404 tells the gateway, which then keeps adapter requests away
    from that replica (they never reach it) while the base model is served as before."""
    client = _client(real_fleet)
    (engine,) = real_fleet.engines()
    assert engine.post("/v1/unload_lora_adapter", {"lora_name": TINY_ADAPTER}).status_code == 200
    try:
        refused = engine.metric("http_requests_total", handler="/v1/chat/completions", status="4xx")
        for _ in range(3):
            with pytest.raises(openai.APIStatusError) as missing:
                client.chat.completions.create(
                    model=TINY_ADAPTER, messages=[{"role": "user", "content": "Ahoy"}], max_tokens=2
                )
            # Retry later: the node agent puts the adapter back (503 with Retry-After).
            assert missing.value.status_code == 503
            assert missing.value.response.headers["retry-after"]
            assert missing.value.body["code"] in {"model_not_loaded", "no_capacity"}  # type: ignore[index]
        # Only the first reached vLLM (and got its 404); the others were never sent there.
        after = engine.metric("http_requests_total", handler="/v1/chat/completions", status="4xx")
        assert after == refused + 1
        base = client.chat.completions.create(
            model=TINY_MODEL, messages=[{"role": "user", "content": "Ahoy"}], max_tokens=2
        )
        assert base.choices[0].message.content is not None
    finally:
        with real_fleet.db():
            path = replica_spec(Replica.objects.get(pk=engine.replica_id))["adapters"][0]["path"]
        body = {"lora_name": TINY_ADAPTER, "lora_path": engine_path(path)}
        assert engine.post("/v1/load_lora_adapter", body).status_code == 200


# --- telemetry -------------------------------------------------------------------------------


def test_telemetry_from_the_real_metrics_reaches_redis_and_the_routers_view(
    real_fleet: RealFleet,
) -> None:
    gateway = real_fleet.gateway.gateway()
    engine = real_fleet.engines()[0]
    body = {"model": TINY_MODEL, "prompt": "Go on and on", "max_tokens": 4000, "ignore_eos": True}
    # Long generations, so a heartbeat's scrape (every 2 s) finds them running. Two of 4,000
    # tokens take about 25 s alone on two cores, over 60 s in a loaded full suite: they get
    # their own deadline.
    with ThreadPoolExecutor(2) as pool:
        load = [pool.submit(engine.post, "/v1/completions", body, timeout_s=300) for _ in range(2)]

        def busy() -> dict[str, Any] | None:
            latest = telemetry.read_replica(real_fleet.redis, engine.replica_id) or {}
            return latest if latest.get("num_requests_running", 0) >= 1 else None

        latest = eventually(busy, 30, "the running requests in Redis")
        assert latest["kv_cache_usage_perc"] > 0.0
        # The router's own view takes the same numbers at its next telemetry refresh.
        eventually(
            lambda: (
                (gateway.routing.snapshot.state.replica(engine.replica_id) or _IDLE).running >= 1
            ),
            10,
            "the running requests in the router's view",
        )
        assert all(f.result(timeout=320).status_code == 200 for f in load)
    own = engine.metrics()

    def caught_up() -> dict[str, Any] | None:
        latest = telemetry.read_replica(real_fleet.redis, engine.replica_id) or {}
        done = latest.get("generation_tokens_total") == sample(own, "vllm:generation_tokens_total")
        return latest if done else None

    latest = eventually(caught_up, 15, "the final counters in Redis")
    for field, name in (
        ("prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
        ("prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
        ("num_requests_running", "vllm:num_requests_running"),
    ):
        assert latest[field] == sample(own, name), field
    assert latest["max_lora"] == 2
    routed = gateway.routing.snapshot.state.replica(engine.replica_id)
    assert routed is not None and TINY_ADAPTER in routed.adapters_loaded


_IDLE = SimpleNamespace(running=0)


@contextlib.contextmanager
def _streaming(fleet: RealFleet, max_tokens: int, tenant: str = "acme") -> Any:
    """A long raw SSE stream through the gateway: yields (request id, its lines)."""
    body = {
        "model": TINY_MODEL,
        "prompt": "Write forever",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {fleet.keys[tenant]}"}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{fleet.base_url}/completions", json=body, headers=headers) as reply,
    ):
        assert reply.status_code == 200
        yield reply.headers["x-request-id"], reply.iter_lines()


def _read_tokens(lines: Iterator[str], count: int) -> tuple[int, list[dict[str, Any]]]:
    """Read SSE events until `count` tokens came; returns the tokens read and any error events.
    Each chunk is one token, also one whose text is empty (it ended inside a UTF-8 sequence)."""
    tokens, errors = 0, []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = orjson.loads(line[6:])
        if "error" in chunk:
            errors.append(chunk)
            break
        if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
            tokens += 1
            if tokens >= count:
                break
    return tokens, errors


# --- disconnects and crashes -----------------------------------------------------------------


def test_a_client_that_disconnects_mid_stream_aborts_vllm_frees_its_lease_and_is_billed(
    real_fleet: RealFleet,
) -> None:
    engines = real_fleet.engines()
    finished = _totals(engines, "vllm:request_success_total")
    generated = _totals(engines, "vllm:generation_tokens_total")
    with _streaming(real_fleet, max_tokens=4000, tenant="initech") as (request_id, reply):
        delivered, _ = _read_tokens(reply, 1)
    # The connection is closed here, long before 4,000 tokens (seconds of decoding).

    eventually(lambda: _totals(engines, "vllm:num_requests_running") == 0, 20, "no request running")
    # vLLM aborted it: generation stopped far short of max_tokens. (vLLM 0.32 counts no finish
    # for an aborted request: request_success_total{finished_reason="abort"} stays as it was.)
    stopped_at = _totals(engines, "vllm:generation_tokens_total")
    time.sleep(1.0)
    assert _totals(engines, "vllm:generation_tokens_total") == stopped_at
    assert stopped_at - generated < 4000
    assert _totals(engines, "vllm:request_success_total") == finished
    event = _event(real_fleet, request_id)
    assert event.status == "client_cancelled"
    assert 0 < delivered <= event.completion_tokens <= stopped_at - generated
    # initech may hold one stream at a time: a new one is admitted, so the lease was freed.
    with _streaming(real_fleet, max_tokens=3, tenant="initech") as (_, reply):
        assert _read_tokens(reply, 1)[0] == 1


def test_a_vllm_killed_mid_stream_gives_an_error_event_bills_once_and_is_restarted(
    real_fleet: RealFleet,
) -> None:
    (victim,) = real_fleet.engines()
    with _streaming(real_fleet, max_tokens=4000) as (request_id, reply):
        delivered, _ = _read_tokens(reply, 5)
        os.killpg(victim.pid, signal.SIGKILL)
        more, errors = _read_tokens(reply, 10_000)

    assert errors, "the client gets an error event when the replica dies mid-stream"
    event = _event(real_fleet, request_id)
    assert event.status == "upstream_failed"
    assert event.completion_tokens == delivered + more
    time.sleep(1)
    assert sum(1 for rid in _events(real_fleet) if rid == request_id) == 1

    # The agent restarts it and it serves again.
    def restarted() -> list[Engine] | None:
        engines = real_fleet.engines()
        fresh = [e for e in engines if e.replica_id == victim.replica_id and e.pid != victim.pid]
        return engines if fresh else None

    eventually(restarted, 300, "the killed replica Ready again")
    real_fleet.wait_ready(1)
    fresh = real_fleet.engine(victim.replica_id)
    reply = fresh.post("/v1/completions", {"model": TINY_MODEL, "prompt": "again", "max_tokens": 3})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    with real_fleet.db():
        assert Replica.objects.get(pk=victim.replica_id).restarts >= 1
