"""One set of protocol checks, run against real vLLM (a replica of the real fleet) and against
the engine simulator launched through the same argv builder: whatever the platform relies on
(SSE framing, the usage chunk, error shapes, /v1/models, LoRA answers, metric names and labels,
the engine key, aborts) must be the same on both, so the simulator cannot drift from vLLM.

The expectations are vLLM 0.32's answers as measured on its CPU build; the vllm parameter keeps
them honest, the simulator parameter keeps the simulator equal to them."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.actions.reconcile import replica_spec
from serving.agent.launch import LaunchSettings, build_launch_command, engine_path
from serving.agent.specs import parse_replica_spec
from serving.models import Replica
from tests.live import eventually
from tests.real_vllm.conftest import TINY_MODEL, RealFleet, sample

pytestmark = [pytest.mark.real_vllm, pytest.mark.slow, pytest.mark.django_db]

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = "demo-tiny-formal"  # built beside the fleet's adapter, loaded by no deployment
CHAT = {"model": TINY_MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}]}


@dataclass
class Target:
    kind: str
    url: str
    key: str
    adapter_path: str

    def post(self, path: str, body: Any, *, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.key if key is None else key}"}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=60)

    def get(self, path: str, *, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.key if key is None else key}"}
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=60)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=30).text


@pytest.fixture(scope="module", params=["vllm", "simulator"])
def target(
    request: pytest.FixtureRequest, real_fleet: RealFleet, tiny_model: Path
) -> Iterator[Target]:
    engine = real_fleet.engines()[0]
    adapter_path = str(tiny_model / "adapters" / ADAPTER)
    if request.param == "vllm":
        yield Target("vllm", engine.url, engine.key, adapter_path)
        return
    with real_fleet.db():
        replica = Replica.objects.select_related("node__pool__gpu_class").get(pk=engine.replica_id)
        raw = replica_spec(replica)
    port = _free_port()
    # The fleet replica's own spec; the simulator times it as a 1B model on an L4.
    raw |= {"port": port, "sim": {"gpu_class": "L4-24GB", "model_spec": "llama-3.2-1b"}}
    argv, env = build_launch_command(parse_replica_spec(raw), LaunchSettings(simulated=True))
    process = subprocess.Popen(
        argv,
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        eventually(lambda: _answers(f"{url}/health"), 30, "the simulator up")
        yield Target("simulator", url, str(raw["api_key"]), adapter_path)
    finally:
        process.kill()
        process.wait(timeout=10)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# --- the engine key --------------------------------------------------------------------------


def test_v1_routes_want_the_key_and_health_and_metrics_do_not(target: Target) -> None:
    for presented in ("", "Bearer wrong", target.key):  # the last: no "Bearer" scheme
        reply = httpx.get(f"{target.url}/v1/models", headers={"Authorization": presented})
        assert (reply.status_code, reply.json()) == (401, {"error": "Unauthorized"})
    refused = target.post("/v1/completions", {"model": TINY_MODEL, "prompt": "x"}, key="nope")
    assert refused.status_code == 401
    assert httpx.get(f"{target.url}/health").status_code == 200
    assert httpx.get(f"{target.url}/metrics").status_code == 200


# --- /v1/models --------------------------------------------------------------------------------


def test_models_lists_the_served_name_with_vllms_card(target: Target) -> None:
    listing = target.get("/v1/models").json()

    assert listing["object"] == "list"
    (card,) = [c for c in listing["data"] if c["id"] == TINY_MODEL]
    assert set(card) == {
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "parent",
        "max_model_len",
        "permission",
    }
    assert (card["object"], card["owned_by"], card["parent"]) == ("model", "vllm", None)
    assert card["max_model_len"] == 4096
    assert card["permission"][0]["object"] == "model_permission"


# --- streaming -------------------------------------------------------------------------------


def _events(raw: bytes) -> list[bytes]:
    assert b"\r" not in raw, "vLLM frames SSE with bare LF"
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    assert all(event.startswith(b"data: ") for event in events)
    return [event[6:] for event in events]


def test_a_streamed_chat_is_framed_as_vllm_frames_it(target: Target) -> None:
    body = {
        **CHAT,
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reply = target.post("/v1/chat/completions", body)

    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = _events(reply.content)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    *tokens, usage = chunks[1:]
    assert len(tokens) == 5
    assert [t["choices"][0]["finish_reason"] for t in tokens] == [None] * 4 + ["length"]
    assert usage["choices"] == []
    assert set(usage["usage"]) == {"prompt_tokens", "total_tokens", "completion_tokens"}
    assert usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5
    assert "system_fingerprint" in usage


def test_a_stream_without_include_usage_has_no_usage_chunk(target: Target) -> None:
    body = {"model": TINY_MODEL, "prompt": "Once", "max_tokens": 3, "stream": True}
    chunks = [orjson.loads(e) for e in _events(target.post("/v1/completions", body).content)[:-1]]

    assert all(c["choices"] and "usage" not in c for c in chunks)
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_non_streamed_answers_carry_vllms_fields(target: Target) -> None:
    chat = target.post("/v1/chat/completions", {**CHAT, "max_tokens": 4}).json()
    text = target.post("/v1/completions", {"model": TINY_MODEL, "prompt": "Hi", "max_tokens": 4})

    for answer, kind in ((chat, "chat.completion"), (text.json(), "text_completion")):
        assert answer["object"] == kind
        assert {
            "id",
            "object",
            "created",
            "model",
            "choices",
            "usage",
            "system_fingerprint",
            "kv_transfer_params",
        } <= set(answer)
        assert answer["kv_transfer_params"] is None  # no connector: always there, null
        assert set(answer["usage"]) == {
            "prompt_tokens",
            "total_tokens",
            "completion_tokens",
            "prompt_tokens_details",
            "completion_tokens_details",
        }
        choice = answer["choices"][0]
        assert {"index", "logprobs", "finish_reason", "stop_reason"} <= set(choice)
        assert (choice["finish_reason"], answer["usage"]["completion_tokens"]) == ("length", 4)
    assert chat["choices"][0]["message"]["role"] == "assistant"


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "err_type", "param", "message"),
    [
        (
            {"max_tokens": 0},
            400,
            "BadRequestError",
            "max_tokens",
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        ),
        (
            {"max_tokens": -1},
            400,
            "BadRequestError",
            "max_tokens",
            "max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)",
        ),
        (
            {"temperature": -1},
            400,
            "BadRequestError",
            "temperature",
            "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)",
        ),
        (
            {"max_tokens": 4097},
            400,
            "BadRequestError",
            "max_tokens",
            "max_tokens=4097 cannot be greater than max_model_len=4096. Please request fewer "
            "output tokens. (parameter=max_tokens, value=4097)",
        ),
        (
            {"model": "no-such-model"},
            404,
            "NotFoundError",
            "model",
            "The model `no-such-model` does not exist.",
        ),
        (
            {"cache_salt": ""},
            400,
            "BadRequestError",
            "cache_salt",
            "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)",
        ),
        (
            {"kv_transfer_params": "x"},
            400,
            "Bad Request",
            "body.kv_transfer_params",
            "1 validation error:\n  {'type': 'dict_type', 'loc': 'body.kv_transfer_params'",
        ),
        (
            {"prompt": "word " * 4200},
            400,
            "BadRequestError",
            "input_tokens",
            "This model's maximum context length is 4096 tokens.",
        ),
    ],
)
def test_bad_parameters_get_vllms_error_shape(
    target: Target, body: dict[str, Any], status: int, err_type: str, param: str, message: str
) -> None:
    reply = target.post("/v1/completions", {"model": TINY_MODEL, "prompt": "Hi", **body})

    assert reply.status_code == status
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (err_type, param, status)
    assert error["message"].startswith(message)


def test_a_prompt_that_leaves_too_little_room_has_its_max_tokens_clamped(target: Target) -> None:
    # vLLM 0.32 answers 200 and stops at the context's end rather than refusing.
    prompt = target.post(
        "/v1/completions", {"model": TINY_MODEL, "prompt": "word " * 3000, "max_tokens": 1}
    )
    used = prompt.json()["usage"]["prompt_tokens"]
    reply = target.post(
        "/v1/completions",
        {
            "model": TINY_MODEL,
            "prompt": "word " * 3000,
            "max_tokens": 4096 - used + 50,
            "ignore_eos": True,
        },
    )

    assert reply.status_code == 200
    assert reply.json()["usage"]["total_tokens"] == 4096
    assert reply.json()["choices"][0]["finish_reason"] == "length"


# --- LoRA --------------------------------------------------------------------------------------


def test_lora_load_and_unload_answer_as_vllm_does(target: Target) -> None:
    path = engine_path(target.adapter_path)
    load = {"lora_name": ADAPTER, "lora_path": path}

    loaded = target.post("/v1/load_lora_adapter", load)
    again = target.post("/v1/load_lora_adapter", load)
    listed = [c for c in target.get("/v1/models").json()["data"] if c["id"] == ADAPTER]
    served = target.post("/v1/completions", {"model": ADAPTER, "prompt": "Hi", "max_tokens": 2})
    unloaded = target.post("/v1/unload_lora_adapter", {"lora_name": ADAPTER})
    gone = target.post("/v1/unload_lora_adapter", {"lora_name": ADAPTER})
    after = target.post("/v1/completions", {"model": ADAPTER, "prompt": "Hi", "max_tokens": 2})

    assert (loaded.status_code, loaded.text) == (
        200,
        f"Success: LoRA adapter '{ADAPTER}' added successfully.",
    )
    assert again.status_code == 400
    assert again.json()["error"]["type"] == "InvalidUserInput"
    assert again.json()["error"]["message"].startswith(
        f"The lora adapter '{ADAPTER}' has already been loaded."
    )
    assert [(c["parent"], c["root"], c["max_model_len"]) for c in listed] == [
        (TINY_MODEL, path, None)
    ]
    assert served.status_code == 200 and served.json()["model"] == ADAPTER
    assert (unloaded.status_code, unloaded.text) == (
        200,
        f"Success: LoRA adapter '{ADAPTER}' removed successfully.",
    )
    assert gone.status_code == 404
    assert gone.json()["error"] == {
        "message": f"The lora adapter '{ADAPTER}' cannot be found.",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }
    assert after.status_code == 404
    assert after.json()["error"]["message"].startswith(f"The model `{ADAPTER}` does not exist.")


# --- metrics ---------------------------------------------------------------------------------

BASE_LABELS = {"engine", "model_name"}
# What the agent, the router and the dashboards read, with vLLM's types and label names.
READ_METRICS: dict[str, tuple[str, set[str]]] = {
    "vllm:num_requests_running": ("gauge", BASE_LABELS),
    "vllm:num_requests_waiting": ("gauge", BASE_LABELS),
    "vllm:kv_cache_usage_perc": ("gauge", BASE_LABELS),
    "vllm:prefix_cache_queries": ("counter", BASE_LABELS),
    "vllm:prefix_cache_hits": ("counter", BASE_LABELS),
    "vllm:prompt_tokens": ("counter", BASE_LABELS),
    "vllm:prompt_tokens_by_source": ("counter", BASE_LABELS | {"source"}),
    "vllm:prompt_tokens_cached": ("counter", BASE_LABELS),
    "vllm:generation_tokens": ("counter", BASE_LABELS),
    "vllm:num_preemptions": ("counter", BASE_LABELS),
    "vllm:request_success": ("counter", BASE_LABELS | {"finished_reason"}),
    "vllm:lora_requests_info": (
        "gauge",
        {"max_lora", "running_lora_adapters", "waiting_lora_adapters"},
    ),
    "vllm:time_to_first_token_seconds": ("histogram", BASE_LABELS | {"le"}),
    "vllm:inter_token_latency_seconds": ("histogram", BASE_LABELS | {"le"}),
    "vllm:e2e_request_latency_seconds": ("histogram", BASE_LABELS | {"le"}),
    "vllm:request_queue_time_seconds": ("histogram", BASE_LABELS | {"le"}),
}


def test_the_metrics_the_platform_reads_have_vllms_names_types_and_labels(target: Target) -> None:
    target.post("/v1/completions", {"model": TINY_MODEL, "prompt": "Hi", "max_tokens": 2})
    families = {f.name: f for f in text_string_to_metric_families(target.metrics())}

    for name, (kind, labels) in READ_METRICS.items():
        assert name in families, name
        family = families[name]
        assert family.type == kind, name
        samples = [s for s in family.samples if not s.name.endswith("_created")]
        assert samples, name
        assert {frozenset(s.labels) for s in samples} == {frozenset(labels)} or kind == "histogram"
        if kind == "histogram":
            assert {frozenset(s.labels) for s in samples if s.name.endswith("_bucket")} == {
                frozenset(labels)
            }, name
    sources = {s.labels["source"] for s in families["vllm:prompt_tokens_by_source"].samples}
    assert sources == {"local_compute", "local_cache_hit", "external_kv_transfer"}
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert {"stop", "length", "abort", "error", "repetition"} <= reasons
    assert {s.labels["model_name"] for s in families["vllm:num_requests_running"].samples} == {
        TINY_MODEL
    }


def test_a_client_that_leaves_mid_stream_is_aborted_and_counted_as_no_finish(
    target: Target,
) -> None:
    finished = sample(target.metrics(), "vllm:request_success_total")
    body = {
        "model": TINY_MODEL,
        "prompt": "Go on",
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {target.key}"}
    with httpx.stream("POST", f"{target.url}/v1/completions", json=body, headers=headers) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                break
    eventually(lambda: sample(target.metrics(), "vllm:num_requests_running") == 0, 20, "the abort")
    generated = sample(target.metrics(), "vllm:generation_tokens_total")
    eventually(
        lambda: sample(target.metrics(), "vllm:generation_tokens_total") == generated,
        5,
        "generation stopped",
    )
    assert sample(target.metrics(), "vllm:request_success_total") == finished


def test_a_text_part_that_is_not_a_string_is_a_400_not_a_500(target: Target) -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]}

    reply = target.post("/v1/chat/completions", body)

    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "BadRequestError"
