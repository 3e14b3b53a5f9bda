"""Disaggregated prefill and decode through the simulator's HTTP interface, driven the way
vLLM's disaggregated proxy (toy_proxy_server.py) and llm-d drive NixlConnector engines."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from serving.engine.tokens import estimate_prompt_tokens
from tests.serving.test_enginesim import FAST, sample, scrape, simulator

NIXL = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
# A long prompt, so prefill dominates its time to first token.
PROMPT = "The tide rolls over the harbour wall at dusk. " * 300
# What the proxy asks of the prefill engine.
TO_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
BLOCK = 16  # the simulator's KV block, vLLM's GPU default
# Slow enough that the prompt's prefill (~0.15 s of wall time) dwarfs event-loop jitter.
CLOSE_TIMING = ["--sim-time-scale", "5"]


async def post(base: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(base + path, json=body) as resp:
        return resp.status, await resp.json()


async def prefill(base: str, prompt: str = PROMPT) -> dict[str, Any]:
    status, answer = await post(
        base,
        "/v1/completions",
        {
            "model": "llama8",
            "prompt": prompt,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": TO_PREFILL,
        },
    )
    assert status == 200, answer
    return answer


async def decode(base: str, kv_transfer_params: dict[str, Any] | None) -> None:
    """The original request, streamed, as the proxy sends it on."""
    body: dict[str, Any] = {"model": "llama8", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    async with (
        aiohttp.ClientSession() as session,
        session.post(base + "/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200
        assert (await resp.text()).endswith("data: [DONE]\n\n")


async def test_a_nixl_prefill_answers_where_its_kv_lies_as_vllms_connector_words_it() -> None:
    flags = ["--kv-transfer-config", NIXL, "--port", "8123", *FAST]
    async with simulator(*flags) as base:
        answer = await prefill(base)
        again = await prefill(base)

    params = answer["kv_transfer_params"]
    prompt_tokens = estimate_prompt_tokens(PROMPT)
    assert answer["usage"]["completion_tokens"] == 1
    assert list(params) == [
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "dcp_size",
        "pp_size",
        "remote_num_tokens",
        "remote_blocks_expiry_time",
        "transfer_mode",
        "remote_prefill_cached_tokens",
    ]
    assert (params["do_remote_prefill"], params["do_remote_decode"]) == (True, False)
    (blocks,) = params["remote_block_ids"]
    assert len(blocks) == -(-prompt_tokens // BLOCK)
    assert len(set(blocks)) == len(blocks) and 0 not in blocks
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 8123)
    assert params["remote_request_id"].startswith(answer["id"] + "-0-")
    assert (params["tp_size"], params["remote_num_tokens"]) == (1, prompt_tokens)
    assert (params["transfer_mode"], params["remote_prefill_cached_tokens"]) == ("pull", 0)
    # The same engine names itself alike each time; the second prompt hit the prefix cache.
    assert again["kv_transfer_params"]["remote_engine_id"] == params["remote_engine_id"]
    cached = again["kv_transfer_params"]["remote_prefill_cached_tokens"]
    assert cached == (prompt_tokens - 1) // BLOCK * BLOCK


async def test_a_request_without_do_remote_decode_answers_null_params() -> None:
    async with simulator("--kv-transfer-config", NIXL, *FAST) as base:
        status, answer = await post(
            base, "/v1/completions", {"model": "llama8", "prompt": "Hi", "max_tokens": 2}
        )
    assert status == 200
    assert "kv_transfer_params" in answer and answer["kv_transfer_params"] is None


async def test_an_example_connector_prefill_answers_null_params(tmp_path: Any) -> None:
    config = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    async with simulator("--kv-transfer-config", json.dumps(config), *FAST) as base:
        answer = await prefill(base)
    assert answer["kv_transfer_params"] is None


async def test_a_decode_given_the_prefills_params_loads_the_prompt_and_answers_sooner() -> None:
    consumer = [
        "--kv-transfer-config",
        json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}),
    ]
    async with (
        simulator("--kv-transfer-config", NIXL, *FAST) as producer,
        simulator(*consumer, *CLOSE_TIMING) as loading,
        simulator(*consumer, *CLOSE_TIMING) as computing,
    ):
        params = (await prefill(producer))["kv_transfer_params"]
        await decode(loading, params)
        await decode(computing, None)
        loaded, computed = await scrape(loading), await scrape(computing)

    prompt_tokens = estimate_prompt_tokens(PROMPT)
    by_source = "vllm:prompt_tokens_by_source_total"
    # vLLM's NIXL decode side loads every prompt token (and recomputes only the last).
    assert sample(loaded, by_source, source="external_kv_transfer") == prompt_tokens
    assert sample(loaded, by_source, source="local_compute") == 0
    assert sample(computed, by_source, source="external_kv_transfer") == 0
    assert sample(computed, by_source, source="local_compute") == prompt_tokens
    assert sample(loaded, "vllm:prompt_tokens_cached_total") == prompt_tokens
    ttft = "vllm:time_to_first_token_seconds_sum"
    assert sample(loaded, ttft) < sample(computed, ttft)


async def test_remote_prefill_params_on_an_engine_without_a_connector_are_served_whole() -> None:
    async with simulator("--kv-transfer-config", NIXL, *FAST) as producer:
        params = (await prefill(producer))["kv_transfer_params"]
    async with simulator(*FAST) as base:
        await decode(base, params)
        metrics = await scrape(base)
    by_source = "vllm:prompt_tokens_by_source_total"
    assert sample(metrics, by_source, source="external_kv_transfer") == 0
    assert sample(metrics, by_source, source="local_compute") == estimate_prompt_tokens(PROMPT)


@pytest.mark.parametrize(
    ("value", "shown"),
    [("x", "'x'"), (7, "'7'"), ([1, 2], "'<list of 2 items>'"), (True, "'True'")],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_kv_transfer_params_that_are_not_an_object_are_vllms_validation_400(
    path: str, value: object, shown: str
) -> None:
    body = {
        "model": "llama8",
        "prompt": "Hi",
        "messages": [{"role": "user", "content": "Hi"}],
        "kv_transfer_params": value,
    }
    async with simulator("--kv-transfer-config", NIXL, *FAST) as base:
        status, answer = await post(base, path, body)

    assert status == 400
    assert answer == {
        "error": {
            "message": "1 validation error:\n  {'type': 'dict_type', 'loc': "
            "'body.kv_transfer_params', 'msg': 'Input should be a valid dictionary', "
            f"'input': {shown}}}",
            "type": "Bad Request",
            "param": "body.kv_transfer_params",
            "code": 400,
        }
    }
