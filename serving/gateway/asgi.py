"""The lean ASGI app serving /v1 (and /metrics) and the chat WebSocket; everything else
falls through to the app behind it (Django, or Channels for the console's WebSockets).

Hand-written ASGI instead of a Django view: no middleware stack, no thread hop, and the
client's disconnect is seen at once (a watcher awaits `http.disconnect` while the response
streams, and cancels the stream, which closes the upstream so the engine aborts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from serving.gateway import idempotency
from serving.gateway.access import (
    Receive,
    Scope,
    Send,
    api_key,
    authorize,
    header,
    priority_tier,
)
from serving.gateway.errors import ApiError, replica_failed
from serving.gateway.pipeline import END_OF_STREAM, Exchange
from serving.gateway.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from serving.gateway.service import Gateway
from serving.gateway.tracing import RequestTrace
from serving.gateway.websocket import WEBSOCKET_PATH, serve_chat_socket

log = logging.getLogger(__name__)

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
JSON_TYPE = (b"content-type", b"application/json")


class ClientDisconnected(Exception):
    pass


def encode_headers(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in headers.items()]


async def send_json(send: Send, status: int, body: bytes, headers: dict[str, str]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [JSON_TYPE, *encode_headers(headers)],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"The request body is larger than {limit} bytes.")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


class GatewayApp:
    """`fallback` is the ASGI app behind this one (Django's handler, Channels' router: any
    ASGI app, whatever its own annotations); `gateway` gives the process's started gateway
    (see `config.gateway`)."""

    def __init__(
        self, fallback: Callable[..., Awaitable[None]], gateway: Callable[[], Awaitable[Gateway]]
    ) -> None:
        self.fallback = fallback
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "websocket" and path == WEBSOCKET_PATH:
            await serve_chat_socket(self.gateway, scope, receive, send)
            return
        if scope["type"] != "http" or not (path.startswith("/v1/") or path in {"/v1", "/metrics"}):
            await self.fallback(scope, receive, send)
            return
        request_id_headers: dict[str, str] = {}
        try:
            if path == "/metrics":
                await self.metrics(send)
                return
            gateway = await self.gateway()
            await self.dispatch(gateway, scope, receive, send, request_id_headers)
        except ApiError as error:
            await send_json(
                send, error.status, error.body(), {**request_id_headers, **error.headers}
            )
        except ClientDisconnected:
            return

    async def metrics(self, send: Send) -> None:
        body = generate_latest()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def dispatch(
        self, gateway: Gateway, scope: Scope, receive: Receive, send: Send, out: dict[str, str]
    ) -> None:
        path = scope["path"].rstrip("/")
        method = scope["method"]
        routes = {
            "/v1/chat/completions": ("POST", "chat"),
            "/v1/completions": ("POST", "completion"),
            "/v1/models": ("GET", "models"),
        }
        model_id = path.removeprefix("/v1/models/") if path.startswith("/v1/models/") else None
        if model_id is not None:
            routes[path] = ("GET", "model")
        if path not in routes:
            raise ApiError(404, f"Unknown endpoint: {method} {scope['path']}", code="unknown_url")
        allowed, kind = routes[path]
        if method != allowed:
            raise ApiError(405, f"{method} is not allowed on {path}; use {allowed}.")
        principal = await authorize(gateway.authenticator, api_key(scope))
        if kind in {"models", "model"}:
            # Before the first load the list would be empty: not an answer to give.
            gateway.check_loaded()
            servable = set(gateway.routing.snapshot.served_models)
            listing = gateway.catalog.listing(principal, servable)
            if kind == "models":
                await send_json(send, 200, orjson.dumps({"object": "list", "data": listing}), {})
                return
            found = next((item for item in listing if item["id"] == model_id), None)
            if found is None:
                raise ApiError(
                    404,
                    f"The model '{model_id}' does not exist or you do not have access to it.",
                    code="model_not_found",
                    param="model",
                )
            await send_json(send, 200, orjson.dumps(found), {})
            return
        raw = await read_body(receive, gateway.config.max_body_bytes)
        body = parse_body(ChatCompletionRequest if kind == "chat" else CompletionRequest, raw)
        tier = priority_tier(scope)
        exchange = Exchange(gateway=gateway, kind=kind, body=body, principal=principal, tier=tier)
        out["x-request-id"] = exchange.request_id
        if gateway.tracer is None:
            await self.generate(gateway, exchange, scope, receive, send, raw)
            return
        trace = RequestTrace(
            gateway.tracer,
            f"{method} {exchange.path}",
            traceparent=header(scope, b"traceparent") or "",
            tracestate=header(scope, b"tracestate") or "",
        )
        exchange.trace = trace
        try:
            await self.generate(gateway, exchange, scope, receive, send, raw)
        except ApiError as error:
            trace.refused(error.status, error.code)
            raise
        finally:
            trace.finish(exchange.span_attributes())

    async def generate(
        self,
        gateway: Gateway,
        exchange: Exchange,
        scope: Scope,
        receive: Receive,
        send: Send,
        raw: bytes,
    ) -> None:
        """One generation: idempotent, streamed or collected."""
        body = exchange.body
        idem_key = header(scope, b"idempotency-key")
        if idem_key and not body.stream:
            await self.idempotent(gateway, exchange, raw, idem_key, send, receive)
            return
        await self.until_disconnect(exchange.prepare(), receive)
        if body.stream:
            await self.stream(exchange, send, receive)
        else:

            async def respond(status: int, payload: bytes) -> None:
                await send_json(
                    send, status, payload, {"x-request-id": exchange.request_id, **exchange.headers}
                )

            await self.collect(exchange, receive, respond)

    async def idempotent(
        self,
        gateway: Gateway,
        exchange: Exchange,
        raw: bytes,
        key: str,
        send: Send,
        receive: Receive,
    ) -> None:
        tenant = str(exchange.principal.tenant_id)
        fingerprint = idempotency.body_fingerprint(raw)
        # The key's own checks come first: a replay is refused whatever a fresh request
        # would be refused (another key of the tenant with a narrower allowlist or tier).
        await exchange.check()
        try:
            stored = await idempotency.claim(gateway.redis, tenant, key, fingerprint)
        except RedisError as error:
            raise ApiError(
                503,
                "Idempotency keys are unavailable right now; retry shortly.",
                code="idempotency_unavailable",
                headers={"Retry-After": "2"},
            ) from error
        if stored is not None:
            await send_json(send, stored.status, stored.body, {"idempotent-replayed": "true"})
            return

        responded = False

        async def respond(status: int, payload: bytes) -> None:
            nonlocal responded
            responded = True
            try:
                await idempotency.complete(gateway.redis, tenant, key, fingerprint, status, payload)
            except RedisError:
                # The response is still the client's; a retry will meet the claim's expiry.
                log.warning("could not store the response for idempotency key of %s", tenant)
            await send_json(
                send, status, payload, {"x-request-id": exchange.request_id, **exchange.headers}
            )

        try:
            await self.until_disconnect(exchange.prepare(), receive)
            await self.collect(exchange, receive, respond)
        except BaseException:
            if not responded:
                with contextlib.suppress(RedisError):
                    await idempotency.release(gateway.redis, tenant, key)
            raise

    async def collect(
        self,
        exchange: Exchange,
        receive: Receive,
        respond: Callable[[int, bytes], Awaitable[None]],
    ) -> None:
        """A non-streaming response: the upstream stream, assembled, handed to `respond`
        before the settle's Redis round trip runs (as the streamed [DONE] is)."""
        events = exchange.events()
        pieces: list[str] = []
        first: dict[str, Any] | None = None
        finish: str | None = None

        async def assemble() -> None:
            nonlocal first, finish
            async for chunk in events:
                if chunk is END_OF_STREAM:
                    return  # everything delivered; the settle runs when `events` closes
                first = first or chunk
                choice = chunk["choices"][0]
                if exchange.kind == "chat":
                    pieces.append((choice.get("delta") or {}).get("content") or "")
                else:
                    pieces.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish

        try:
            await self.until_disconnect(assemble(), receive)
        except (ApiError, ClientDisconnected):
            await events.aclose()
            raise
        except Exception as error:
            await events.aclose()
            raise ApiError(
                502,
                "The model replica failed mid-generation; please retry.",
                code="upstream_error",
                error_type="server_error",
            ) from error
        text = "".join(pieces)
        created = int(first["created"]) if first and "created" in first else int(time.time())
        response_id = first["id"] if first else f"cmpl-{exchange.request_id}"
        if exchange.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        payload = {
            "id": response_id,
            "object": obj,
            "created": created,
            "model": exchange.model,
            "choices": [choice],
            "usage": exchange.usage_payload(),
        }
        try:
            await respond(200, orjson.dumps(payload))
        finally:
            await events.aclose()

    async def until_disconnect(
        self,
        work: Awaitable[None],
        receive: Receive,
        responded: Callable[[], bool] = lambda: False,
    ) -> None:
        """Run `work`; if the client goes away first, cancel it (closing the upstream).

        Once the whole response is sent (`responded()`), the server reports a disconnect at
        once; the work left then (the settle) is awaited, not cancelled."""
        task = asyncio.ensure_future(work)

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done and responded():
                await task
            elif task not in done:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ClientDisconnected
            task.result()
        finally:
            watcher.cancel()

    async def stream(self, exchange: Exchange, send: Send, receive: Receive) -> None:
        started = False
        finished = False

        async def pump() -> None:
            headers = {"x-request-id": exchange.request_id, **exchange.headers}
            events = exchange.events()

            async def start() -> None:
                nonlocal started
                if not started:
                    response = [*SSE_HEADERS, *encode_headers(headers)]
                    await send({"type": "http.response.start", "status": 200, "headers": response})
                    started = True

            async def finish() -> None:
                nonlocal finished
                tail = sse(self.usage_chunk(exchange)) if exchange.body.include_usage else b""
                await start()
                await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n"})
                finished = True

            try:
                async for chunk in events:
                    if chunk is END_OF_STREAM:
                        await finish()
                        continue
                    exchange.response_id = exchange.response_id or chunk.get("id")
                    if not started:
                        await start()
                    if not exchange.body.include_usage:
                        chunk.pop("usage", None)
                    elif "usage" not in chunk:
                        chunk["usage"] = None
                    await send(
                        {"type": "http.response.body", "body": sse(chunk), "more_body": True}
                    )
            except ApiError as error:
                if not started:
                    raise
                await self.stream_error(send, exchange, error.payload())
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the replica died mid-stream
                if not started:
                    raise replica_failed() from error
                await self.stream_error(
                    send,
                    exchange,
                    {
                        "error": {
                            "message": "The model replica failed mid-stream; the tokens "
                            "received so far are billed.",
                            "type": "server_error",
                            "param": None,
                            "code": "upstream_error",
                        }
                    },
                )
            finally:
                await events.aclose()

        await self.until_disconnect(pump(), receive, lambda: finished)

    @classmethod
    async def stream_error(cls, send: Send, exchange: Exchange, payload: dict[str, Any]) -> None:
        """End a started stream with an error event and [DONE]; with include_usage, the usage
        chunk (what was delivered) comes first, as it would before [DONE]: OpenAI's clients
        raise at the error event and would never read a usage chunk after it. (vLLM's own
        server sends none after a failure; this one has the shape of the usage chunk it sends
        on success, so a client reads it the same way.)"""
        usage = sse(cls.usage_chunk(exchange)) if exchange.body.include_usage else b""
        body = usage + sse(payload) + b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    def usage_chunk(exchange: Exchange) -> dict[str, Any]:
        return {
            "id": exchange.response_id or f"cmpl-{exchange.request_id}",
            "object": "chat.completion.chunk" if exchange.kind == "chat" else "text_completion",
            "created": int(exchange.started_at),
            "model": exchange.model,
            "choices": [],
            "usage": exchange.usage_payload(),
        }
