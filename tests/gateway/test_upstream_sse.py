"""The gateway's reading of an engine's Server-Sent Events stream, as the WHATWG HTML
standard interprets a `text/event-stream`: any line ending, multi-line data, comments and
other fields, a BOM, and network pieces split anywhere, down to inside a UTF-8 character."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any, cast

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from serving.gateway.upstream import (
    ServerSentEvent,
    SSEDecoder,
    UpstreamError,
    UpstreamStream,
    UpstreamTimeouts,
    make_session,
    open_stream,
)


def decode(*pieces: bytes) -> list[ServerSentEvent]:
    decoder = SSEDecoder()
    return [event for piece in pieces for event in decoder.feed(piece)]


def data_of(*pieces: bytes) -> list[str]:
    return [event.data for event in decode(*pieces)]


def every_split(stream: bytes) -> Iterable[tuple[bytes, ...]]:
    """The stream whole, byte by byte, and cut once and twice at every offset."""
    yield (stream,)
    yield tuple(stream[i : i + 1] for i in range(len(stream)))
    for i in range(len(stream) + 1):
        yield stream[:i], stream[i:]
        for j in range(i, len(stream) + 1):
            yield stream[:i], stream[i:j], stream[j:]


def test_data_lines_of_one_event_join_with_lf() -> None:
    assert data_of(b"data: first\ndata: second\ndata: third\n\n") == ["first\nsecond\nthird"]


def test_each_blank_line_dispatches_one_event() -> None:
    assert data_of(b"data: a\n\ndata: b\n\n") == ["a", "b"]


@pytest.mark.parametrize("end", [b"\r\n", b"\n", b"\r"], ids=["crlf", "lf", "cr"])
def test_every_line_ending_ends_lines_and_events(end: bytes) -> None:
    stream = b"data: a" + end + b"data: b" + end + end + b"data: c" + end + end
    assert data_of(stream) == ["a\nb", "c"]


def test_mixed_line_endings_in_one_stream() -> None:
    assert data_of(b"data: a\r\ndata: b\rdata: c\n\r\ndata: d\r\r") == ["a\nb\nc", "d"]


def test_crlf_split_between_cr_and_lf_is_one_line_end() -> None:
    # Were the LF a second line end, the first event would be dispatched at it, alone.
    assert data_of(b"data: a\r", b"\ndata: b\r\n\r\n") == ["a\nb"]
    assert data_of(b"data: a\r\n\r", b"\ndata: b\r\n\r\n") == ["a", "b"]


def test_a_cr_ending_a_piece_dispatches_without_waiting_for_the_next() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r\r") == [ServerSentEvent("a")]
    assert decoder.feed(b"data: b\r\r") == [ServerSentEvent("b")]


def test_every_split_of_a_stream_gives_the_same_events() -> None:
    stream = "\ufeffdata: h\u00e9\r\n: note\rdata:\u20ac\U0001f600\n\r\nid: 7\revent: x\ndata\r\r".encode()
    expected = [ServerSentEvent("h\u00e9\n\u20ac\U0001f600"), ServerSentEvent("", "x", "7")]
    for pieces in every_split(stream):
        assert decode(*pieces) == expected, pieces


def test_a_piece_split_inside_a_multibyte_utf8_character() -> None:
    encoded = "data: \u00e9\u20ac\U0001f600\n\n".encode()
    start = encoded.index(b"\xf0")  # the emoji's first byte of four
    assert data_of(encoded[: start + 1], encoded[start + 1 : start + 3], encoded[start + 3 :]) == [
        "\u00e9\u20ac\U0001f600"
    ]
    euro = encoded.index(b"\xe2")
    assert data_of(encoded[: euro + 2], encoded[euro + 2 :]) == ["\u00e9\u20ac\U0001f600"]


def test_comments_are_ignored() -> None:
    assert data_of(b": keep-alive\n:\ndata: a\n: between\ndata: b\n\n: alone\n\n") == ["a\nb"]


def test_event_id_and_retry_are_fields_not_data() -> None:
    decoder = SSEDecoder()
    events = decoder.feed(b"event: delta\nid: 42\nretry: 1500\ndata: payload\n\n")
    assert events == [ServerSentEvent("payload", event="delta", id="42")]
    assert decoder.retry_ms == 1500


def test_the_event_type_resets_after_dispatch_and_the_id_persists() -> None:
    events = decode(b"event: a\nid: 1\ndata: x\n\ndata: y\n\nid\ndata: z\n\n")
    assert events == [
        ServerSentEvent("x", "a", "1"),
        ServerSentEvent("y", "message", "1"),
        ServerSentEvent("z", "message", ""),
    ]


def test_a_retry_that_is_not_all_digits_is_ignored() -> None:
    decoder = SSEDecoder()
    decoder.feed(b"retry: 100\n\nretry: 2x\n\nretry: -5\n\nretry:\n\n")
    assert decoder.retry_ms == 100


def test_an_id_holding_nul_is_ignored() -> None:
    assert decode(b"id: 1\n\nid: 2\0\ndata: x\n\n") == [ServerSentEvent("x", id="1")]


def test_an_event_without_data_is_not_dispatched() -> None:
    assert decode(b"event: ping\nid: 3\n\n\n\nretry: 10\n\n") == []
    # The type it named does not leak into the next event.
    assert decode(b"event: ping\n\ndata: x\n\n") == [ServerSentEvent("x")]


def test_data_without_a_colon_is_an_empty_data_line() -> None:
    assert data_of(b"data\n\n") == [""]
    assert data_of(b"data: a\ndata\ndata: b\n\n") == ["a\n\nb"]
    # A line naming no field it knows (nor "data" exactly) adds nothing.
    assert data_of(b"datum\ndata: a\ndata \n\n") == ["a"]


def test_exactly_one_leading_space_is_stripped() -> None:
    assert data_of(b"data:x\n\n") == ["x"]
    assert data_of(b"data: x\n\n") == ["x"]
    assert data_of(b"data:  x\n\n") == [" x"]
    assert data_of(b"data:\tx \n\n") == ["\tx "]
    # Only the first colon separates: the rest is the value's.
    assert data_of(b'data: {"a": "b:c"}\n\n') == ['{"a": "b:c"}']


def test_a_leading_bom_is_skipped_once() -> None:
    bom = b"\xef\xbb\xbf"
    assert data_of(bom + b"data: a\n\n") == ["a"]
    assert data_of(bom[:1], bom[1:2], bom[2:] + b"data: a\n\n") == ["a"]
    # A second BOM is part of the first line: a field named "\ufeffdata", not data.
    assert data_of(bom + bom + b"data: a\n\ndata: b\n\n") == ["b"]
    # Bytes that only start like a BOM are kept.
    assert data_of(b"\xef", b"data: a\n\n") == []
    assert data_of(b"da", b"ta: a\n\n") == ["a"]


def test_an_unterminated_final_event_is_discarded() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: done\n\ndata: cut") == [ServerSentEvent("done")]
    assert decoder.feed(b" off\ndata: more\n") == []  # lines end, the event does not


def test_a_long_line_in_many_pieces() -> None:
    value = b"x" * 100_000
    line = b"data: " + value + b"\n\n"
    assert data_of(*(line[i : i + 7] for i in range(0, len(line), 7))) == [value.decode()]


def test_invalid_utf8_becomes_replacement_characters() -> None:
    assert data_of(b"data: a\xffb\n\n") == ["a\ufffdb"]


# Through UpstreamStream.chunks(), what the pipeline iterates.

VLLM_CHUNKS: list[dict[str, Any]] = [
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        ],
    },
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"content": "Gr\u00fc\u00df \u20ac\U0001f600"},
                "finish_reason": None,
            }
        ],
    },
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
    },
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    },
]
VLLM_STREAM = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in VLLM_CHUNKS)
VLLM_STREAM += b"data: [DONE]\n\n"


class _Content:
    def __init__(self, pieces: Iterable[bytes], error: BaseException | None) -> None:
        self.pieces = list(pieces)
        self.error = error

    async def iter_any(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece
        if self.error is not None:
            raise self.error


class _Response:
    """What `UpstreamStream` reads of an aiohttp response: its body's pieces, as sent."""

    def __init__(self, pieces: Iterable[bytes], error: BaseException | None = None) -> None:
        self.content = _Content(pieces, error)
        self.closed = False

    def close(self) -> None:
        self.closed = True


