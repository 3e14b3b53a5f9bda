"""Streaming from a replica (vLLM or the engine simulator) over HTTP with aiohttp.

Connect and first-byte timeouts bound how long one unresponsive replica can hold a request;
closing the response aborts the generation in the engine (vLLM aborts a request whose client
went away).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

# An engine's error message longer than this is cut (vLLM's are a sentence or two).
MAX_ENGINE_MESSAGE_CHARS = 1000


class UpstreamError(Exception):
    """A replica failed: `kind` says how (connect, status, stream_broken, error_event),
    `status` carries an HTTP error status (the code of an error event), and
    `engine_message` and `param` what the engine said about it when its error body was
    readable. Whether a retry elsewhere is safe is the caller's to know (only before the
    first chunk)."""

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        status: int | None = None,
        engine_message: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.engine_message = engine_message
        self.param = param


def read_engine_error(body: bytes) -> tuple[str | None, str | None]:
    """The message and param of an engine's error body, (None, None) if it has none.

    vLLM answers errors with its `ErrorResponse`: flat in older versions
    (`{"object": "error", "message", "type", "param", "code": 400}`), nested in newer ones
    (`{"error": {"message", "type", "param", "code": 400}}`); an unknown route gets
    FastAPI's `{"detail": "Not Found"}`. Anything else (a proxy's HTML page, plain text) has
    no message the client could use."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(parsed, dict):
        return None, None
    return _error_fields(parsed)


def _error_fields(parsed: dict[str, Any]) -> tuple[str | None, str | None]:
    nested = parsed.get("error")
    fields = nested if isinstance(nested, dict) else parsed
    message = fields.get("message")
    if not isinstance(message, str):
        detail = parsed.get("detail")
        message = detail if isinstance(detail, str) else None
    message = (message or "").strip()[:MAX_ENGINE_MESSAGE_CHARS] or None
    param = fields.get("param")
    return message, param if isinstance(param, str) and param else None


def error_event(chunk: Any) -> UpstreamError | None:
    """The failure an engine reports inside a stream it already answered 200 for, or None
    for an ordinary chunk.

    vLLM's OpenAI server, when generation fails after the stream started, sends its error
    as one more event and then `[DONE]`: `{"error": {"message", "type", "param", "code"}}`,
    or in some versions the flat `{"object": "error", "message", ..., "code"}`. The code is
    the HTTP status vLLM would have answered (500 for an engine fault, 400 for a request it
    cannot finish); an event without a usable code is taken as the engine's fault."""
    if not isinstance(chunk, dict):
        return None
    nested = chunk.get("error")
    if nested:  # what the openai client raises on
        fields = nested if isinstance(nested, dict) else {"message": str(nested)}
    elif chunk.get("object") == "error":
        fields = chunk
    else:
        return None
    code = fields.get("code")
    status = code if isinstance(code, int) and 400 <= code <= 599 else 500
    message, param = _error_fields(fields)
    return UpstreamError(
        f"replica sent an error event mid-stream: {orjson.dumps(fields)[:500].decode()}",
        kind="error_event",
        status=status,
        engine_message=message,
        param=param,
    )


@dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    connect_s: float = 2.0
    # Until the response headers and then between chunks: a replica silent this long is
    # treated as failed.
    read_s: float = 30.0


def make_session(timeouts: UpstreamTimeouts) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(
            total=None,
            connect=timeouts.connect_s,
            sock_connect=timeouts.connect_s,
            sock_read=timeouts.read_s,
        ),
        json_serialize=lambda value: orjson.dumps(value).decode(),
        auto_decompress=False,
    )


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    data: str
    event: str = "message"
    id: str = ""


_BOM = b"\xef\xbb\xbf"


