"""The aiohttp server: vLLM's OpenAI-compatible endpoints over the engine model.

One asyncio task steps the Engine in real time: it runs a step, sleeps until the step's end
(virtual seconds / time scale), then hands each request's new token to that request's queue.
Handlers turn queue items into SSE chunks or a JSON body. Latency histograms observe engine
seconds, i.e. what the modelled GPU would show; at --sim-time-scale 1 that is wall-clock time.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import random
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from serving.engine.core import Engine, EngineRequest, StepResult
from serving.engine.perf import PerfModel
from serving.engine.tokens import (
    estimate_prompt_tokens,
    prompt_block_hashes,
    render_chat_prompt,
)
from serving.enginesim.config import ConfigError, SimConfig, parse_args
from serving.enginesim.kv_transfer import (
    hands_off_to_decode,
    loads_remote_prefill,
    prefill_handoff,
)
from serving.enginesim.metrics import EngineMetrics
from serving.enginesim.text import eos_length, next_word, request_rng

CRASH_EXIT_CODE = 137  # what a SIGKILLed vLLM reports


@dataclass(slots=True)
class Emission:
    tokens: int
    finish_reason: str | None
    # On a request's first emission: prompt tokens it did not compute (cache hits, KV loaded).
    cached_tokens: int = 0


@dataclass(slots=True)
class _Tracked:
    queue: asyncio.Queue[Emission]
    arrival_s: float
    last_token_s: float | None = None


class EngineRunner:
    """Owns the Engine and the task that steps it on the wall clock."""

    def __init__(self, config: SimConfig, metrics: EngineMetrics) -> None:
        perf = PerfModel(
            config.gpu,
            config.model_spec,
            quantization=config.quantization,
            tensor_parallel=config.tensor_parallel_size,
            kv_cache_dtype=config.kv_cache_dtype,
            gpu_memory_utilization=config.gpu_memory_utilization,
        )
        self.engine = Engine(
            perf,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            max_loras=config.max_loras if config.enable_lora else 0,
        )
        self.time_scale = config.time_scale
        self.metrics = metrics
        self._tracked: dict[str, _Tracked] = {}
        self._wakeup = asyncio.Event()
        self._origin = time.monotonic()

    def now_s(self) -> float:
        """Engine (virtual) seconds since start."""
        return (time.monotonic() - self._origin) * self.time_scale

    def submit(self, request: EngineRequest) -> asyncio.Queue[Emission]:
        self.engine.add_request(request)
        tracked = _Tracked(asyncio.Queue(), request.arrival_s)
        self._tracked[request.request_id] = tracked
        self._wakeup.set()
        return tracked.queue

    def finish_early(self, request_id: str, reason: str) -> None:
        """The client went away ("abort") or a stop string matched ("stop"). vLLM 0.32 counts
        no finish for an abandoned request (request_success_total{finished_reason="abort"} and
        the e2e histogram stay as they were), so neither does the simulator."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None and self.engine.abort(request_id) and reason != "abort":
            self.metrics.observe_finish(reason, self.now_s() - tracked.arrival_s)

    async def run(self) -> None:
        while True:
            if not self.engine.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            result = self.engine.step(self.now_s())
            delay = self._origin + result.ended_s / self.time_scale - time.monotonic()
            await asyncio.sleep(max(0.0, delay))  # always yield, even when running behind
            self._deliver(result)

    def _deliver(self, result: StepResult) -> None:
        end = result.ended_s
        for queued_s in result.queue_time_s.values():
            self.metrics.observe_queue(queued_s)
        reasons = dict(result.finished)
        for rid, count in result.tokens.items():
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue  # aborted while the step ran
            if tracked.last_token_s is None:
                self.metrics.observe_first_token(end - tracked.arrival_s)
            else:
                self.metrics.observe_token_gap(end - tracked.last_token_s)
            tracked.last_token_s = end
            reason = reasons.get(rid)
            cached = result.cached_prompt_tokens.get(rid, 0)
            tracked.queue.put_nowait(Emission(count, reason, cached))
            if reason is not None:
                del self._tracked[rid]
                self.metrics.observe_finish(reason, end - tracked.arrival_s)


# --- request parsing ------------------------------------------------------------------------