async def read_chunks(*pieces: bytes, error: BaseException | None = None) -> list[Any]:
    stream = UpstreamStream(cast(aiohttp.ClientResponse, _Response(pieces, error)))
    return [chunk async for chunk in stream.chunks()]


def awkward_splits(stream: bytes) -> Iterable[tuple[bytes, ...]]:
    yield tuple(stream[i : i + 1] for i in range(len(stream)))
    for size in (2, 3, 5, 7, 13, 64):
        yield tuple(stream[i : i + size] for i in range(0, len(stream), size))
    # Inside a multi-byte character, between an event's two line ends, between CR and LF.
    offsets = [stream.index(b"\xf0") + 2, stream.index(b"\n", stream.index(b"}")) + 1]
    offsets += [stream.index(b"\r") + 1] if b"\r" in stream else []
    for offset in offsets:
        yield stream[:offset], stream[offset:]
        yield stream[:offset], b"", stream[offset:]


async def test_vllm_chunks_split_at_awkward_offsets_give_every_payload_once() -> None:
    crlf = VLLM_STREAM.replace(b"\n", b"\r\n")
    for stream in (VLLM_STREAM, crlf, b": ping\n\n" + VLLM_STREAM):
        for pieces in awkward_splits(stream):
            assert await read_chunks(*pieces) == VLLM_CHUNKS, pieces


