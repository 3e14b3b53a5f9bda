"""Streaming chat over the WebSocket endpoint (the gateway's own ASGI handler), end to end."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
import redis
import websockets
from asgiref.sync import sync_to_async

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
    return orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, **extra}
    )


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


def test_a_wrong_key_in_the_header_refuses_the_handshake(ws_setup) -> None:
    server, _ = ws_setup
    url = f"ws://127.0.0.1:{server.port}/v1/chat/completions/ws"

    async def connect() -> None:
        async with websockets.connect(url, additional_headers={"Authorization": "Bearer sk-x-y"}):
            pass

    with pytest.raises(websockets.InvalidStatus) as refused:
        asyncio.run(connect())
    assert refused.value.response.status_code == 403


def test_a_page_of_another_site_is_refused_before_the_gateway(ws_setup) -> None:
    server, key = ws_setup
    url = f"ws://127.0.0.1:{server.port}/v1/chat/completions/ws"
    headers = {"Authorization": f"Bearer {key.secret}", "Origin": "https://evil.example"}

    async def connect() -> None:
        async with websockets.connect(url, additional_headers=headers):
            pass

    with pytest.raises(websockets.InvalidStatus) as refused:
        asyncio.run(connect())
    assert refused.value.response.status_code == 403


def test_a_second_generation_while_one_runs_is_a_409(ws_setup) -> None:
    server, key = ws_setup
    url = f"ws://127.0.0.1:{server.port}/v1/chat/completions/ws"

    async def two_at_once() -> list[dict]:
        received: list[dict] = []
        headers = {"Authorization": f"Bearer {key.secret}"}
        async with websockets.connect(url, additional_headers=headers) as socket:
            await socket.send(chat_body(max_tokens=40))
            await socket.send(chat_body())
            while not received or received[-1]["type"] != "done":
                received.append(orjson.loads(await asyncio.wait_for(socket.recv(), 20)))
        return received

    replies = asyncio.run(two_at_once())
    errors = [reply for reply in replies if reply["type"] == "error"]
    assert [error["error"]["type"] for error in errors] == ["conflict_error"]
    assert replies[-1]["usage"]["completion_tokens"] > 0


def test_a_key_revoked_while_the_socket_is_open_stops_at_its_next_generation(ws_setup) -> None:
    from tenants.actions import do_revoke_api_key

    server, key = ws_setup
    url = f"ws://127.0.0.1:{server.port}/v1/chat/completions/ws"

    async def revoked_between_generations() -> tuple[dict, list[dict], int | None]:
        headers = {"Authorization": f"Bearer {key.secret}"}
        async with websockets.connect(url, additional_headers=headers) as socket:
            await socket.send(chat_body())
            first: dict[str, Any] = {}
            while first.get("type") != "done":
                first = orjson.loads(await asyncio.wait_for(socket.recv(), 20))
            await sync_to_async(do_revoke_api_key)(key.key, None)
            await asyncio.sleep(1.5)  # the key event reaches the gateway's cache
            await socket.send(chat_body())
            second = [orjson.loads(await asyncio.wait_for(socket.recv(), 20))]
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(socket.recv(), 20)
            return first, second, socket.close_code

    first, second, code = asyncio.run(revoked_between_generations())
    assert first["type"] == "done"
    assert second[0]["error"]["code"] == "invalid_api_key"
    assert code == 4401


async def silent_socket(url: str) -> tuple[dict, int | None]:
    """Connect without a key, say nothing: the reply, then the close code."""
    async with websockets.connect(url) as socket:
        reply = orjson.loads(await asyncio.wait_for(socket.recv(), 20))
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(socket.recv(), 20)
        return reply, socket.close_code


def test_a_socket_that_never_authenticates_is_closed_at_the_deadline(
    ws_setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    from serving.gateway import websocket

    monkeypatch.setattr(websocket, "AUTH_DEADLINE_S", 0.5)
    server, _ = ws_setup
    url = f"ws://127.0.0.1:{server.port}/v1/chat/completions/ws"
    reply, code = asyncio.run(silent_socket(url))
    assert reply["type"] == "error" and reply["error"]["code"] == "invalid_api_key"
    assert "within 0.5 s" in reply["error"]["message"]
    assert code == websocket.UNAUTHORIZED


def test_an_oversized_auth_message_closes_and_an_oversized_body_is_a_413(ws_setup) -> None:
    server, key = ws_setup
    url = f"ws://127.0.0.1:{server.port}/v1/chat/completions/ws"
    padded = orjson.dumps({"type": "auth", "api_key": key.secret, "pad": "x" * 8192})
    replies = asyncio.run(converse(url, {}, [padded]))
    assert replies[-1]["error"]["message"] == "An auth message is at most 4096 bytes."

    huge = chat_body(user="x" * (5 * 1024 * 1024))
    replies = asyncio.run(converse(url, {"Authorization": f"Bearer {key.secret}"}, [huge]))
    assert replies[-1]["type"] == "error"
    assert replies[-1]["error"]["message"] == f"A message is at most {4 * 1024 * 1024} bytes."

    async def refused_then_served() -> tuple[dict, list[dict]]:
        headers = {"Authorization": f"Bearer {key.secret}"}
        async with websockets.connect(url, additional_headers=headers) as socket:
            await socket.send(huge)
            refusal = orjson.loads(await asyncio.wait_for(socket.recv(), 20))
            await socket.send(chat_body())
            served = [orjson.loads(await asyncio.wait_for(socket.recv(), 20))]
            while served[-1]["type"] not in {"done", "error"}:
                served.append(orjson.loads(await asyncio.wait_for(socket.recv(), 20)))
            return refusal, served

    # The socket stays usable: the next, normal message streams.
    refusal, served = asyncio.run(refused_then_served())
    assert refusal["type"] == "error" and served[-1]["type"] == "done"