class ApiError(Exception):
    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def _error_body(error: ApiError) -> dict[str, Any]:
    # vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}}.
    return {
        "error": {
            "message": error.message,
            "type": error.err_type,
            "param": error.param,
            "code": error.status,
        }
    }


def error_response(error: ApiError) -> web.Response:
    return web.json_response(_error_body(error), status=error.status, dumps=_dumps)


# vLLM's error types by status, for the simulated failures.
SIMULATED_ERROR_TYPES = {
    400: "BadRequestError",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFoundError",
    429: "TooManyRequests",
    503: "ServiceUnavailableError",
}


def simulated_error(config: SimConfig, message: str) -> ApiError:
    status = config.error_status
    fallback = "InternalServerError" if status >= 500 else "BadRequestError"
    return ApiError(status, message, SIMULATED_ERROR_TYPES.get(status, fallback))


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


@dataclass(slots=True)
class Generation:
    kind: str  # "chat" or "completion"
    model: str
    lora: str | None
    prompt_text: str
    prompt_tokens: int
    max_tokens: int
    stop_after: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    seed: int | None
    # vLLM's per-request prefix-cache salt: equal prompts under other salts share no block.
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id


def _chat_prompt(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    pairs: list[tuple[str, str]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("each message needs a string 'role'", "messages")
        content = message.get("content")
        if isinstance(content, list):
            texts = [part.get("text", "") for part in content if isinstance(part, dict)]
            if not all(isinstance(text, str) for text in texts):
                # vLLM refuses it with a 400 (its message lists each part type's complaint).
                raise bad_request("a text content part needs a string 'text'")
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad_request("message 'content' must be a string or a list of parts", "messages")
        pairs.append((message["role"], content))
    return render_chat_prompt(pairs)


def _completion_prompt(body: dict[str, Any]) -> tuple[str, int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, estimate_prompt_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt)), len(prompt)  # token ids: count them exactly
    raise bad_request("'prompt' must be a string, a list of one string, or token ids", "prompt")


def _int_field(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_request(f"'{name}' must be an integer", name)
    if value < minimum:
        # vLLM's wording (vllm/sampling_params.py), parameter and value appended.
        raise bad_request(
            f"{name} must be at least {minimum}, got {value}. (parameter={name}, value={value})",
            name,
        )
    return value


def _check_temperature(body: dict[str, Any]) -> None:
    value = body.get("temperature")
    if value is None:
        return
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise bad_request("'temperature' must be a number", "temperature")
    if value < 0:
        raise bad_request(
            f"temperature must be non-negative, got {float(value)}. "
            f"(parameter=temperature, value={float(value)})",
            "temperature",
        )


def _kv_transfer_params(body: dict[str, Any]) -> dict[str, Any] | None:
    value = body.get("kv_transfer_params")
    if value is None or isinstance(value, dict):
        return value
    # vLLM's pydantic body validation (dict[str, Any] | None), as its handler words it
    # (vllm/entrypoints/serve/exception_handling/handlers/validation.py).
    shown = f"<list of {len(value)} items>" if isinstance(value, list) else str(value)
    error = {
        "type": "dict_type",
        "loc": "body.kv_transfer_params",
        "msg": "Input should be a valid dictionary",
        "input": shown[:200] + "...[truncated]" if len(shown) > 200 else shown,
    }
    raise ApiError(400, f"1 validation error:\n  {error}", "Bad Request", "body.kv_transfer_params")


def parse_generation(kind: str, body: Any, state: ServerState) -> Generation:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    kv_transfer_params = _kv_transfer_params(body)  # the body's schema comes first in vLLM
    model = body.get("model")
    config = state.config
    if model is None:
        model = config.served_model_name
    if model not in config.served_model_names and model not in state.loras:
        aliases = ", ".join(config.served_model_names)
        raise ApiError(
            404,
            f"The model `{model}` does not exist. Valid aliases: {aliases}.",
            "NotFoundError",
            "model",
        )
    lora = model if model in state.loras else None
    if kind == "chat":
        text = _chat_prompt(body)
        prompt_tokens = estimate_prompt_tokens(text)
        max_tokens = _int_field(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens", 1)
    else:
        text, prompt_tokens = _completion_prompt(body)
        max_tokens = _int_field(body, "max_tokens", 1)
    if (_int_field(body, "n", 1) or 1) != 1:
        raise bad_request("the engine simulator supports n = 1 only", "n")
    seed = _int_field(body, "seed", -(2**63))
    _check_temperature(body)
    limit = config.max_model_len - prompt_tokens
    if limit <= 0:
        over = config.max_model_len + 1
        raise bad_request(
            f"This model's maximum context length is {config.max_model_len} tokens. However, "
            f"your prompt contains at least {over} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={over})",
            "input_tokens",
        )
    if max_tokens is not None and max_tokens > config.max_model_len:
        raise bad_request(
            f"max_tokens={max_tokens} cannot be greater than max_model_len="
            f"{config.max_model_len}. Please request fewer output tokens. "
            f"(parameter=max_tokens, value={max_tokens})",
            "max_tokens",
        )
    stop_after: int | None = None
    asked = max_tokens
    # vLLM 0.32 clamps a max_tokens the context cannot hold to the room left, silently; its
    # default is the rest of the context.
    max_tokens = limit if max_tokens is None else min(max_tokens, limit)
    if (asked is None or config.stop_at_eos) and not body.get("ignore_eos"):
        # EOS usually comes far earlier than the rest of the context; where it would come
        # at max_tokens or later, max_tokens ends the answer ("length").
        drawn = eos_length(request_rng(seed, text), max_tokens)
        stop_after = drawn if asked is None or drawn < max_tokens else None
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (
        not isinstance(cache_salt, str) or not 1 <= len(cache_salt) <= 1024
    ):
        raise bad_request(
            "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)",
            "cache_salt",
        )
    return Generation(
        kind=kind,
        model=model,
        lora=lora,
        prompt_text=text,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stop_after=stop_after,
        stop=[s for s in stop if s],
        stream=bool(body.get("stream")),
        include_usage=bool(options.get("include_usage")),
        seed=seed,
        cache_salt=cache_salt,
        kv_transfer_params=kv_transfer_params,
    )


# --- token sources --------------------------------------------------------------------------


async def engine_tokens(state: ServerState, gen: Generation) -> AsyncGenerator[Emission, None]:
    runner = state.runner
    assert runner is not None
    remote = loads_remote_prefill(state.config.kv_transfer, gen.kv_transfer_params)
    request = EngineRequest(
        request_id=gen.request_id,
        prompt_tokens=gen.prompt_tokens,
        max_tokens=gen.max_tokens,
        arrival_s=runner.now_s(),
        block_hashes=prompt_block_hashes(gen.prompt_text, salt=_cache_salt(gen)),
        lora=gen.lora,
        stop_after=gen.stop_after,
        external_tokens=gen.prompt_tokens if remote else 0,
    )
    queue = runner.submit(request)
    finished = False
    try:
        while not finished:
            emission = await queue.get()
            finished = emission.finish_reason is not None
            yield emission
    finally:
        if not finished:
            # The client left, or the reply stopped on a stop string: free the batch slot.
            runner.finish_early(gen.request_id, "abort")


def _cache_salt(gen: Generation) -> str:
    # Adapter weights change the KV of equal text, so the adapter is part of the salt too.
    adapter = gen.lora or ""
    return adapter if gen.cache_salt is None else f"{gen.cache_salt}\x00{adapter}"


async def fixed_latency_tokens(
    state: ServerState, gen: Generation
) -> AsyncGenerator[Emission, None]:
    """Exact TTFT and ITL, no engine model: tokens at absolute deadlines, so no drift."""
    config = state.config
    assert config.fixed_ttft_ms is not None and config.fixed_itl_ms is not None
    count = gen.stop_after if gen.stop_after is not None else gen.max_tokens
    reason = "stop" if gen.stop_after is not None else "length"
    ttft_s, itl_s = config.fixed_ttft_ms / 1000, config.fixed_itl_ms / 1000
    start = time.monotonic()
    state.fixed_active += 1
    metrics = state.metrics
    try:
        for i in range(count):
            deadline = start + ttft_s + i * itl_s
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            if i == 0:
                metrics.observe_first_token(ttft_s)
                metrics.add_tokens(gen.prompt_tokens, 0)
            else:
                metrics.observe_token_gap(itl_s)
            metrics.add_tokens(0, 1)
            last = i == count - 1
            if last:
                metrics.observe_finish(reason, time.monotonic() - start)
            yield Emission(1, reason if last else None)
    finally:
        state.fixed_active -= 1


# --- server state and handlers --------------------------------------------------------------


class ServerState:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.metrics = EngineMetrics(config.served_model_name, config.max_loras)
        # Built here, not at start-up, so a KV cache too small for max_model_len stops the
        # process before it binds its port, as vLLM does.
        self.runner: EngineRunner | None = (
            None if config.fixed_latency else EngineRunner(config, self.metrics)
        )
        self.loras: dict[str, str] = {}
        self.created = int(time.time())
        self.ready_at = time.monotonic() + config.slow_start_s
        self.tokens_emitted = 0
        self.fixed_active = 0
        self.rng = random.Random(config.seed)
        self._task: asyncio.Task[None] | None = None
        self._next_block_id = 1

    def handoff(self, gen: Generation, cached_tokens: int) -> dict[str, Any] | None:
        """The kv_transfer_params a finished, non-streamed request answers."""
        kv_transfer = self.config.kv_transfer
        if kv_transfer is None or not hands_off_to_decode(kv_transfer, gen.kv_transfer_params):
            return None
        block_size = self.runner.engine.block_size if self.runner is not None else 16
        # vLLM's completions name their one prompt "<id>-0"; its engine appends 8 characters.
        external_id = gen.response_id + ("-0" if gen.kind == "completion" else "")
        return prefill_handoff(
            kv_transfer,
            request_id=f"{external_id}-{uuid.uuid4().hex[:8]}",
            prompt_tokens=gen.prompt_tokens,
            cached_tokens=cached_tokens,
            block_ids=self._block_ids(-(-gen.prompt_tokens // block_size)),
            tensor_parallel_size=self.config.tensor_parallel_size,
        )

    def _block_ids(self, count: int) -> list[int]:
        # The engine model counts blocks without naming them; these stand in, from 1 up
        # (vLLM's block 0 is its null block), wrapping at the cache's size.
        total = self.runner.engine.total_blocks if self.runner is not None else 1 << 16
        first = self._next_block_id
        self._next_block_id = (first - 1 + count) % (total - 1) + 1
        return [(first - 1 + i) % (total - 1) + 1 for i in range(count)]

    def ready(self) -> bool:
        return time.monotonic() >= self.ready_at

    def count_emitted(self, tokens: int) -> None:
        self.tokens_emitted += tokens
        limit = self.config.crash_after_tokens
        if limit is not None and self.tokens_emitted >= limit:
            # A hard crash, like a GPU fault: no cleanup, no response end, sockets reset.
            sys.stderr.write(f"enginesim: crashing after {self.tokens_emitted} tokens\n")
            sys.stderr.flush()
            os._exit(CRASH_EXIT_CODE)

    def tokens(self, gen: Generation) -> AsyncGenerator[Emission, None]:
        if self.config.fixed_latency:
            return fixed_latency_tokens(self, gen)
        return engine_tokens(self, gen)


STATE = web.AppKey("state", ServerState)
# vLLM's is "vllm-<version>-<hash>"; the simulator says what it is.
SYSTEM_FINGERPRINT = "enginesim-vllm-0.32.0"


def _chunk(gen: Generation, created: int, choice: dict[str, Any] | None) -> bytes:
    obj: dict[str, Any] = {
        "id": gen.response_id,
        "object": "chat.completion.chunk" if gen.kind == "chat" else "text_completion",
        "created": created,
        "model": gen.model,
        "choices": [] if choice is None else [choice],
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _usage(gen: Generation, completion_tokens: int, *, details: bool) -> dict[str, Any]:
    """vLLM's usage block: the non-streamed one also names its (empty) details."""
    usage: dict[str, Any] = {
        "prompt_tokens": gen.prompt_tokens,
        "total_tokens": gen.prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if details:
        usage |= {"prompt_tokens_details": None, "completion_tokens_details": None}
    return usage


def _choice(
    gen: Generation, text: str, finish_reason: str | None, stop_reason: str | None
) -> dict[str, Any]:
    if gen.kind == "chat":
        return {
            "index": 0,
            "delta": {"content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
    return {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


class _Reply:
    """Turns emissions into text, applying stop strings."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        self.rng = request_rng(gen.seed, gen.prompt_text)
        self.text = ""
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self.cached_tokens = 0

    def add(self, emission: Emission) -> str:
        """The new text of this emission ("" once a stop string has matched)."""
        if not self.completion_tokens:
            self.cached_tokens = emission.cached_tokens
        piece = "".join(next_word(self.rng) for _ in range(emission.tokens))
        self.completion_tokens += emission.tokens
        before = len(self.text)
        self.text += piece
        for stop in self.gen.stop:
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at != -1:
                self.text = self.text[:at]
                self.finish_reason, self.stop_reason = "stop", stop
                return self.text[before:]
        self.finish_reason = emission.finish_reason
        return piece


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        body = await request.json(loads=orjson.loads)
    except ValueError:
        return error_response(bad_request("the request body is not valid JSON"))
    try:
        gen = parse_generation(kind, body, state)
    except ApiError as error:
        return error_response(error)
    if not state.ready():
        return error_response(
            ApiError(503, "the engine is still starting", "ServiceUnavailableError")
        )
    if state.config.hang:
        await asyncio.Future()  # a wedged engine: the connection stays open, nothing comes
    if state.config.error_rate and state.rng.random() < state.config.error_rate:
        return error_response(simulated_error(state.config, "simulated engine failure"))
    poison = state.config.error_on_text
    if poison is not None and poison in gen.prompt_text:
        return error_response(simulated_error(state.config, "simulated failure on this prompt"))
    if gen.stream:
        return await _stream(request, state, gen)
    return await _complete(state, gen)


async def _stream(request: web.Request, state: ServerState, gen: Generation) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    created = int(time.time())
    reply = _Reply(gen)
    fail_after = state.config.error_after_tokens
    failed = False
    tokens = state.tokens(gen)
    try:
        async for emission in tokens:
            if fail_after is not None and reply.completion_tokens >= fail_after:
                failed = True
                break
            if gen.kind == "chat" and reply.completion_tokens == 0:
                role = {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                await response.write(_chunk(gen, created, role))
            piece = reply.add(emission)
            choice = _choice(gen, piece, reply.finish_reason, reply.stop_reason)
            await response.write(_chunk(gen, created, choice))
            state.count_emitted(emission.tokens)
            if reply.finish_reason is not None:
                break
        _stop_early(state, gen, reply)
    finally:
        await tokens.aclose()  # a generation that failed is aborted in the engine
    if failed:
        # What vLLM sends when generation fails after the 200: an error event, no usage
        # chunk, then [DONE].
        error = simulated_error(
            state.config, f"simulated engine failure after {reply.completion_tokens} tokens"
        )
        await response.write(b"data: " + orjson.dumps(_error_body(error)) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    if gen.include_usage:
        chunk = orjson.loads(_chunk(gen, created, None)[6:])
        chunk["usage"] = _usage(gen, reply.completion_tokens, details=False)
        chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _stop_early(state: ServerState, gen: Generation, reply: _Reply) -> None:
    if reply.stop_reason is not None and state.runner is not None:
        state.runner.finish_early(gen.request_id, "stop")


async def _complete(state: ServerState, gen: Generation) -> web.Response:
    reply = _Reply(gen)
    fail_after = state.config.error_after_tokens
    tokens = state.tokens(gen)
    try:
        async for emission in tokens:
            if fail_after is not None and reply.completion_tokens >= fail_after:
                return error_response(
                    simulated_error(
                        state.config,
                        f"simulated engine failure after {reply.completion_tokens} tokens",
                    )
                )
            reply.add(emission)
            state.count_emitted(emission.tokens)
            if reply.finish_reason is not None:
                break
        _stop_early(state, gen, reply)
    finally:
        await tokens.aclose()
    if gen.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": reply.text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": reply.finish_reason,
            "stop_reason": reply.stop_reason,
        }
    else:
        choice = {
            "index": 0,
            "text": reply.text,
            "logprobs": None,
            "finish_reason": reply.finish_reason,
            "stop_reason": reply.stop_reason,
            "prompt_logprobs": None,
        }
    body = {
        "id": gen.response_id,
        "object": "chat.completion" if gen.kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": gen.model,
        "choices": [choice],
        "usage": _usage(gen, reply.completion_tokens, details=True),
        "system_fingerprint": SYSTEM_FINGERPRINT,
        # vLLM's responses always carry it (model_dump() keeps None).
        "kv_transfer_params": state.handoff(gen, reply.cached_tokens),
    }
    return web.json_response(body, dumps=_dumps)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def health(request: web.Request) -> web.Response:
    if not request.app[STATE].ready():
        return web.Response(status=503)
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.runner is not None:
        state.metrics.sync_engine(state.runner.engine)
    else:
        state.metrics.set_load(state.fixed_active, 0, 0.0)
        state.metrics.set_loras([], [])
    return web.Response(body=state.metrics.exposition(), content_type="text/plain", charset="utf-8")


def _model_card(
    model_id: str, root: str, parent: str | None, created: int, max_len: int | None
) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_len,
        "permission": [
            {
                "id": f"modelperm-{model_id}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    config = state.config
    cards = [
        _model_card(name, config.model, None, state.created, config.max_model_len)
        for name in config.served_model_names
    ]
    cards += [
        _model_card(name, path, config.served_model_name, state.created, None)
        for name, path in state.loras.items()
    ]
    return web.json_response({"object": "list", "data": cards}, dumps=_dumps)


async def _lora_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json(loads=orjson.loads)
    except ValueError:
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = await _lora_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            raise ApiError(
                400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
            )
        if not state.config.enable_lora:
            raise bad_request("LoRA is not enabled; start the server with --enable-lora")
        if name in state.loras:
            raise ApiError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
    except ApiError as error:
        return error_response(error)
    state.loras[str(name)] = str(path)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = await _lora_body(request)
        name = body.get("lora_name")
        if not name:
            raise ApiError(
                400,
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                "InvalidUserInput",
            )
        if name not in state.loras:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
    except ApiError as error:
        return error_response(error)
    del state.loras[str(name)]
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def runtime_lora_updating_allowed() -> bool:
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("true", "1")


@web.middleware
async def require_api_key(request: web.Request, handler: Any) -> web.StreamResponse:
    """vLLM's AuthenticationMiddleware: with keys set, every /v1 route but OPTIONS wants one
    of them as a Bearer token; /health and /metrics stay open."""
    keys = request.app[STATE].config.api_keys
    if keys and request.path.startswith("/v1") and request.method != "OPTIONS":
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        digest = hashlib.sha256(presented.encode()).digest()
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(digest, hashlib.sha256(key.encode()).digest())
        if scheme.lower() != "bearer" or not matched:
            return web.json_response({"error": "Unauthorized"}, status=401)
    response: web.StreamResponse = await handler(request)
    return response


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Any unexpected failure becomes an OpenAI-shaped 500, never an HTML traceback."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPException as exc:
        if exc.status >= 400:
            # FastAPI's shape, which is what vLLM answers for unknown routes.
            return web.json_response({"detail": exc.reason}, status=exc.status)
        raise
    except ApiError as error:
        return error_response(error)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        return error_response(ApiError(500, f"internal error: {exc}", "InternalServerError"))


async def _start_engine(app: web.Application) -> AsyncIterator[None]:
    runner = app[STATE].runner
    task = None if runner is None else asyncio.create_task(runner.run())
    yield
    if task is not None:
        task.cancel()


def build_app(config: SimConfig) -> web.Application:
    app = web.Application(
        middlewares=[require_api_key, openai_errors], client_max_size=64 * 1024 * 1024
    )
    app[STATE] = ServerState(config)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    # Like vLLM, the adapter endpoints exist only when runtime updating is allowed.
    if runtime_lora_updating_allowed():
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.cleanup_ctx.append(_start_engine)
    return app


def main(argv: list[str] | None = None) -> None:
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
        app = build_app(config)
    except (ConfigError, ValueError) as error:
        sys.stderr.write(f"enginesim: error: {error}\n")
        raise SystemExit(1) from None
    web.run_app(
        app,
        host=config.host,
        port=config.port,
        handler_cancellation=True,  # a client that disconnects cancels its handler -> abort
        access_log=None,
        print=lambda _: None,
    )
