"""An engine's refusal of a request (HTTP 4xx) as the client sees it: the engine's own
message and param in OpenAI's shape, whichever shape the engine's body had, never the
engine's JSON quoted inside a message."""

from __future__ import annotations

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from serving.gateway.pipeline import refused_by_engine
from serving.gateway.upstream import UpstreamError, UpstreamTimeouts, make_session, open_stream

SENTENCE = (
    "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens "
    "(1000 in the messages, 8000 in the completion). Please reduce the length of the messages "
    "or completion."
)


async def refusal(status: int, body: bytes, content_type: str) -> UpstreamError:
    """What `open_stream` raises when a replica answers `status` with `body`."""

    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, content_type=content_type)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    session = make_session(UpstreamTimeouts())
    try:
        async with TestServer(app, host="127.0.0.1") as server:
            with pytest.raises(UpstreamError) as raised:
                await open_stream(
                    session,
                    f"http://127.0.0.1:{server.port}",
                    "/v1/chat/completions",
                    {"model": "m", "messages": []},
                )
    finally:
        await session.close()
    return raised.value


async def test_older_vllms_flat_error_response_passes_its_message_and_param() -> None:
    body = {
        "object": "error",
        "message": SENTENCE,
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": 400,
    }
    error = refused_by_engine(await refusal(400, orjson.dumps(body), "application/json"))
    assert error.status == 400
    assert error.payload() == {
        "error": {
            "message": SENTENCE,
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "invalid_request",
        }
    }


async def test_newer_vllms_nested_error_response_passes_its_message_and_param() -> None:
    body = {
        "error": {
            "message": SENTENCE,
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
    }
    error = refused_by_engine(await refusal(400, orjson.dumps(body), "application/json"))
    assert error.status == 400
    assert error.message == SENTENCE
    assert error.param == "max_tokens"
    assert error.error_type == "invalid_request_error"


async def test_an_engine_error_without_a_param_has_none() -> None:
    body = {
        "error": {
            "message": "temperature must be non-negative",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    error = refused_by_engine(await refusal(400, orjson.dumps(body), "application/json"))
    assert error.message == "temperature must be non-negative"
    assert error.param is None


async def test_a_422_stays_a_422() -> None:
    body = {"error": {"message": "unprocessable", "type": "BadRequestError", "code": 422}}
    error = refused_by_engine(await refusal(422, orjson.dumps(body), "application/json"))
    assert error.status == 422
    assert error.error_type == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"Bad Request", "text/plain"),
        (b"<html><body><h1>400 Bad Request</h1></body></html>", "text/html"),
        (b"", "text/plain"),
        (b'["not", "an", "error"]', "application/json"),
        (b'{"error": {"type": "BadRequestError", "code": 400}}', "application/json"),
    ],
)
async def test_a_body_without_a_message_gets_a_generic_one_naming_the_status(
    body: bytes, content_type: str
) -> None:
    error = refused_by_engine(await refusal(400, body, content_type))
    assert error.status == 400
    assert error.message.startswith("The model engine refused the request with HTTP 400")
    assert error.param is None
    assert error.error_type == "invalid_request_error"


async def test_fastapis_detail_is_taken_as_the_message() -> None:
    error = refused_by_engine(
        await refusal(405, b'{"detail": "Method Not Allowed"}', "application/json")
    )
    assert error.status == 400
    assert error.message == "Method Not Allowed"


async def test_a_very_long_engine_message_is_cut() -> None:
    body = {"error": {"message": "x" * 50_000, "type": "BadRequestError", "code": 400}}
    error = refused_by_engine(await refusal(400, orjson.dumps(body), "application/json"))
    assert 0 < len(error.message) <= 1000
