"""Streaming chat over a WebSocket, plain ASGI, on the same pipeline as SSE.

Connect to `/v1/chat/completions/ws` with `Authorization: Bearer <key>` (or send
`{"type": "auth", "api_key": "..."}` first, for browsers, which cannot set headers on a
WebSocket). Each message is a chat-completions body; the reply is the same chunks the SSE
stream carries, one JSON message each, `{"type": "chunk", "data": {...}}`, then
`{"type": "done", "usage": {...}}`, or `{"type": "error", "error": {...}}`. A bad key in the
auth message closes the socket with code 4401; one in the header refuses the handshake itself
(HTTP 403: no close code can be sent before the socket is accepted). One
generation at a time per socket (another message meanwhile is a 409 error); closing the socket
cancels the generation, which closes the upstream so the engine aborts.

`GatewayApp` (serving.gateway.asgi) sends WebSockets on `WEBSOCKET_PATH` here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from serving.gateway.access import (
    Message,
    Receive,
    Scope,
    Send,
    authorize,
    bearer_token,
    priority_tier,
)
from serving.gateway.errors import ApiError, invalid_api_key
from serving.gateway.pipeline import END_OF_STREAM, Exchange
from serving.gateway.schemas import ChatCompletionRequest, parse_body
from serving.gateway.service import Gateway
from tenants.keys import KeyPrincipal

WEBSOCKET_PATH = "/v1/chat/completions/ws"
# The close code for a key that is missing, unknown, revoked or may not run inference.
UNAUTHORIZED = 4401
# A socket opened without a key in its header has this long to send its auth message, and
# that message may be this large: an unauthenticated socket holds nothing for long.
AUTH_DEADLINE_S = 10.0
MAX_AUTH_MESSAGE_BYTES = 4096


async def serve_chat_socket(
    gateway: Callable[[], Awaitable[Gateway]], scope: Scope, receive: Receive, send: Send
) -> None:
    """The ASGI application of one chat socket, from its handshake to its disconnect."""
    if (await receive())["type"] != "websocket.connect":
        return
    socket = ChatSocket(await gateway(), scope, send)
    if not await socket.connect():
        return
    auth_deadline = asyncio.get_running_loop().time() + AUTH_DEADLINE_S
    try:
        while not socket.closed:
            try:
                message = await socket.next_message(receive, auth_deadline)
            except TimeoutError:
                late = f"Send an API key within {AUTH_DEADLINE_S:g} s of connecting."
                await socket.refuse(ApiError(401, late, code="invalid_api_key"))
                return
            if message["type"] == "websocket.receive":
                await socket.receive(message)
            elif message["type"] == "websocket.disconnect":
                return
    finally:
        await socket.cancel_generation()


class ChatSocket:
    """One client's socket: its key, the key's principal, at most one generation running."""

    def __init__(self, gateway: Gateway, scope: Scope, send: Send) -> None:
        self.gateway = gateway
        self.scope = scope
        self._send = send
        self.raw_key: str | None = None
        self.principal: KeyPrincipal | None = None
        self.generation: asyncio.Task[None] | None = None
        self.closed = False

    async def connect(self) -> bool:
        """Accept the handshake, unless its Authorization header names a refused key."""
        self.raw_key = bearer_token(self.scope)
        if self.raw_key is not None:
            self.principal = await self._authorize(self.raw_key)
            if self.principal is None:
                await self.close()
                return False
        await self._send({"type": "websocket.accept"})
        return True

    async def next_message(self, receive: Receive, auth_deadline: float) -> Message:
        """The next ASGI event; before the socket is authenticated, only until the deadline."""
        if self.principal is not None:
            return await receive()
        remaining = auth_deadline - asyncio.get_running_loop().time()
        return await asyncio.wait_for(receive(), timeout=max(0.0, remaining))

    async def receive(self, message: Message) -> None:
        text = message.get("text")
        raw = text.encode() if text is not None else (message.get("bytes") or b"")
        if self.principal is None:
            if len(raw) > MAX_AUTH_MESSAGE_BYTES:
                too_large = f"An auth message is at most {MAX_AUTH_MESSAGE_BYTES} bytes."
                await self.refuse(ApiError(413, too_large))
                return
            await self._receive_auth(raw)
            return
        limit = self.gateway.config.max_body_bytes
        if len(raw) > limit:
            await self._send_error(ApiError(413, f"A message is at most {limit} bytes."))
            return
        if self.generation is not None and not self.generation.done():
            await self._send_error(ApiError(409, "One generation at a time per socket."))
            return
        self.generation = asyncio.create_task(self._generate(raw))

    async def cancel_generation(self) -> None:
        if self.generation is not None:
            self.generation.cancel()
            with contextlib.suppress(BaseException):
                await self.generation

    async def close(self) -> None:
        self.closed = True
        await self._send({"type": "websocket.close", "code": UNAUTHORIZED})

    async def refuse(self, error: ApiError) -> None:
        """An error naming why, then the socket closed as unauthorized."""
        await self._send_error(error)
        await self.close()

    async def _authorize(self, raw_key: str) -> KeyPrincipal | None:
        try:
            return await authorize(self.gateway.authenticator, raw_key)
        except ApiError:
            return None

    async def _receive_auth(self, raw: bytes) -> None:
        try:
            message = orjson.loads(raw)
        except orjson.JSONDecodeError:
            message = {}
        if message.get("type") == "auth" and isinstance(message.get("api_key"), str):
            self.raw_key = message["api_key"]
            self.principal = await self._authorize(message["api_key"])
        if self.principal is None:
            await self._send_error(invalid_api_key())
            await self.close()
            return
        await self._send_json({"type": "authenticated"})

    async def _generate(self, raw: bytes) -> None:
        try:
            # Checked again for every generation: a key revoked while the socket is open
            # stops working at its next message, like over HTTP.
            self.principal = await self._authorize(self.raw_key or "")
            if self.principal is None:
                await self._send_error(invalid_api_key())
                await self.close()
                return
            exchange = Exchange(
                gateway=self.gateway,
                kind="chat",
                body=parse_body(ChatCompletionRequest, raw),
                principal=self.principal,
                tier=priority_tier(self.scope),
                over_websocket=True,
            )
            await exchange.prepare()
            await self._stream(exchange)
        except ApiError as error:
            await self._send_error(error)
        except asyncio.CancelledError:
            raise
        except Exception:
            await self._send_error(
                ApiError(
                    502,
                    "The model replica failed mid-stream; the tokens received so far are billed.",
                    code="upstream_error",
                    error_type="server_error",
                )
            )

    async def _stream(self, exchange: Exchange) -> None:
        async with contextlib.aclosing(exchange.events()) as events:
            async for chunk in events:
                if chunk is END_OF_STREAM:
                    continue
                chunk.pop("usage", None)
                await self._send_json({"type": "chunk", "data": chunk})
        usage = exchange.usage_payload()
        await self._send_json({"type": "done", "request_id": exchange.request_id, "usage": usage})

    async def _send_json(self, message: dict[str, Any]) -> None:
        await self._send({"type": "websocket.send", "text": orjson.dumps(message).decode()})

    async def _send_error(self, error: ApiError) -> None:
        await self._send_json({"type": "error", **error.payload()})
