"""What stands in front of every request: who may read /metrics, how long a body may take,
how many requests one client may hold open, and a fast 503 when PostgreSQL is not answering.

The first three are ASGI wrappers around the whole application (config/asgi.py), so they
cover the /v1 gateway, Django and WebSockets alike. The client address is `scope["client"]`
as uvicorn leaves it: behind the Ingress, `--proxy-headers` has replaced the proxy's address
with the caller's from X-Forwarded-For (the same rule the rest of the app sees).

- /metrics: with PLATFORM_METRICS_TOKEN set, only `Authorization: Bearer <token>` reads it
  (401 otherwise). Without it, only a loopback caller that came through no proxy (no
  X-Forwarded-For or Forwarded header): `make run` and the tests; everyone else gets 404.
- Body deadline: a request's whole body must arrive within REQUEST_BODY_DEADLINE_S of its
  start, or the caller is answered 408 and the connection closed; the app behind sees a
  disconnect. Headers are uvicorn's to read and never reach an ASGI app: their deadline is the
  Ingress's (`client-header-timeout`).
- Open requests per client: at most MAX_OPEN_REQUESTS_PER_CLIENT HTTP requests and WebSockets
  at once from one address, per process (429, or a refused handshake, beyond it). An idle
  keep-alive connection holds no request; uvicorn closes it after --timeout-keep-alive.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from django.conf import settings
from django.db import OperationalError
from django.http import HttpRequest, HttpResponse
from django.middleware.common import CommonMiddleware as DjangoCommonMiddleware

from config.nul import NUL_MESSAGE, has_nul, names_with_nul
from serving.gateway.errors import ApiError

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

METRICS_PATH = "/metrics"
DATABASE_RETRY_AFTER_S = 5


def client_host(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else ""


def header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value).decode("latin-1")
    return ""


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def error_body(path: str, status: int, message: str, code: str) -> bytes:
    """The error in the format of the API the path belongs to: OpenAI's on /v1, DRF's else."""
    if path == "/v1" or path.startswith("/v1/"):
        return ApiError(status, message, code=code).body()  # the type by status, as /v1's own
    return orjson.dumps({"detail": message})


async def send_plain(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def metrics_allowed(scope: Scope) -> bool:
    token = str(settings.PLATFORM_METRICS_TOKEN)
    if token:
        presented = header(scope, b"authorization").encode("latin-1")
        return hmac.compare_digest(presented, f"Bearer {token}".encode())
    proxied = header(scope, b"x-forwarded-for") or header(scope, b"forwarded")
    return is_loopback(client_host(scope)) and not proxied


class MetricsAccess:
    """Lets /metrics through to the app behind only for the scraper (see the module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") != METRICS_PATH or metrics_allowed(scope):
            await self.app(scope, receive, send)
            return
        if settings.PLATFORM_METRICS_TOKEN:
            headers = [(b"content-type", b"text/plain"), (b"www-authenticate", b"Bearer")]
            await send_plain(send, 401, b"A scrape token is required.\n", headers)
        else:
            await send_plain(send, 404, b"Not found.\n", [(b"content-type", b"text/plain")])


class BodyDeadline:
    """Answers 408 and closes when a request's body has not all arrived within `deadline_s`."""

    def __init__(self, app: ASGIApp, deadline_s: float) -> None:
        self.app = app
        self.deadline_s = deadline_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.deadline_s <= 0:
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.deadline_s
        body_done = False
        timed_out = False
        started = False

        async def receive_in_time() -> Message:
            nonlocal body_done, timed_out
            if timed_out:
                return {"type": "http.disconnect"}
            if body_done:  # after the body, a disconnect watcher may wait as long as it likes
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                timed_out = True
                if not started:
                    body = error_body(
                        scope.get("path", ""),
                        408,
                        f"The request body did not arrive within {self.deadline_s:g} s.",
                        "request_timeout",
                    )
                    headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
                    await send_plain(send, 408, body, headers)
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body"):
                body_done = True
            return message

        async def send_unless_answered(message: Message) -> None:
            nonlocal started
            if timed_out:
                return  # the 408 was the answer
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, receive_in_time, send_unless_answered)


