"""Streaming chat over a WebSocket, through Channels, on the same pipeline as SSE.

Connect to `/v1/chat/completions/ws` with `Authorization: Bearer <key>` (or send
`{"type": "auth", "api_key": "..."}` first, for browsers, which cannot set headers on a
WebSocket). Each message is a chat-completions body; the reply is the same chunks the SSE
stream carries, one JSON message each, `{"type": "chunk", "data": {...}}`, then
`{"type": "done", "usage": {...}}`, or `{"type": "error", "error": {...}}`. Closing the socket
cancels the generation, which closes the upstream so the engine aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
from channels.generic.websocket import AsyncWebsocketConsumer

from serving.gateway.asgi import header
from serving.gateway.errors import ApiError, invalid_api_key
from serving.gateway.pipeline import END_OF_STREAM, PRIORITY_HEADER, TIERS, Exchange
from serving.gateway.schemas import ChatCompletionRequest, parse_body
from serving.gateway.service import Gateway, get_gateway


class ChatStreamConsumer(AsyncWebsocketConsumer):
    gateway: Gateway
    principal: Any = None
    raw_key: str | None = None
    generation: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        self.gateway = await get_gateway()
        authorization = header(self.scope, b"authorization") or ""
        if authorization[:7].lower() == "bearer ":
            self.raw_key = authorization[7:].strip()
            self.principal = await self._authenticate(self.raw_key)
            if self.principal is None:
                await self.close(code=4401)
                return
        await self.accept()

    async def _authenticate(self, raw_key: str) -> Any:
        principal = await self.gateway.authenticator.authenticate(raw_key)
        if principal is None or not principal.is_usable or "inference" not in principal.scopes:
            return None
        return principal

    async def disconnect(self, code: int) -> None:
        if self.generation is not None:
            self.generation.cancel()
            with contextlib.suppress(BaseException):
                await self.generation

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        raw = text_data.encode() if text_data is not None else (bytes_data or b"")
        if self.principal is None:
            await self._receive_auth(raw)
            return
        if self.generation is not None and not self.generation.done():
            await self._send_error(ApiError(409, "One generation at a time per socket."))
            return
        self.generation = asyncio.create_task(self._generate(raw))

    async def _receive_auth(self, raw: bytes) -> None:
        try:
            message = orjson.loads(raw)
        except orjson.JSONDecodeError:
            message = {}
        if message.get("type") == "auth" and isinstance(message.get("api_key"), str):
            self.raw_key = message["api_key"]
            self.principal = await self._authenticate(self.raw_key)
        if self.principal is None:
            await self._send_error(invalid_api_key())
            await self.close(code=4401)
            return
        await self.send(text_data=orjson.dumps({"type": "authenticated"}).decode())

    async def _generate(self, raw: bytes) -> None:
        try:
            # Checked again for every generation: a key revoked while the socket is open
            # stops working at its next message, like over HTTP.
            self.principal = await self._authenticate(self.raw_key or "")
            if self.principal is None:
                await self._send_error(invalid_api_key())
                await self.close(code=4401)
                return
            body = parse_body(ChatCompletionRequest, raw)
            tier = (header(self.scope, PRIORITY_HEADER.encode()) or "standard").lower()
            if tier not in TIERS:
                raise ApiError(400, f"{PRIORITY_HEADER} must be one of {', '.join(TIERS)}.")
            exchange = Exchange(
                gateway=self.gateway, kind="chat", body=body, principal=self.principal,
                tier=tier, over_websocket=True,
            )  # fmt: skip
            await exchange.prepare()
            async with contextlib.aclosing(exchange.events()) as events:
                async for chunk in events:
                    if chunk is END_OF_STREAM:
                        continue
                    chunk.pop("usage", None)
                    message = {"type": "chunk", "data": chunk}
                    await self.send(text_data=orjson.dumps(message).decode())
            done = {"type": "done", "request_id": exchange.request_id,
                    "usage": exchange.usage_payload()}  # fmt: skip
            await self.send(text_data=orjson.dumps(done).decode())
        except ApiError as error:
            await self._send_error(error)
        except asyncio.CancelledError:
            raise
        except Exception:
            await self._send_error(
                ApiError(502, "The model replica failed mid-stream; the tokens received so far "
                         "are billed.", code="upstream_error", error_type="server_error")
            )  # fmt: skip

    async def _send_error(self, error: ApiError) -> None:
        await self.send(text_data=orjson.dumps({"type": "error", **error.payload()}).decode())
