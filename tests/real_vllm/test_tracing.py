"""One streamed request traced through the gateway and real vLLM: the gateway's phase spans
and the engine's own spans reach one OTLP receiver in one trace, the engine's under the
gateway's upstream span (the traceparent the gateway sent), and the usage event names it."""

from __future__ import annotations

import openai
import pytest

from metering.usage import UsageEvent
from tests.gateway.test_tracing import PHASES
from tests.live import eventually
from tests.metering.helpers import stream_events
from tests.real_vllm.conftest import TINY_MODEL, RealFleet
from tests.real_vllm.otlp import ReceivedSpan

pytestmark = [pytest.mark.real_vllm, pytest.mark.slow, pytest.mark.django_db]


def _usage_event(fleet: RealFleet, request_id: str) -> UsageEvent:
    def find() -> UsageEvent | None:
        return next((e for e in stream_events(fleet.redis) if e.request_id == request_id), None)

    return eventually(find, 15, f"usage event {request_id}")


def test_a_streamed_request_is_traced_through_the_gateway_into_vllms_own_spans(
    real_fleet: RealFleet,
) -> None:
    client = openai.OpenAI(
        base_url=real_fleet.base_url, api_key=real_fleet.keys["acme"], max_retries=0
    )

    raw = client.chat.completions.with_raw_response.create(
        model=TINY_MODEL,
        messages=[{"role": "user", "content": "trace this request"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(raw.parse())
    request_id = raw.headers["x-request-id"]

    assert chunks and chunks[-1].usage is not None
    trace_id = _usage_event(real_fleet, request_id).trace_id
    assert len(trace_id) == 32 and int(trace_id, 16)

    # Both exporters batch (vLLM's every 5 s): wait for the gateway's root and vLLM's span.
    def whole_trace() -> list[ReceivedSpan] | None:
        spans = real_fleet.traces.trace(trace_id)
        services = {span.service for span in spans}
        root_done = any(s.name == "POST /v1/chat/completions" for s in spans)
        return spans if root_done and "vllm" in services else None

    spans = eventually(whole_trace, 60, f"the gateway's and vLLM's spans of trace {trace_id}")
    gateway = [s for s in spans if s.service == "inference-gateway"]
    engine = [s for s in spans if s.service == "vllm"]
    [root] = [s for s in gateway if s.name == "POST /v1/chat/completions"]
    assert root.parent_span_id == ""
    assert root.attributes["gen_ai.request.model"] == TINY_MODEL
    assert root.attributes["request.status"] == "ok"
    assert root.attributes["gen_ai.usage.completion_tokens"] == chunks[-1].usage.completion_tokens
    phases = {s.name: s for s in gateway if s is not root}
    assert set(phases) >= PHASES
    assert all(phases[name].parent_span_id == root.span_id for name in PHASES)
    # The engine's request span is a child of the gateway's upstream span: the traceparent.
    [llm_request] = [s for s in engine if s.name == "llm_request"]
    assert llm_request.parent_span_id == phases["gateway.upstream"].span_id
    assert llm_request.attributes["gen_ai.usage.completion_tokens"] == (
        chunks[-1].usage.completion_tokens
    )
    # Every engine span hangs off a span of this trace (none is a second root).
    span_ids = {s.span_id for s in spans}
    assert all(s.parent_span_id in span_ids for s in engine)
