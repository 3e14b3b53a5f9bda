"""Tracing of /v1 requests: one root span per generation with its phases as children, an
incoming traceparent continued, the engine handed the trace, the usage event naming it, and
nothing at all when tracing is off."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import httpx
import pytest
import redis
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import config.gateway
from serving.gateway.service import Gateway
from serving.gateway.tracing import TracingConfig
from tenants.actions import load_principal_from_database
from tests.gateway.conftest import (
    MODEL,
    Fleet,
    GatewayServer,
    free_port,
    publish_catalog,
    wait_until,
)
from tests.metering.helpers import stream_events

pytestmark = pytest.mark.slow

PHASES = {
    "gateway.guardrails",
    "gateway.admission",
    "gateway.routing",
    "gateway.upstream",
    "gateway.upstream_connect",
    "gateway.first_token",
    "gateway.decode",
    "gateway.settle",
}
# A traceparent from a caller that traces its own work (W3C Trace Context's example ids).
CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_TRACEPARENT = f"00-{CALLER_TRACE_ID}-00f067aa0ba902b7-01"


@dataclass
class RecordingProxy:
    """Between the gateway and an engine simulator: passes every request on and keeps the
    headers the engine was sent."""

    upstream: str
    port: int = field(default_factory=free_port)
    seen: list[dict[str, str]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def forward(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(dict(request.headers))
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                request.method,
                f"{self.upstream}{request.path_qs}",
                data=await request.read(),
                headers=headers,
            ) as reply,
        ):
            response = web.StreamResponse(status=reply.status)
            response.content_type = reply.content_type
            await response.prepare(request)
            async for piece in reply.content.iter_any():
                await response.write(piece)
            await response.write_eof()
            return response

    def start(self) -> None:
        ready = threading.Event()

        async def serve() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self.forward)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            ready.set()
            await asyncio.Event().wait()

        threading.Thread(target=lambda: asyncio.run(serve()), daemon=True).start()
        ready.wait(10)


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """The gateway's spans, kept in memory: its tracing turned on with an in-memory exporter."""
    exporter = InMemorySpanExporter()

    def build() -> Gateway:
        return Gateway(
            config.gateway.gateway_config(),
            load_principal=load_principal_from_database,
            span_processor=SimpleSpanProcessor(exporter),
        )

    monkeypatch.setattr(config.gateway, "build_gateway", build)
    return exporter


@pytest.fixture
def traced(
    spans: InMemorySpanExporter, fleet: Fleet, make_key, redis_client: redis.Redis
) -> Iterator[tuple[httpx.Client, RecordingProxy]]:
    """A traced gateway in front of one engine simulator behind a recording proxy."""
    sim = fleet.start()
    proxy = RecordingProxy(sim.url)
    proxy.start()
    sim.port = proxy.port  # the routing table sends the gateway through the proxy
    fleet.publish()
    publish_catalog(redis_client)
    server = GatewayServer(free_port())
    server.start()
    key = make_key("acme")
    http = httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {key.secret}"}, timeout=30
    )
    yield http, proxy
    http.close()
    server.stop()


def _stream(http: httpx.Client, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": True,
    }
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
        reply.read()
    return reply


