"""The guards in front of every request (config/middleware.py), on a real uvicorn server:
a body that trickles in is cut at its deadline with a 408, and one address's 65th open
request is refused with a 429 while other addresses and later requests still get through.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import uvicorn

from config.middleware import BodyDeadline, OpenRequestsPerClient, error_body

DEADLINE_S = 2.0
CAP = 64


class HoldingApp:
    """Reads the whole body, as Django and the gateway do; `/hold` then waits for `release`."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.holding = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        if scope["path"] == "/hold":
            self.holding += 1
            await self.release.wait()
        body = str(size).encode()
        length = (b"content-length", str(len(body)).encode())
        await send({"type": "http.response.start", "status": 200, "headers": [length]})
        await send({"type": "http.response.body", "body": body})


class Server:
    def __init__(self) -> None:
        self.app = HoldingApp()
        self.cap = OpenRequestsPerClient(BodyDeadline(self.app, DEADLINE_S), CAP)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        config = uvicorn.Config(
            self.cap, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.server.serve())

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def release_holds(self) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.app.release.set)

    def stop(self) -> None:
        self.release_holds()
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def server() -> Iterator[Server]:
    running = Server()
    running.start()
    yield running
    running.stop()


def connect(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def read_response(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (or 10 s pass)."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """Everything until the server closes the connection, and whether it did within
    `timeout_s`. A server that closes while bytes we sent are still unread in its kernel
    closes with a reset, not an end of stream; Linux still hands us what arrived before it."""
    sock.settimeout(timeout_s)
    chunks: list[bytes] = []
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return b"".join(chunks), False
        except ConnectionResetError:
            return b"".join(chunks), True
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)


def request(path: str, body: bytes = b"", *, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Length: {size}\r\n"
    return head.encode() + b"Connection: close\r\n\r\n" + body


def test_a_body_sent_one_byte_a_second_is_answered_408_and_closed_at_the_deadline(
    server: Server,
) -> None:
    sock = connect(server)
    sock.sendall(request("/echo", length=100))
    started = time.monotonic()
    sock.settimeout(1.0)
    reply = b""
    for _ in range(10):
        try:
            sock.sendall(b"x")
            reply = sock.recv(65536)
        except TimeoutError:
            continue  # no answer within the second: the next byte
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed, maybe reset by a byte that crossed the 408: what came first is read below
        break
    answered_at = time.monotonic() - started
    rest, closed = read_until_closed(sock, timeout_s=5)
    closed_at = time.monotonic() - started
    sock.close()
    reply += rest
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"did not arrive within 2 s" in reply, reply
    assert DEADLINE_S - 0.5 < answered_at < DEADLINE_S + 1.5
    assert closed and closed_at < DEADLINE_S + 1.5, f"not closed by the server at {closed_at:.1f} s"


def test_a_body_that_arrives_in_time_is_served(server: Server) -> None:
    sock = connect(server)
    sock.sendall(request("/echo", b"x" * 1000))
    reply = read_response(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"1000")


def test_the_65th_open_request_from_one_address_is_refused_429(server: Server) -> None:
    held = [connect(server) for _ in range(CAP)]
    for sock in held:
        sock.sendall(request("/hold"))
    deadline = time.monotonic() + 10
    while server.app.holding < CAP:
        assert time.monotonic() < deadline, f"only {server.app.holding} requests held"
        time.sleep(0.05)

    extra = connect(server)
    extra.sendall(request("/echo", b"hi"))
    refused = read_response(extra)
    extra.close()
    assert refused.startswith(b"HTTP/1.1 429"), refused[:100]
    assert b"retry-after: 1" in refused.lower()
    assert server.app.holding == CAP  # the refused request never reached the app

    server.release_holds()
    for sock in held:
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        sock.close()
    again = connect(server)
    again.sendall(request("/echo", b"hi"))
    assert read_response(again).startswith(b"HTTP/1.1 200")
    again.close()
    assert server.cap.open == {}


def test_the_application_is_wrapped_in_the_guards_with_the_settings_values() -> None:
    from config.asgi import application
    from config.middleware import MetricsAccess

    assert isinstance(application, OpenRequestsPerClient) and application.limit == CAP
    deadline = application.app
    assert isinstance(deadline, BodyDeadline) and deadline.deadline_s == 30.0
    assert isinstance(deadline.app, MetricsAccess)


@pytest.mark.parametrize(
    ("status", "kind"),
    [(408, "invalid_request_error"), (429, "rate_limit_error"), (503, "service_unavailable_error")],
)
def test_an_edge_refusal_on_v1_has_openais_type_for_its_status(status: int, kind: str) -> None:
    body = orjson.loads(error_body("/v1/chat/completions", status, "Refused.", "edge"))
    assert body == {"error": {"message": "Refused.", "type": kind, "param": None, "code": "edge"}}
    assert orjson.loads(error_body("/api/v1/usage/", status, "Refused.", "edge")) == {
        "detail": "Refused."
    }
