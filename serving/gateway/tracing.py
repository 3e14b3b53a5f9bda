"""OpenTelemetry spans of one /v1 generation, and the W3C traceparent that joins the engine's.

    POST /v1/chat/completions (server span; continues an incoming traceparent)
      gateway.guardrails  gateway.admission  gateway.routing  [gateway.queue_wait]
      gateway.upstream (client span, one per replica tried; its context is the traceparent
        sent to the engine, so vLLM's llm_request span is its child)
      gateway.upstream_connect  gateway.first_token  gateway.decode  gateway.settle

Off (no OTEL_TRACES_ENDPOINT) there is no provider and no span object at all: the exchange's
`trace` is None and each phase costs one `is None` test. A request the ratio sampler leaves
out gets a `RequestTrace` whose root is not recording: it still sends the engine a traceparent
(flagged not sampled, so vLLM's parent-based sampler records nothing either), and creates no
phase spans. Spans are started and ended explicitly, never made current: nothing here touches
contextvars, and the transports' tasks need not carry a context.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

PROPAGATOR = TraceContextTextMapPropagator()
INSTRUMENTATION = "serving.gateway"


@dataclass(frozen=True, slots=True)
class TracingConfig:
    # The OTLP/HTTP traces URL (http://collector:4318/v1/traces); empty is off.
    endpoint: str = ""
    sample_ratio: float = 1.0
    service_name: str = "inference-gateway"


def build_provider(
    config: TracingConfig, processor: SpanProcessor | None = None
) -> TracerProvider | None:
    """The gateway's own provider (not the process-global one), or None when tracing is off.
    `processor` replaces the batching OTLP exporter (tests pass an in-memory one)."""
    if not config.endpoint and processor is None:
        return None
    provider = TracerProvider(
        resource=Resource.create({"service.name": config.service_name}),
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
    )
    provider.add_span_processor(
        processor or BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint))
    )
    return provider


class RequestTrace:
    """The root span of one request and the phase spans under it."""

    __slots__ = ("_context", "_tracer", "root", "sampled")

    def __init__(self, tracer: Tracer, name: str, traceparent: str, tracestate: str) -> None:
        self._tracer = tracer
        carrier = {"traceparent": traceparent, "tracestate": tracestate} if traceparent else {}
        parent = PROPAGATOR.extract(carrier) if carrier else None
        self.root = tracer.start_span(name, context=parent, kind=SpanKind.SERVER)
        self.sampled = self.root.is_recording()
        self._context: Context = set_span_in_context(self.root)

    @property
    def trace_id(self) -> str:
        """The 32 hex digits of a sampled trace; empty for one left out."""
        return format(self.root.get_span_context().trace_id, "032x") if self.sampled else ""

    def start(self, name: str, *, kind: SpanKind = SpanKind.INTERNAL) -> Span | None:
        """A phase span under the root, started now; None when the request is not sampled."""
        if not self.sampled:
            return None
        return self._tracer.start_span(name, context=self._context, kind=kind)

    def headers(self, span: Span | None) -> dict[str, str]:
        """The traceparent (and tracestate) naming `span` (the root when None) as the parent."""
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier, context=set_span_in_context(span or self.root))
        return carrier

    def refused(self, status: int, code: str | None) -> None:
        """The request was answered with an error before (or instead of) its stream."""
        if self.sampled:
            self.root.set_attributes(
                {"http.response.status_code": status, "error.type": code or str(status)}
            )
            if status >= 500:
                self.root.set_status(StatusCode.ERROR)

    def finish(self, attributes: Mapping[str, AttributeValue]) -> None:
        if self.sampled:
            self.root.set_attributes(attributes)
        self.root.end()


def end(span: Span | None, **attributes: AttributeValue) -> None:
    """End a phase span (None: not traced) with its attributes."""
    if span is not None:
        if attributes:
            span.set_attributes(attributes)
        span.end()
