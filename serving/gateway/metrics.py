"""Prometheus metrics of the gateway (one registry per process, scraped at /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
TOKEN_GAP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)

QUEUE_TIME = Histogram(
    "platform_gateway_queue_seconds",
    "Time a request waited in the gateway's admission queue before routing.",
    ["model", "pool", "tier"],
    buckets=LATENCY_BUCKETS,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "platform_gateway_time_to_first_token_seconds",
    "From the request's arrival at the gateway to its first token.",
    ["model", "pool", "tier"],
    buckets=LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "platform_gateway_inter_token_latency_seconds",
    "Gap between consecutive streamed chunks.",
    ["model", "pool", "tier"],
    buckets=TOKEN_GAP_BUCKETS,
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "platform_gateway_time_per_output_token_seconds",
    "A request's TPOT, the SLO's second clock: from its first token to its end over its "
    "completion tokens less one (requests of two tokens or more).",
    ["model", "pool", "tier"],
    buckets=TOKEN_GAP_BUCKETS,
)
SLO_REQUESTS = Counter(
    "platform_gateway_slo_requests_total",
    "Requests of tiers with objectives by what they met: met (TTFT and TPOT within the "
    "tier's objectives), ttft or tpot (the clock missed, TTFT first), failed (admitted, not "
    "answered); "
    "client-cancelled ones, and the engine's refusals of what the client wrote, are not judged.",
    ["model", "pool", "tier", "outcome"],
)
REQUEST_TIME = Histogram(
    "platform_gateway_request_seconds",
    "From arrival to the last byte.",
    ["model", "pool", "tier"],
    buckets=LATENCY_BUCKETS,
)
TOKENS = Counter(
    "platform_gateway_tokens_total",
    "Tokens served, by tenant, model and kind (prompt or completion).",
    ["tenant", "model", "kind"],
)
REQUESTS = Counter(
    "platform_gateway_requests_total",
    "Requests by model and outcome status.",
    ["model", "status"],
)
ROUTER_DECISIONS = Counter(
    "platform_router_decisions_total",
    "Router decisions by policy and reason.",
    ["policy", "reason"],
)
UPSTREAM_FAILURES = Counter(
    "platform_gateway_upstream_failures_total",
    "Failures talking to a replica, by pool and kind.",
    ["pool", "kind"],
)
SPOOLED_EVENTS = Counter(
    "platform_gateway_spooled_usage_events_total",
    "Usage events written to the local spool because Redis refused them.",
)
# Read from Redis on the gateway's refresh beat: the Celery workers serve no /metrics, and
# every gateway reports the same figure (take the max across them).
CONTROL_LOOP_FAILURES = Gauge(
    "platform_control_loop_failures",
    "Deployments, rollouts or tenants a control loop fails on now, by loop.",
    ["loop"],
)
CONTROL_LOOP_LAST_PASS = Gauge(
    "platform_control_loop_last_pass_timestamp_seconds",
    "When a control loop's last pass ended (Unix time), by loop.",
    ["loop"],
)