class OpenRequestsPerClient:
    """Refuses a client's request or WebSocket beyond `limit` open at once (per process)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.open: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in {"http", "websocket"} or self.limit <= 0:
            await self.app(scope, receive, send)
            return
        address = client_host(scope)
        if self.open[address] >= self.limit:
            log.warning("refused a %s from %s: %d open", scope["type"], address, self.limit)
            await self.refuse(scope, receive, send)
            return
        self.open[address] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open[address] -= 1
            if self.open[address] <= 0:
                del self.open[address]

    async def refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await receive()  # websocket.connect; closing before accepting refuses the handshake
            await send({"type": "websocket.close", "code": 1008})
            return
        message = f"More than {self.limit} requests open from your address; retry shortly."
        body = error_body(scope.get("path", ""), 429, message, "too_many_connections")
        headers = [
            (b"content-type", b"application/json"),
            (b"retry-after", b"1"),
            (b"connection", b"close"),
        ]
        await send_plain(send, 429, body, headers)


def with_edge_guards(app: ASGIApp) -> ASGIApp:
    """The application wrapped in the guards above, outermost first: the per-client cap, the
    body deadline, then /metrics access."""
    guarded = BodyDeadline(MetricsAccess(app), float(settings.REQUEST_BODY_DEADLINE_S))
    return OpenRequestsPerClient(guarded, int(settings.MAX_OPEN_REQUESTS_PER_CLIENT))


DATABASE_PAGE = (
    "<!doctype html><html lang=en><head><meta charset=utf-8>"
    "<title>Database unavailable</title></head><body>"
    "<h1>The database is not answering</h1>"
    "<p>This page needs PostgreSQL, which did not answer in time. "
    "Try again in a few seconds.</p></body></html>"
)


class DatabaseUnavailableMiddleware:
    """A request that meets a database timeout or an unreachable PostgreSQL answers 503 with
    Retry-After at once, in the format of its part of the site, never a 500.

    The connect and statement timeouts (settings.DATABASES) make that error come fast. It sits
    right after AuthenticationMiddleware and looks the user up itself: the session and user
    queries are the first most requests make, and a middleware below that met the error
    (second factor, throttling) would turn it into a 500 before any view ran. A view's own
    error reaches `process_exception`."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        try:
            # No session cookie, no query: /healthz, /readyz and API-key calls cost nothing.
            _ = request.user.is_authenticated
        except OperationalError as error:
            return self.unavailable(request, error)
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not isinstance(exception, OperationalError):
            return None
        return self.unavailable(request, exception)

    def unavailable(self, request: HttpRequest, error: Exception) -> HttpResponse:
        log.warning("database unavailable on %s: %s", request.path, error)
        response: HttpResponse
        message = "The database is not answering; retry shortly."
        if request.path.startswith("/api/") or request.path.startswith("/v1"):
            body = error_body(request.path, 503, message, "database_unavailable")
            response = HttpResponse(body, status=503, content_type="application/json")
        else:
            response = HttpResponse(DATABASE_PAGE, status=503)
        response["Retry-After"] = str(DATABASE_RETRY_AFTER_S)
        return response


NUL_PAGE = (
    "<!doctype html><title>Bad request</title><h1>Bad request</h1>"
    f"<p>{NUL_MESSAGE} Go back and remove them.</p>"
).encode()


class NulCharactersRefused:
    """A page's query or form holding a NUL character answers 400 with a message: PostgreSQL
    stores none in text, so the form's save would be a DataError, a 500. The REST API refuses
    them field by field (config.api.refuse_nul_bytes); /v1 is the gateway's."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not request.path.startswith(("/api/", "/v1")) and self._holds_nul(request):
            return HttpResponse(NUL_PAGE, status=400)
        return self.get_response(request)

    @staticmethod
    def _holds_nul(request: HttpRequest) -> bool:
        sources = [request.GET, request.POST] if request.method == "POST" else [request.GET]
        return has_nul(request.path) or any(names_with_nul(source) for source in sources)


class CommonMiddleware(DjangoCommonMiddleware):
    """Django's, but a POST, PUT, PATCH or DELETE to a path missing its trailing slash is
    that path's 404 (in the format of its part of the site), never a redirect: a redirect
    drops the body, and under DEBUG Django raises instead, a 500."""

    def should_redirect_with_slash(self, request: HttpRequest) -> bool:
        if request.method not in ("GET", "HEAD"):
            return False
        return super().should_redirect_with_slash(request)