class SSEDecoder:
    """An incremental decoder of a `text/event-stream`, as the WHATWG HTML standard
    interprets one (html.spec.whatwg.org/multipage/server-sent-events.html, "Interpreting an
    event stream"): feed it the body's bytes as they arrive, split anywhere, and it returns
    the events each piece completed.

    Lines end in CRLF, LF or CR (a CR ending one piece and an LF starting the next are one
    line end); a leading UTF-8 BOM is skipped; `:` starts a comment; a field's value follows
    its first colon, less one leading space (a line without a colon is a field with an empty
    value); `data` lines join with LF; a blank line dispatches the event unless its data is
    empty. `event` names it, `id` sets the last event ID (kept across events, as the standard
    says), `retry` the reconnection time in ms (`retry_ms`); other fields are ignored. Lines
    are split as bytes, where CR and LF never occur inside a multi-byte UTF-8 character, and
    decoded (invalid UTF-8 as U+FFFD) once complete. Only the unfinished last line is kept
    between pieces, so the work is linear in the bytes fed. What is pending when the stream
    ends is an incomplete event, discarded: there is no flush."""

    def __init__(self) -> None:
        self.last_event_id = ""
        self.retry_ms: int | None = None
        self._head: bytes | None = b""  # the stream's first bytes until the BOM is ruled out
        self._partial: list[bytes] = []  # the pieces of the unfinished last line
        self._skip_lf = False  # the last piece ended in CR: an LF starting the next ends it
        self._data: list[bytes] = []
        self._event = b""

    def feed(self, piece: bytes) -> list[ServerSentEvent]:
        if self._head is not None:
            head = self._head + piece
            if len(head) < len(_BOM) and _BOM.startswith(head):
                self._head = head
                return []
            self._head = None
            piece = head[len(_BOM) :] if head.startswith(_BOM) else head
        if not piece:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if piece[:1] == b"\n":
                piece = piece[1:]
        if b"\n" not in piece and b"\r" not in piece:
            if piece:
                self._partial.append(piece)
            return []
        if self._partial:
            self._partial.append(piece)
            piece = b"".join(self._partial)
            self._partial = []
        lines = piece.splitlines(keepends=True)  # bytes: only at CRLF, LF and CR
        if not lines[-1].endswith((b"\n", b"\r")):
            self._partial.append(lines.pop())
        elif lines[-1].endswith(b"\r"):
            self._skip_lf = True
        events: list[ServerSentEvent] = []
        for line in lines:
            event = self._line(line.rstrip(b"\r\n"))
            if event is not None:
                events.append(event)
        return events

    def _line(self, line: bytes) -> ServerSentEvent | None:
        if not line:
            return self._dispatch()
        if line[:1] == b":":
            return None
        name, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
        elif name == b"event":
            self._event = value
        elif name == b"id" and b"\0" not in value:
            self.last_event_id = value.decode("utf-8", "replace")
        elif name == b"retry" and value.isdigit():  # bytes: ASCII digits only
            self.retry_ms = int(value)
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        data, self._data = self._data, []
        kind, self._event = self._event, b""
        if not data:
            return None
        return ServerSentEvent(
            data=b"\n".join(data).decode("utf-8", "replace"),
            event=kind.decode("utf-8", "replace") or "message",
            id=self.last_event_id,
        )


class UpstreamStream:
    """One streamed generation from a replica: iterate the decoded SSE chunks, then close."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The JSON payload of each event's data up to `[DONE]`; an error event raises
        `UpstreamError(kind="error_event")`, a stream that breaks or ends before `[DONE]`
        `UpstreamError(kind="stream_broken")`. Events of any type are read the same way
        (vLLM names none)."""
        decoder = SSEDecoder()
        try:
            async for data in self.response.content.iter_any():
                for event in decoder.feed(data):
                    if event.data.strip() == "[DONE]":
                        return
                    chunk = orjson.loads(event.data)
                    failure = error_event(chunk)
                    if failure is not None:
                        raise failure
                    yield chunk
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as error:
            # A payload that is not JSON is a broken stream too: the engine never sends one.
            raise UpstreamError(f"replica stream broke: {error!r}", kind="stream_broken") from error
        raise UpstreamError("replica closed the stream before [DONE]", kind="stream_broken")

    def close(self) -> None:
        # Dropping the connection (not returning it to the pool) makes the engine abort.
        self.response.close()


async def open_stream(
    session: aiohttp.ClientSession,
    endpoint: str,
    path: str,
    payload: dict[str, Any],
    api_key: str | None = None,
    extra_headers: dict[str, str] | None = None,
) -> UpstreamStream:
    """POST a streaming generation with the replica's engine key (and `extra_headers`: the
    traceparent of a traced request); return once the replica answered with 200 headers."""
    response = await _post(session, f"{endpoint}{path}", payload, api_key, extra_headers)
    return UpstreamStream(response)


async def post_json(
    session: aiohttp.ClientSession,
    endpoint: str,
    path: str,
    payload: dict[str, Any],
    api_key: str | None = None,
    extra_headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """POST a generation that is not streamed (a disaggregated request's prefill) and return
    its JSON answer; failures raise `UpstreamError` as `open_stream`'s do (a body that is not
    a JSON object, or that breaks off, is `stream_broken`). Cancelling the call drops the
    connection, which makes the engine abort."""
    response = await _post(session, f"{endpoint}{path}", payload, api_key, extra_headers)
    try:
        body = await response.read()
    except (aiohttp.ClientError, TimeoutError) as error:
        response.close()
        raise UpstreamError(f"replica answer broke: {error!r}", kind="stream_broken") from error
    finally:
        response.release()
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict):
        raise UpstreamError(
            f"replica answered 200 without a JSON object: {body[:200]!r}", kind="stream_broken"
        )
    failure = error_event(answer)
    if failure is not None:
        raise failure
    return answer


async def _post(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    api_key: str | None,
    extra_headers: dict[str, str] | None,
) -> aiohttp.ClientResponse:
    """The replica's 200 response to a POST; anything else raises `UpstreamError`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if extra_headers:
        headers.update(extra_headers)
    try:
        response = await session.post(url, json=payload, headers=headers)
    except (aiohttp.ClientError, TimeoutError, OSError) as error:
        raise UpstreamError(f"could not reach replica: {error!r}", kind="connect") from error
    if response.status != 200:
        try:
            body = await response.read()
        except (aiohttp.ClientError, TimeoutError):
            body = b""
        finally:
            response.release()
        engine_message, param = read_engine_error(body)
        raise UpstreamError(
            f"replica answered {response.status}: {body[:500].decode(errors='replace')}",
            kind="status",
            status=response.status,
            engine_message=engine_message,
            param=param,
        )
    return response