async def test_nothing_after_done_is_read() -> None:
    assert await read_chunks(b"data: [DONE]\n\ndata: not json\n\n") == []


async def test_an_error_event_mid_stream_raises_error_event() -> None:
    error = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
    stream = b"data: " + orjson.dumps(VLLM_CHUNKS[0]) + b"\n\ndata: " + orjson.dumps(error)
    stream += b"\n\ndata: [DONE]\n\n"
    seen: list[Any] = []
    with pytest.raises(UpstreamError) as raised:
        upstream = UpstreamStream(
            cast(aiohttp.ClientResponse, _Response([stream[:40], stream[40:]]))
        )
        async for chunk in upstream.chunks():
            seen.append(chunk)
    assert seen == [VLLM_CHUNKS[0]]
    assert raised.value.kind == "error_event"
    assert raised.value.status == 500
    assert raised.value.engine_message == "engine died"


async def test_json_split_over_data_lines_is_joined_before_parsing() -> None:
    assert await read_chunks(b'data: {"a":\ndata: 1}\n\ndata: [DONE]\n\n') == [{"a": 1}]


async def test_a_stream_ending_inside_an_event_is_broken_and_the_event_dropped() -> None:
    first = b"data: " + orjson.dumps(VLLM_CHUNKS[0]) + b"\n\n"
    seen: list[Any] = []
    with pytest.raises(UpstreamError) as raised:
        stream = UpstreamStream(cast(aiohttp.ClientResponse, _Response([first, b"data: [DONE]\n"])))
        async for chunk in stream.chunks():
            seen.append(chunk)
    assert raised.value.kind == "stream_broken"
    assert seen == [VLLM_CHUNKS[0]]


async def test_a_payload_that_is_not_json_is_stream_broken() -> None:
    with pytest.raises(UpstreamError) as raised:
        await read_chunks(b"data: <html>proxy error</html>\n\ndata: [DONE]\n\n")
    assert raised.value.kind == "stream_broken"


async def test_a_transport_error_is_stream_broken() -> None:
    with pytest.raises(UpstreamError) as raised:
        await read_chunks(VLLM_STREAM[:30], error=aiohttp.ClientPayloadError("reset"))
    assert raised.value.kind == "stream_broken"


async def test_a_real_aiohttp_response_written_in_awkward_pieces() -> None:
    """open_stream against a server that writes vLLM's stream a few bytes at a time."""
    stream = VLLM_STREAM.replace(b"\n", b"\r\n")

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(0, len(stream), 11):
            await response.write(stream[i : i + 11])
            await asyncio.sleep(0)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    session = make_session(UpstreamTimeouts())
    try:
        async with TestServer(app, host="127.0.0.1") as server:
            upstream = await open_stream(
                session,
                f"http://127.0.0.1:{server.port}",
                "/v1/chat/completions",
                {"model": "m", "messages": [], "stream": True},
            )
            try:
                chunks = [chunk async for chunk in upstream.chunks()]
            finally:
                upstream.close()
    finally:
        await session.close()
    assert chunks == VLLM_CHUNKS
