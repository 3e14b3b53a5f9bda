"""The engine simulator through its HTTP interface, with the official openai client."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from serving.engine.tokens import estimate_prompt_tokens
from serving.enginesim import build_app, parse_args
from serving.enginesim.config import ConfigError

BASE_FLAGS = [
    "meta-llama/Llama-3.1-8B-Instruct",
    "--served-model-name",
    "llama8",
    "--max-model-len",
    "8192",
    "--sim-gpu-class",
    "L4-24GB",
]
FAST = ["--sim-time-scale", "50"]


@asynccontextmanager
async def simulator(*extra: str) -> AsyncIterator[str]:
    server = TestServer(build_app(parse_args([*BASE_FLAGS, *extra])), access_log=None)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def client(base: str, **kwargs: object) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, **kwargs)  # type: ignore[arg-type]


async def scrape(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as session, session.get(base + "/metrics") as resp:
        text = await resp.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(
    metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return sum(
        v for (n, lbls), v in metrics.items() if n == name and set(labels.items()) <= set(lbls)
    )


async def test_streaming_chat_is_framed_like_openai_with_a_final_usage_chunk() -> None:
    async with simulator(*FAST) as base:
        stream = await client(base).chat.completions.create(
            model="llama8",
            messages=[{"role": "user", "content": "Tell me a story"}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert len(text.split()) == 12


async def test_streaming_completion_ends_with_done() -> None:
    async with simulator(*FAST) as base, aiohttp.ClientSession() as session:
        body = {"model": "llama8", "prompt": "hi", "max_tokens": 3, "stream": True}
        async with session.post(base + "/v1/completions", json=body) as resp:
            raw = await resp.text()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert len(events) == 4  # three tokens, then [DONE]


async def test_a_non_streaming_completion_reports_usage_with_the_shared_estimate() -> None:
    prompt = "The quick brown fox jumps over the lazy dog " * 10
    async with simulator(*FAST) as base:
        reply = await client(base).completions.create(model="llama8", prompt=prompt, max_tokens=5)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == estimate_prompt_tokens(prompt)
    assert reply.usage.completion_tokens == 5


async def test_a_stop_string_ends_the_reply_with_finish_reason_stop() -> None:
    async with simulator(*FAST) as base:
        reply = await client(base).completions.create(
            model="llama8", prompt="hello", max_tokens=400, stop=[" the"], seed=3
        )
    assert reply.choices[0].finish_reason == "stop"
    assert " the" not in reply.choices[0].text


async def test_without_max_tokens_the_length_is_a_deterministic_eos() -> None:
    async with simulator("--sim-time-scale", "500") as base:
        api = client(base)
        first, second = [
            await api.chat.completions.create(
                model="llama8", messages=[{"role": "user", "content": "hi"}], seed=11
            )
            for _ in range(2)
        ]
    assert first.choices[0].finish_reason == "stop"
    assert first.choices[0].message.content == second.choices[0].message.content


async def test_with_stop_at_eos_max_tokens_caps_the_answer_and_eos_ends_it_first() -> None:
    """A real model stops at its EOS whatever max_tokens allows: with --sim-stop-at-eos the
    simulator does too (the same draw as without max_tokens), unless ignore_eos; without the
    flag a request given max_tokens writes exactly that many."""
    ask = {"model": "llama8", "messages": [{"role": "user", "content": "hi"}], "seed": 11}
    async with simulator("--sim-time-scale", "500", "--sim-stop-at-eos") as base:
        api = client(base)
        unbounded = await api.chat.completions.create(**ask)  # type: ignore[call-overload]
        capped = await api.chat.completions.create(**ask, max_tokens=4000)  # type: ignore[call-overload]
        short = await api.chat.completions.create(**ask, max_tokens=2)  # type: ignore[call-overload]
        ignoring = await api.chat.completions.create(  # type: ignore[call-overload]
            **ask, max_tokens=300, extra_body={"ignore_eos": True}
        )
    assert unbounded.usage is not None and capped.usage is not None
    eos = unbounded.usage.completion_tokens
    assert 2 < eos < 4000
    assert (capped.choices[0].finish_reason, capped.usage.completion_tokens) == ("stop", eos)
    assert capped.choices[0].message.content == unbounded.choices[0].message.content
    assert short.usage is not None
    assert (short.choices[0].finish_reason, short.usage.completion_tokens) == ("length", 2)
    assert ignoring.usage is not None
    assert (ignoring.choices[0].finish_reason, ignoring.usage.completion_tokens) == ("length", 300)
    async with simulator("--sim-time-scale", "500") as base:
        exact = await client(base).chat.completions.create(**ask, max_tokens=300)  # type: ignore[call-overload]
    assert exact.usage is not None
    assert (exact.choices[0].finish_reason, exact.usage.completion_tokens) == ("length", 300)


async def test_an_unknown_model_is_a_404_in_openai_shape() -> None:
    async with simulator(*FAST) as base:
        with pytest.raises(openai.NotFoundError) as caught:
            await client(base).completions.create(model="nope", prompt="x", max_tokens=1)
    assert caught.value.body["message"] == "The model `nope` does not exist. Valid aliases: llama8."  # type: ignore[index]


async def test_bad_input_is_a_400_with_an_error_object_not_a_traceback() -> None:
    url_body = {"model": "llama8"}
    async with (
        simulator(*FAST) as base,
        aiohttp.ClientSession() as session,
        session.post(base + "/v1/chat/completions", json=url_body) as resp,
    ):
        status, body = resp.status, await resp.json()
    assert status == 400
    assert body["error"]["type"] == "BadRequestError"


async def test_a_max_tokens_over_max_model_len_is_refused() -> None:
    async with simulator(*FAST) as base:
        with pytest.raises(openai.BadRequestError, match="cannot be greater than max_model_len"):
            await client(base).completions.create(model="llama8", prompt="x", max_tokens=9000)


async def test_a_prompt_longer_than_max_model_len_is_refused() -> None:
    async with simulator(*FAST, "--max-model-len", "256") as base:
        with pytest.raises(openai.BadRequestError, match="maximum context length is 256") as e:
            await client(base).completions.create(model="llama8", prompt="x " * 400, max_tokens=1)
    assert e.value.param == "input_tokens"


async def test_a_max_tokens_the_prompt_leaves_no_room_for_is_clamped_as_vllm_does() -> None:
    async with simulator(*FAST, "--max-model-len", "256") as base:
        reply = await client(base).completions.create(
            model="llama8", prompt="x " * 100, max_tokens=250, extra_body={"ignore_eos": True}
        )
    assert reply.usage is not None and reply.usage.total_tokens == 256
    assert reply.choices[0].finish_reason == "length"


async def test_metrics_use_vllm_names_and_labels() -> None:
    async with simulator(*FAST) as base:
        await client(base).completions.create(model="llama8", prompt="hello " * 50, max_tokens=4)
        metrics = await scrape(base)
    labels = {"model_name": "llama8", "engine": "0"}
    assert sample(metrics, "vllm:generation_tokens_total", **labels) == 4
    assert sample(metrics, "vllm:prompt_tokens_total", **labels) == estimate_prompt_tokens(
        "hello " * 50
    )
    assert sample(metrics, "vllm:request_success_total", finished_reason="length") == 1
    assert sample(metrics, "vllm:time_to_first_token_seconds_count", **labels) == 1
    assert sample(metrics, "vllm:inter_token_latency_seconds_count", **labels) == 3
    assert sample(metrics, "vllm:e2e_request_latency_seconds_count", **labels) == 1
    assert sample(metrics, "vllm:request_queue_time_seconds_count", **labels) == 1
    for gauge in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
    ):
        assert (gauge, tuple(sorted(labels.items()))) in metrics
    assert sample(metrics, "vllm:lora_requests_info", max_lora="1") > 1e9  # a timestamp


async def test_equal_prompts_hit_the_prefix_cache() -> None:
    prompt = "A long shared system prompt about the platform. " * 40
    async with simulator(*FAST) as base:
        api = client(base)
        await api.completions.create(model="llama8", prompt=prompt, max_tokens=2)
        await api.completions.create(model="llama8", prompt=prompt, max_tokens=2)
        metrics = await scrape(base)
    queries = sample(metrics, "vllm:prefix_cache_queries_total")
    hits = sample(metrics, "vllm:prefix_cache_hits_total")
    assert queries == 2 * estimate_prompt_tokens(prompt)
    assert hits > 0.4 * queries


async def test_a_client_disconnect_aborts_the_request_in_the_engine() -> None:
    async with simulator("--sim-time-scale", "2") as base:
        body = {"model": "llama8", "prompt": "hi", "max_tokens": 2000, "stream": True}
        async with (
            aiohttp.ClientSession() as session,
            session.post(base + "/v1/completions", json=body) as resp,
        ):
            await resp.content.readline()
            during = await scrape(base)
        await asyncio.sleep(0.3)
        after = await scrape(base)
    assert sample(during, "vllm:num_requests_running") == 1
    assert sample(after, "vllm:num_requests_running") == 0
    assert sample(after, "vllm:generation_tokens_total") < 2000
    # vLLM 0.32 counts no finish for an abandoned request, and neither does the simulator.
    assert sample(after, "vllm:request_success_total") == 0


async def test_lora_adapters_load_list_serve_and_unload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    async with simulator(*FAST, "--enable-lora", "--max-loras", "2") as base:
        async with aiohttp.ClientSession() as session:
            adapter = {"lora_name": "sql", "lora_path": "/adapters/sql"}
            async with session.post(base + "/v1/load_lora_adapter", json=adapter) as resp:
                assert resp.status == 200
            async with session.post(base + "/v1/load_lora_adapter", json=adapter) as resp:
                assert resp.status == 400
            models = await client(base).models.list()
            by_id = {m.id: m for m in models.data}
            assert by_id["sql"].parent == "llama8"  # type: ignore[attr-defined]
            reply = await client(base).completions.create(model="sql", prompt="x", max_tokens=2)
            assert reply.model == "sql"
            async with session.post(
                base + "/v1/unload_lora_adapter", json={"lora_name": "sql"}
            ) as resp:
                assert resp.status == 200
            async with session.post(
                base + "/v1/unload_lora_adapter", json={"lora_name": "sql"}
            ) as resp:
                assert resp.status == 404
        with pytest.raises(openai.NotFoundError):
            await client(base).completions.create(model="sql", prompt="x", max_tokens=2)


async def test_lora_endpoints_are_404_without_runtime_updating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    async with simulator(*FAST, "--enable-lora") as base, aiohttp.ClientSession() as session:
        body = {"lora_name": "sql", "lora_path": "/x"}
        async with session.post(base + "/v1/load_lora_adapter", json=body) as resp:
            assert resp.status == 404


async def test_error_rate_one_fails_every_request_with_a_500() -> None:
    async with simulator(*FAST, "--sim-error-rate", "1") as base:
        with pytest.raises(openai.InternalServerError):
            await client(base).completions.create(model="llama8", prompt="x", max_tokens=2)


async def test_the_error_status_sets_what_the_simulated_failures_answer() -> None:
    async with simulator(*FAST, "--sim-error-rate", "1", "--sim-error-status", "401") as base:
        with pytest.raises(openai.AuthenticationError) as raised:
            await client(base).completions.create(model="llama8", prompt="x", max_tokens=2)
    assert raised.value.body == {
        "message": "simulated engine failure",
        "type": "Unauthorized",
        "param": None,
        "code": 401,
    }


async def test_a_stream_failing_after_n_tokens_ends_with_vllms_error_event() -> None:
    body = {
        "model": "llama8",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 20,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        simulator(*FAST, "--sim-error-after-tokens", "3") as base,
        aiohttp.ClientSession() as session,
        session.post(base + "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200
        events = [e for e in (await resp.text()).split("\n\n") if e]
    # The role chunk, three tokens, the error (no usage chunk), [DONE].
    assert len(events) == 6
    assert events[-1] == "data: [DONE]"
    error = orjson.loads(events[-2].removeprefix("data: "))
    assert error == {
        "error": {
            "message": "simulated engine failure after 3 tokens",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }


async def test_the_openai_client_raises_on_the_mid_stream_error_event() -> None:
    async with simulator(*FAST, "--sim-error-after-tokens", "2") as base:
        stream = await client(base).completions.create(
            model="llama8", prompt="x", max_tokens=20, stream=True
        )
        texts: list[str] = []
        with pytest.raises(openai.APIError, match="simulated engine failure after 2 tokens"):
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
        metrics = await scrape(base)
    assert len(texts) == 2
    # The failed generation left the engine's batch.
    assert sample(metrics, "vllm:num_requests_running") == 0


async def test_a_non_streaming_generation_failing_after_n_tokens_is_an_error_status() -> None:
    async with simulator(
        *FAST, "--sim-error-after-tokens", "2", "--sim-error-status", "503"
    ) as base:
        with pytest.raises(openai.InternalServerError) as raised:
            await client(base).completions.create(model="llama8", prompt="x", max_tokens=20)
    assert raised.value.status_code == 503


def test_an_error_status_outside_400_to_599_is_refused() -> None:
    with pytest.raises(ValueError, match="--sim-error-status"):
        parse_args([*BASE_FLAGS, "--sim-error-status", "200"])


async def test_a_hung_engine_answers_health_but_never_generates() -> None:
    async with simulator(*FAST, "--sim-hang") as base:
        async with aiohttp.ClientSession() as session, session.get(base + "/health") as resp:
            assert resp.status == 200
        with pytest.raises(openai.APITimeoutError):
            await client(base, timeout=0.5).completions.create(
                model="llama8", prompt="x", max_tokens=2
            )


async def test_slow_start_answers_503_until_loaded() -> None:
    async with (
        simulator(*FAST, "--sim-slow-start", "0.5") as base,
        aiohttp.ClientSession() as session,
    ):
        async with session.get(base + "/health") as resp:
            assert resp.status == 503
        await asyncio.sleep(0.6)
        async with session.get(base + "/health") as resp:
            assert resp.status == 200


async def test_fixed_latency_mode_serves_many_concurrent_streams_on_time() -> None:
    body = {"model": "llama8", "prompt": "x", "max_tokens": 10, "stream": True}
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        simulator("--sim-fixed-ttft-ms", "300", "--sim-fixed-itl-ms", "20") as base,
        aiohttp.ClientSession(connector=connector) as session,
    ):

        async def one(i: int) -> tuple[float, int]:
            # A 0.3 s ramp, so the listen backlog (128) does not turn a SYN storm into 1 s retries.
            await asyncio.sleep(i / 1000)
            started = time.monotonic()
            async with session.post(base + "/v1/completions", json=body) as resp:
                events = [line async for line in resp.content if line.startswith(b"data: {")]
            return time.monotonic() - started, len(events)

        results = await asyncio.gather(*(one(i) for i in range(300)))
    durations = sorted(d for d, _ in results)
    ideal = 0.300 + 9 * 0.020
    assert {count for _, count in results} == {10}
    assert durations[0] >= ideal * 0.95
    # Served side by side, not one after another (that would take 144 s; ten at a time, 14 s):
    # the bound leaves room for a loaded machine (2.2 and 3.1 times ideal were seen in full
    # suites on two cores, where the client, the simulator and the suite share them).
    assert durations[len(durations) // 2] < ideal * 8


def test_a_prefill_budget_below_max_num_seqs_is_refused_as_vllm_refuses_it() -> None:
    with pytest.raises(ConfigError, match="must be greater than or equal to max_num_seqs"):
        parse_args([*BASE_FLAGS, "--max-num-batched-tokens", "128", "--max-num-seqs", "256"])
    assert (
        parse_args([*BASE_FLAGS, "--max-num-batched-tokens", "256"]).max_num_batched_tokens == 256
    )


def test_an_unknown_flag_is_an_error() -> None:
    with pytest.raises(SystemExit):
        parse_args([*BASE_FLAGS, "--not-a-vllm-flag"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_crash_after_tokens_kills_the_process_mid_stream() -> None:
    port = free_port()
    flags = [
        *BASE_FLAGS,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        *FAST,
        "--sim-crash-after-tokens",
        "5",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.enginesim", *flags], stderr=subprocess.PIPE
    )
    try:
        wait_for(lambda: _health(port), timeout=15)

        async def stream() -> int:
            seen = 0
            api = client(f"http://127.0.0.1:{port}")
            with pytest.raises(openai.APIError):  # the connection dies mid-stream
                s = await api.completions.create(
                    model="llama8", prompt="x", max_tokens=50, stream=True
                )
                async for _ in s:
                    seen += 1
            return seen

        seen = asyncio.run(stream())
        assert proc.wait(timeout=10) == 137
        assert seen <= 5
    finally:
        proc.kill()
        proc.wait()


def _health(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_for(ready: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.1)
    raise AssertionError("the simulator did not start")
