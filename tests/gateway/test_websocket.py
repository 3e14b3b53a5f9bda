"""Streaming chat over the WebSocket endpoint (Channels), end to end."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import redis
import websockets

from tests.gateway.conftest import MODEL, Fleet, GatewayServer, publish_catalog

pytestmark = pytest.mark.slow


@pytest.fixture
def ws_setup(gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis):
    fleet.start()
    fleet.publish()
    publish_catalog(redis_client)
    return gateway_server, make_key("acme")


async def converse(url: str, headers: dict[str, str], messages: list[bytes]) -> list[dict]:
    received: list[dict] = []
    async with websockets.connect(url, additional_headers=headers) as socket:
        for message in messages:
            await socket.send(message)
        while True:
            reply = orjson.loads(await asyncio.wait_for(socket.recv(), 20))
            received.append(reply)
            if reply["type"] in {"done", "error"}:
                return received


def chat_body(**extra) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 6, **extra})  # fmt: skip


def test_a_chat_streams_token_by_token_over_a_websocket(ws_setup) -> None:
    server, key = ws_setup
    url = f"ws://127.0.0.1:{server.port}/v1/chat/completions/ws"
    replies = asyncio.run(converse(url, {"Authorization": f"Bearer {key.secret}"}, [chat_body()]))
    chunks = [r for r in replies if r["type"] == "chunk"]
    assert chunks and replies[-1]["type"] == "done"
    text = [c["data"]["choices"][0]["delta"].get("content") for c in chunks]
    assert sum(1 for t in text if t) == replies[-1]["usage"]["completion_tokens"]


def test_a_browser_authenticates_with_its_first_message(ws_setup) -> None:
    server, key = ws_setup
    url = f"ws://127.0.0.1:{server.port}/v1/chat/completions/ws"
    auth = orjson.dumps({"type": "auth", "api_key": key.secret})
    replies = asyncio.run(converse(url, {}, [auth, chat_body()]))
    assert replies[0] == {"type": "authenticated"}
    assert replies[-1]["type"] == "done"


def test_bad_input_over_a_websocket_gets_an_openai_error(ws_setup) -> None:
    server, key = ws_setup
    url = f"ws://127.0.0.1:{server.port}/v1/chat/completions/ws"
    replies = asyncio.run(
        converse(url, {"Authorization": f"Bearer {key.secret}"}, [chat_body(n=3)])
    )
    assert replies[-1]["type"] == "error"
    assert replies[-1]["error"]["param"] == "n"


def test_a_wrong_key_is_refused_over_a_websocket(ws_setup) -> None:
    server, _ = ws_setup
    url = f"ws://127.0.0.1:{server.port}/v1/chat/completions/ws"
    replies = asyncio.run(converse(url, {}, [orjson.dumps({"type": "auth", "api_key": "sk-x-y"})]))
    assert replies[-1]["error"]["code"] == "invalid_api_key"