def _finished(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    """The spans by name, once the root (ended after the settle) is among them."""
    assert wait_until(
        lambda: any(s.name.startswith("POST ") for s in exporter.get_finished_spans())
    )
    return {span.name: span for span in exporter.get_finished_spans()}


def test_a_streamed_request_is_one_root_span_with_every_phase_as_its_child(
    traced: tuple[httpx.Client, RecordingProxy], spans: InMemorySpanExporter
) -> None:
    http, _ = traced

    reply = _stream(http)

    assert reply.status_code == 200
    by_name = _finished(spans)
    root = by_name["POST /v1/chat/completions"]
    assert root.parent is None
    assert set(by_name) >= PHASES
    for name in PHASES:
        span = by_name[name]
        assert span.context is not None and root.context is not None
        assert span.context.trace_id == root.context.trace_id
        assert span.parent is not None and span.parent.span_id == root.context.span_id, name
    attributes = dict(root.attributes or {})
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["request.status"] == "ok"
    assert attributes["gen_ai.usage.completion_tokens"] == 4
    assert attributes["replica.id"]
    # The phases follow one another: connect, then the wait for a token, then decode.
    connect, first, decode = (
        by_name[n] for n in ("gateway.upstream_connect", "gateway.first_token", "gateway.decode")
    )
    assert connect.end_time is not None and first.start_time is not None
    assert connect.end_time <= first.start_time
    assert first.end_time is not None and decode.start_time is not None
    assert first.end_time <= decode.start_time


def test_an_incoming_traceparent_is_continued_and_handed_to_the_engine(
    traced: tuple[httpx.Client, RecordingProxy],
    spans: InMemorySpanExporter,
    redis_client: redis.Redis,
) -> None:
    http, proxy = traced

    reply = _stream(http, {"traceparent": CALLER_TRACEPARENT})

    assert reply.status_code == 200
    by_name = _finished(spans)
    root = by_name["POST /v1/chat/completions"]
    assert root.context is not None and format(root.context.trace_id, "032x") == CALLER_TRACE_ID
    assert root.parent is not None and format(root.parent.span_id, "016x") == "00f067aa0ba902b7"
    # The engine was told the trace, with the gateway's upstream span as its parent.
    upstream = by_name["gateway.upstream"]
    assert upstream.context is not None
    [sent] = [h for h in proxy.seen if h.get("traceparent")]
    expected = f"00-{CALLER_TRACE_ID}-{format(upstream.context.span_id, '016x')}-01"
    assert sent["traceparent"] == expected
    # The usage event names the trace, for the console to show beside it.
    assert wait_until(lambda: len(stream_events(redis_client)) == 1)
    [event] = stream_events(redis_client)
    assert event.trace_id == CALLER_TRACE_ID


def test_a_request_its_caller_did_not_sample_records_no_span_and_tells_the_engine_so(
    traced: tuple[httpx.Client, RecordingProxy],
    spans: InMemorySpanExporter,
    redis_client: redis.Redis,
) -> None:
    http, proxy = traced

    reply = _stream(http, {"traceparent": f"00-{CALLER_TRACE_ID}-00f067aa0ba902b7-00"})

    assert reply.status_code == 200
    assert wait_until(lambda: len(stream_events(redis_client)) == 1)
    [event] = stream_events(redis_client)
    assert event.trace_id == ""
    assert spans.get_finished_spans() == ()
    [sent] = [h for h in proxy.seen if h.get("traceparent")]
    assert sent["traceparent"].startswith(f"00-{CALLER_TRACE_ID}-")
    assert sent["traceparent"].endswith("-00")


def test_a_request_refused_before_its_stream_is_a_root_span_with_the_refusal(
    traced: tuple[httpx.Client, RecordingProxy], spans: InMemorySpanExporter
) -> None:
    http, proxy = traced
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}

    reply = http.post("/v1/chat/completions", json=body)

    assert reply.status_code == 404
    [root] = _finished(spans).values()
    attributes = dict(root.attributes or {})
    assert attributes["http.response.status_code"] == 404
    assert attributes["error.type"] == "model_not_found"
    assert not [h for h in proxy.seen if h.get("traceparent")]


def test_with_tracing_off_no_span_is_made(
    ready: tuple[GatewayServer, object, httpx.Client],
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, _, http = ready

    def no_trace(*args: object, **kwargs: object) -> None:
        raise AssertionError("a request trace was made with tracing off")

    # Made, it would fail the request (a 500): the hot path never reaches it.
    monkeypatch.setattr("serving.gateway.asgi.RequestTrace", no_trace)
    reply = _stream(http, {"traceparent": CALLER_TRACEPARENT})

    assert reply.status_code == 200
    gateway = server.gateway()
    assert gateway.tracer is None and gateway.tracer_provider is None
    assert wait_until(lambda: len(stream_events(redis_client)) == 1)
    [event] = stream_events(redis_client)
    assert event.trace_id == ""


def test_the_settings_turn_tracing_on_with_the_otlp_exporter_and_ratio_sampler() -> None:
    from opentelemetry.sdk.trace.sampling import ParentBased

    from serving.gateway.tracing import build_provider

    assert build_provider(TracingConfig()) is None
    provider = build_provider(
        TracingConfig(endpoint="http://127.0.0.1:1/v1/traces", sample_ratio=0.25)
    )
    assert provider is not None
    assert isinstance(provider.sampler, ParentBased)
    assert "0.25" in provider.sampler.get_description()
    assert provider.resource.attributes["service.name"] == "inference-gateway"
    provider.shutdown()
