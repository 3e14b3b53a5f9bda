"""One generation request through the data plane, independent of the transport.

    authenticate -> validate -> guardrails -> admit (one Redis call) -> route
    -> proxy the stream (retry elsewhere only before the first token) -> settle (one Redis
    pipeline: refund or charge, release the stream slot, XADD the usage event)

`Exchange.prepare()` raises `ApiError` before anything is sent to the client; `Exchange.events()`
then yields the OpenAI-shaped chunks, and settles in a `finally` whatever happens: a client
that disconnects, a replica that dies mid-stream, a bug. The SSE and WebSocket transports and
the non-streaming JSON response all consume the same `events()`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span, SpanKind

from metering.usage import Status, UsageEvent
from serving.engine.tokens import estimate_prompt_tokens, prompt_block_hashes
from serving.gateway import metrics
from serving.gateway.access import PRIORITY_HEADER
from serving.gateway.contracts import ExchangeServices
from serving.gateway.errors import ApiError, replica_failed
from serving.gateway.guardrails import GuardrailInput, run_guardrails
from serving.gateway.routing import ReplicaEndpoint
from serving.gateway.schemas import ChatCompletionRequest, CompletionRequest
from serving.gateway.tracing import RequestTrace, end
from serving.gateway.upstream import UpstreamError, UpstreamStream, open_stream, post_json
from serving.router import Decision, ReplicaState, RouteRequest
from serving.router.contracts import Tier, slo_outcome, time_per_output_token
from tenants.keys import KeyPrincipal
from tenants.limiter import Admission, Reservation

log = logging.getLogger(__name__)

# Yielded by `Exchange.events()` once the upstream finished cleanly, before the settle.
END_OF_STREAM: dict[str, Any] = {}
# Prefix blocks considered for affinity: enough to recognise a shared system prompt.
MAX_PREFIX_BLOCKS = 64


# Engine statuses that say the request itself is wrong, passed on as they are; any other
# 4xx from an engine reaches the client as a 400, except these:
CLIENT_ERROR_STATUSES = frozenset({400, 413, 422})
# Engine statuses that refuse the gateway, not the request: the replica's API key is not the
# one the gateway sends, or the engine's own rate limit. The replica's failure, like a 5xx:
# the request goes to another replica, and the client never sees the engine's 401/403/429.
REPLICA_REFUSALS = frozenset({401, 403, 429})
# An engine's internal error: the replica's fault, or the request's when it repeats elsewhere.
ENGINE_INTERNAL_ERROR = 500
# A disaggregated request's prefill asks the engine to keep the prompt's KV for a decode
# elsewhere, with the fields vLLM's disaggregated proxy sends
# (vllm tests/v1/kv_connector/nixl_integration/toy_proxy_server.py) and llm-d's routing
# sidecar too; the answer's `kv_transfer_params` say where the decode pulls it from.
REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def engine_cache_salt(tenant_id: object) -> str:
    return f"tenant-{tenant_id}"


class RefusedByEngine(ApiError):
    """The engine refused the request as the client wrote it: its usage status is
    "refused", which the SLO does not judge."""


def refused_by_engine(error: UpstreamError) -> RefusedByEngine:
    """The engine's refusal of the request (longer than its context, a parameter it does
    not accept) in OpenAI's shape, with the engine's own message and param."""
    status = error.status if error.status in CLIENT_ERROR_STATUSES else 400
    message = error.engine_message or (
        f"The model engine refused the request with HTTP {error.status} and gave no reason; "
        "check the request's parameters against the model's limits."
    )
    return RefusedByEngine(status, message, code="invalid_request", param=error.param)


def replica_at_fault(error: UpstreamError) -> bool:
    """Whether the failure is the replica's (it counts toward its breaker), not the
    request's: no status (unreachable, cut off), a server error, or a refusal of the
    gateway itself."""
    status = error.status
    return status is None or not 400 <= status < 500 or status in REPLICA_REFUSALS


def failed_in_engine(error: UpstreamError, *, streamed: bool) -> ApiError:
    """An error the engine reported in a stream it had already started, in OpenAI's shape
    with the engine's own message."""
    if not replica_at_fault(error):
        return refused_by_engine(error)
    billed = "the tokens received so far are billed" if streamed else "no output is billed"
    message = error.engine_message or (
        f"The model engine failed mid-generation and gave no reason; {billed}."
    )
    return ApiError(502, message, code="upstream_error", error_type="server_error")


@dataclass(slots=True)
class Outcome:
    """What happened, filled in as the exchange runs; settle reads it."""

    status: Status = "ok"
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    queue_s: float = 0.0
    # The replica that streamed (or was to stream) the answer; for a disaggregated request
    # the decode replica, `prefill_replica` the one that prefilled the prompt.
    replica: ReplicaEndpoint | None = None
    prefill_replica: ReplicaEndpoint | None = None
    error: str | None = None


@dataclass(slots=True)
class Exchange:
    gateway: ExchangeServices
    kind: str  # "chat" or "completion"
    body: ChatCompletionRequest | CompletionRequest
    principal: KeyPrincipal
    tier: Tier
    # A WebSocket generation streams whatever its body says.
    over_websocket: bool = False
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: float = field(default_factory=time.time)
    started_mono: float = field(default_factory=time.monotonic)
    model: str = ""
    adapter: str | None = None
    base_model: str = ""
    prompt_estimate: int = 0
    prompt_text: str = ""
    max_tokens: int = 0
    admission: Admission | None = None
    decision: Decision | None = None
    headers: dict[str, str] = field(default_factory=dict)
    outcome: Outcome = field(default_factory=Outcome)
    response_id: str | None = None
    # The request's spans (None: tracing is off, and every phase costs one `is None` test).
    trace: RequestTrace | None = None
    _upstream: UpstreamStream | None = None
    _settled: bool = False
    # `check()` passed (an idempotent request runs it before claiming its key).
    _checked: bool = False
    _complete: bool = False
    # The replica whose in-flight count this request holds (between started and finished).
    _started_on: str | None = None
    # The TPOT objective it decodes under there, as the router was told (Decision's).
    _started_objective: float | None = None
    # When it was sent there (monotonic), and the decision whose TTFT prediction its first
    # token is held against (None: one not to learn from, such as a disaggregated one).
    _started_at: float = 0.0
    _predicted_by: Decision | None = None
    # True once a replica accepted the request and produced its first chunk.
    _accepted: bool = False
    # Whether the replica's breaker got a verdict (success or failure) from this request.
    _verdict: bool = False
    # A replica that answered 500 before its first token, and the failure's kind, while the
    # request is tried on a second one: its breaker counts it only if that one succeeds.
    _suspect: tuple[ReplicaEndpoint, str] | None = None
    # When the last generated token reached us (for the inter-token latency).
    _last_token_at: float | None = None
    # A stream longer than its concurrency lease renews it, so the slot is not reclaimed
    # from under a healthy stream (the lease still expires if this gateway dies).
    _renew_lease_at: float = math.inf
    # The open phase spans of the replica being tried (only while traced).
    _upstream_span: Span | None = None
    _first_token_span: Span | None = None
    _decode_span: Span | None = None
    # A disaggregated request's prompt tokens that the prefill replica's prefix cache held
    # (the decode engine reports every prompt token it received over the KV link as cached).
    _prefill_cached: int | None = None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"

    # --- before the first byte -------------------------------------------------------------

    async def check(self) -> None:
        """Whether this key may send this request: the model (the tenant's catalog and the
        key's allowlist), the key's caps, the guardrails and the priority tier. The same for
        a fresh request and an idempotent replay, which runs it before the stored response
        is returned (a replay must not let a key read what it could not have asked for)."""
        if self._checked:
            return
        self._resolve_model()
        texts = self._check_request()
        span = self.trace.start("gateway.guardrails") if self.trace is not None else None
        try:
            await run_guardrails(self.gateway.guardrails, self._guardrail_input(texts))
        finally:
            end(span)
        if self.principal.allowed_tiers and self.tier not in self.principal.allowed_tiers:
            raise ApiError(
                403,
                f"This key may not use the '{self.tier}' priority tier.",
                code="tier_not_allowed",
                param=PRIORITY_HEADER,
            )
        self._checked = True

    async def prepare(self) -> None:
        await self.check()
        self._check_deployed()
        span = self.trace.start("gateway.admission") if self.trace is not None else None
        try:
            await self._admit()
        finally:
            end(span)
        try:
            await self._choose_replica(exclude=frozenset())
        except BaseException as error:
            # Admitted, then refused (no replica, queue full or timed out) or the client left.
            self.outcome.status = "error" if isinstance(error, Exception) else "client_cancelled"
            await asyncio.shield(self.settle())
            raise

    def _resolve_model(self) -> None:
        """The base model and adapter the body's model names, if this key may call it."""
        gateway = self.gateway
        principal = self.principal
        self.model = self.body.model
        entry = gateway.resolve_model(self.model, principal)
        if entry is None:
            gateway.check_loaded()
            raise ApiError(
                404,
                f"The model '{self.model}' does not exist or you do not have access to it.",
                code="model_not_found",
                param="model",
            )
        self.base_model, self.adapter = entry
        allowlist = principal.model_allowlist
        if allowlist and not (self.model in allowlist or self.base_model in allowlist):
            raise ApiError(
                403,
                f"This API key may not use the model '{self.model}'.",
                code="model_not_allowed",
                param="model",
            )

    def _check_deployed(self) -> None:
        """A replica may serve the base model now (not asked of a replay: its answer exists)."""
        if not self.gateway.is_deployed(self.base_model):
            self.gateway.check_loaded()
            raise ApiError(
                404,
                f"The model '{self.model}' is not deployed right now; GET /v1/models lists "
                "the models you can call.",
                code="model_not_deployed",
                param="model",
            )

    def _check_request(self) -> list[str]:
        """The prompt's estimate and the max_tokens to reserve, within the key's cap; returns
        the prompt's texts."""
        texts = self.body.prompt_texts()
        self.prompt_text = self.body.prompt_text()
        self.prompt_estimate = estimate_prompt_tokens(self.prompt_text)
        requested = self.body.requested_max_tokens()
        cap = self.principal.limits.max_tokens_cap
        if requested is not None and cap is not None and requested > cap:
            raise ApiError(
                400,
                f"max_tokens is {requested}, over this key's cap of {cap}.",
                code="max_tokens_exceeded",
                param="max_tokens",
            )
        self.max_tokens = requested or cap or self.gateway.default_max_tokens
        return texts

    def _guardrail_input(self, texts: list[str]) -> GuardrailInput:
        principal = self.principal
        return GuardrailInput(
            tenant_slug=principal.tenant_slug,
            model=self.model,
            prompt_texts=texts,
            prompt_tokens=self.prompt_estimate,
            max_prompt_tokens=principal.limits.max_context_tokens,
            blocked_patterns=principal.blocked_patterns,
        )

    async def _admit(self) -> None:
        gateway = self.gateway
        self.admission = await gateway.admit(
            self.principal,
            request_id=self.request_id,
            prompt_tokens=self.prompt_estimate,
            max_tokens=self.max_tokens,
        )
        self.headers.update(self.admission.headers)
        self._renew_lease_at = time.monotonic() + gateway.lease_renewal_s

    def route_request(self) -> RouteRequest:
        tenant = str(self.principal.tenant_id)
        # Salted by tenant and adapter: one tenant's cached prefix is never another's hit,
        # and equal text under different adapter weights is a different KV block.
        hashes = prompt_block_hashes(
            self.prompt_text[: MAX_PREFIX_BLOCKS * 64], salt=f"{tenant}:{self.adapter or ''}"
        )
        regions = self.principal.allowed_regions
        return RouteRequest(
            model=self.base_model,
            tenant=tenant,
            tier=self.tier,
            prompt_tokens=self.prompt_estimate,
            max_tokens=self.max_tokens,
            request_id=self.request_id,
            adapter=self.adapter,
            prefix_hashes=hashes,
            allowed_regions=frozenset(regions) if regions else None,
        )

    async def _choose_replica(self, exclude: frozenset[str]) -> None:
        request = self.route_request()
        span = self.trace.start("gateway.routing") if self.trace is not None else None
        decision = self.gateway.choose(request, exclude)
        replica = decision.replica
        if span is not None:
            end(span, **{"replica.id": replica.replica_id if replica else ""})
        if replica is None:
            raise _no_capacity(
                f"No replica of '{self.model}' is available right now; retry shortly."
            )
        if decision.queue_advised:
            # Nothing meets the SLO: wait for capacity in the bounded priority queue.
            decision, replica = await self._wait_in_queue(request, exclude)
        self.decision = decision
        self.outcome.replica = self.gateway.endpoint(replica.replica_id)

    async def _wait_in_queue(
        self, request: RouteRequest, exclude: frozenset[str]
    ) -> tuple[Decision, ReplicaState]:
        queued_at = time.monotonic()
        span = self.trace.start("gateway.queue_wait") if self.trace is not None else None
        try:
            decision = await self.gateway.wait_in_queue(self.tier, request, exclude)
        finally:
            self.outcome.queue_s += time.monotonic() - queued_at
            end(span)
        if decision.replica is None:
            raise _no_capacity("No replica is available right now.")
        return decision, decision.replica

    # --- the stream --------------------------------------------------------------------------

    @property
    def streams(self) -> bool:
        return self.over_websocket or bool(self.body.stream)

    @property
    def accepted(self) -> bool:
        """Whether a replica took the request (only then does it count for rollouts)."""
        return self._accepted

    def prefill_tokens(self) -> int:
        """The prefill this request puts on the replica that streams it: the prompt less
        what the router expects that replica to hold in its prefix cache. None on a decode
        replica: its prompt arrives over the KV link (`prompt_prefill_tokens` is the prefill
        replica's)."""
        if self.decision is not None and self.decision.prefill_replica is not None:
            return 0
        return self.prompt_prefill_tokens()

    def prompt_prefill_tokens(self) -> int:
        """The prompt less what the router expects its prefilling replica's cache to hold."""
        cached = self.decision.cached_tokens if self.decision is not None else 0
        return max(0, self.prompt_estimate - cached)

    def prefill_payload(self, endpoint: ReplicaEndpoint) -> dict[str, Any]:
        """The body of a disaggregated request's prefill: the request itself, not streamed,
        one token to generate, the KV kept for a remote decode."""
        payload = self.upstream_payload(endpoint)
        payload.pop("stream_options", None)
        payload.pop("min_tokens", None)  # above max_tokens 1 the engine would refuse it
        payload.update(stream=False, max_tokens=1, kv_transfer_params=dict(REMOTE_DECODE))
        return payload

    def upstream_payload(
        self, endpoint: ReplicaEndpoint, kv_transfer_params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        payload = self.body.engine_fields()
        payload["model"] = self.adapter or endpoint.served_model_name
        # The tenant's own prefix-cache namespace in the engine: one tenant's cached prompt is
        # never another's hit (nor a timing oracle for it). Clients cannot send their own.
        payload["cache_salt"] = engine_cache_salt(self.principal.tenant_id)
        payload["stream"] = True
        # Always ask for usage upstream, so tokens are counted even when the client did not ask.
        payload["stream_options"] = {"include_usage": True}
        if self.kind == "chat":
            payload.pop("max_completion_tokens", None)
        max_tokens = self.max_tokens
        if self.body.requested_max_tokens() is None and endpoint.max_model_len:
            # No max_tokens asked for: as vLLM would, up to what the context leaves, within
            # the key's cap (which the admission reserved).
            max_tokens = max(1, min(max_tokens, endpoint.max_model_len - self.prompt_estimate))
        payload["max_tokens"] = max_tokens
        if kv_transfer_params is not None:
            # Where the decode engine pulls the prompt's KV from: the prefill's answer.
            payload["kv_transfer_params"] = kv_transfer_params
        return payload

    async def _open_upstream(
        self,
    ) -> tuple[UpstreamStream, AsyncIterator[dict[str, Any]], dict[str, Any] | None]:
        """Open the replica's stream and wait for its first chunk, retrying once on another
        replica if this one fails before producing anything (connect error, an error status,
        a crash or a silence during prefill). Returns the stream, its chunk iterator and the
        first chunk (None for an empty stream).

        A disaggregated decision (`Decision.prefill_replica`) runs its prefill first
        (`_prefill`), then streams the decode from the decode replica with the prefill's
        `kv_transfer_params`. A failure of either phase before the first token is that
        replica's: it is excluded and the router asked again, so a failed prefill is retried
        on another prefill replica, and a failed decode runs the request again on a new
        choice (its prefill a prefix-cache hit on the replica that prefilled it, or a
        colocated replica where the router now finds that better). Re-running the prefill
        rather than handing the first prefill's KV to another decode replica is the safe
        choice: vLLM frees a prefill's blocks once a decode has pulled them, and a decode
        that failed may have."""
        tried: set[str] = set()
        for attempt in range(2):
            endpoint, prefill = await self._endpoints_of_decision(tried)
            replica_id = endpoint.replica_id
            self.outcome.replica = endpoint
            self.outcome.prefill_replica = prefill
            self._prefill_cached = None
            # The replica whose failure it is if this attempt fails.
            failing = prefill or endpoint
            stream: UpstreamStream | None = None
            try:
                kv_params = await self._prefill(prefill) if prefill is not None else None
                failing = endpoint
                objective = self.decision.tpot_objective_s if self.decision is not None else None
                self.gateway.request_started(
                    replica_id,
                    self.prefill_tokens(),
                    self.prompt_estimate,
                    tpot_objective_s=objective,
                )
                self._started_on = replica_id
                self._started_objective = objective
                self._started_at = time.monotonic()
                decision = self.decision
                self._predicted_by = (
                    decision
                    if decision is not None
                    and prefill is None
                    and decision.replica is not None
                    and decision.replica.replica_id == replica_id
                    else None
                )
                trace_headers = self._trace_upstream(replica_id) if self.trace is not None else None
                stream = await open_stream(
                    self.gateway.session,
                    endpoint.endpoint,
                    self.path,
                    self.upstream_payload(endpoint, kv_params),
                    api_key=endpoint.api_key,
                    extra_headers=trace_headers,
                )
                if self.trace is not None:
                    self._connected()
                chunks = stream.chunks()
                first = await anext(chunks, None)
                self._accepted = True
                if self._suspect is not None:
                    # Another replica served what the first failed: the first's fault.
                    self.gateway.record_failure(*self._suspect)
                    self._suspect = None
                return stream, chunks, first
            except UpstreamError as error:
                if stream is not None:
                    stream.close()
                if self.trace is not None:
                    self._upstream_failed(error)
                self._finish_on_replica(first_token_seen=False)
                tried.add(failing.replica_id)
                self._refused_before_first_token(error, failing, last_try=attempt == 1)
                if error.status == 404 and not self._served_elsewhere(tried):
                    raise self._not_loaded() from error
                if error.kind == "connect" and not self._served_elsewhere(tried):
                    # The replica may have left the table since this gateway last read it
                    # (a drain's update still on its way): read it again before giving up.
                    await self.gateway.reread_routing_table()
                await self._choose_replica(exclude=frozenset(tried))
            except BaseException:
                # Cancelled (the client left) or a bug while connecting: undo what was taken.
                if stream is not None:
                    stream.close()
                if self.trace is not None:
                    self._end_upstream_spans()
                self._finish_on_replica(first_token_seen=False)
                self.gateway.abandon_probe(replica_id)
                if prefill is not None:
                    self.gateway.abandon_probe(prefill.replica_id)
                raise
        raise AssertionError("unreachable")

    async def _endpoints_of_decision(
        self, tried: set[str]
    ) -> tuple[ReplicaEndpoint, ReplicaEndpoint | None]:
        """The decision's decode (or colocated) replica and its prefill replica, if any, as
        the routing table has them now. A replica chosen on a table that has since dropped it
        (a promotion or a drain published while the request waited) failed nothing: the
        router chooses again on the table as it is."""
        for _ in range(3):
            assert self.decision is not None and self.decision.replica is not None
            chosen, chosen_prefill = self.decision.replica, self.decision.prefill_replica
            endpoint = self.gateway.endpoint(chosen.replica_id)
            prefill = self.gateway.endpoint(chosen_prefill.replica_id) if chosen_prefill else None
            if endpoint is not None and (chosen_prefill is None or prefill is not None):
                return endpoint, prefill
            self.gateway.abandon_probe(chosen.replica_id)
            if chosen_prefill is not None:
                self.gateway.abandon_probe(chosen_prefill.replica_id)
            await self._choose_replica(exclude=frozenset(tried))
        raise _no_capacity("The routing table is changing; retry.", retry_s=1)

    async def _prefill(self, endpoint: ReplicaEndpoint) -> dict[str, Any] | None:
        """A disaggregated request's first phase: the prompt prefilled on `endpoint`, one
        token generated and dropped, its KV kept for the decode replica. Returns the answer's
        `kv_transfer_params` for the decode call (None where the connector needs none: the
        shared-storage one finds the KV by the prompt). The client leaving cancels the call,
        and dropping its connection makes the engine abort it."""
        gateway = self.gateway
        tokens = self.prompt_prefill_tokens()
        gateway.request_started(endpoint.replica_id, tokens)
        span = None
        headers = None
        if self.trace is not None:
            span = self.trace.start("gateway.prefill", kind=SpanKind.CLIENT)
            if span is not None:
                span.set_attribute("replica.id", endpoint.replica_id)
            headers = self.trace.headers(span)
        failure = "cancelled"
        try:
            answer = await post_json(
                gateway.session,
                endpoint.endpoint,
                self.path,
                self.prefill_payload(endpoint),
                api_key=endpoint.api_key,
                extra_headers=headers,
            )
            failure = ""
        except UpstreamError as error:
            failure = error.kind
            raise
        finally:
            # Its prompt is no longer queued there either way: done, failed or abandoned.
            gateway.request_finished(endpoint.replica_id, tokens, first_token_seen=False)
            if failure:
                end(span, **{"error.kind": failure})
            else:
                end(span)
        gateway.record_success(endpoint)
        usage = answer.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        self._prefill_cached = int(details.get("cached_tokens") or 0)
        params = answer.get("kv_transfer_params")
        return params if isinstance(params, dict) else None

    # --- spans of the upstream phases (called only while traced) --------------------------------

    def _trace_upstream(self, replica_id: str) -> dict[str, str]:
        """Open this attempt's client span and its connect phase; the traceparent for the
        engine names the client span, so the engine's spans are its children."""
        assert self.trace is not None
        self._upstream_span = self.trace.start("gateway.upstream", kind=SpanKind.CLIENT)
        if self._upstream_span is not None:
            self._upstream_span.set_attribute("replica.id", replica_id)
        self._first_token_span = self.trace.start("gateway.upstream_connect")
        return self.trace.headers(self._upstream_span)

    def _connected(self) -> None:
        """The replica answered 200: connect ends, the wait for the first token starts."""
        assert self.trace is not None
        end(self._first_token_span)
        self._first_token_span = self.trace.start("gateway.first_token")

    def _first_token(self) -> None:
        assert self.trace is not None
        end(self._first_token_span)
        self._first_token_span = None
        self._decode_span = self.trace.start("gateway.decode")

    def _upstream_failed(self, error: UpstreamError) -> None:
        end(self._first_token_span, **{"error.kind": error.kind})
        end(self._upstream_span, **{"error.kind": error.kind})
        self._first_token_span = self._upstream_span = None

    def _end_upstream_spans(self) -> None:
        outcome = self.outcome
        end(self._first_token_span)
        end(self._decode_span, **{"gen_ai.usage.completion_tokens": outcome.completion_tokens})
        end(self._upstream_span, status=outcome.status)
        self._first_token_span = self._decode_span = self._upstream_span = None

    def _refused_before_first_token(
        self, error: UpstreamError, endpoint: ReplicaEndpoint, *, last_try: bool
    ) -> None:
        """Give the replica's breaker its verdict on a failure before the first chunk; raise
        the client's error unless another replica may be tried."""
        gateway = self.gateway
        if error.status == 404:
            # The engine does not know the name it was sent (vLLM: 404 "The model `x` does
            # not exist."): the adapter was unloaded or the replica restarted without it,
            # ahead of the routing table. Another replica may serve it; this one is healthy,
            # so no verdict for its breaker.
            gateway.abandon_probe(endpoint.replica_id)
            gateway.record_not_loaded(endpoint, self.adapter)
            if last_try:
                raise self._not_loaded() from error
            return
        if not replica_at_fault(error):
            # The engine refused the request itself (e.g. longer than its context): the
            # client's doing, not the replica's; no verdict for its breaker.
            gateway.abandon_probe(endpoint.replica_id)
            raise refused_by_engine(error) from error
        if error.status == ENGINE_INTERNAL_ERROR:
            if self._suspect is None and not last_try:
                # An engine's internal error may be the request's doing (content it chokes
                # on fails on every replica): the verdict waits for a second replica.
                gateway.abandon_probe(endpoint.replica_id)
                self._suspect = (endpoint, error.kind)
                return
            if self._suspect is not None:
                # The same request failed on two replicas: its content, not the replicas.
                # Neither breaker counts it, so one tenant's requests cannot eject a replica
                # that serves everyone else.
                gateway.abandon_probe(endpoint.replica_id)
                self._suspect = None
                raise ApiError(
                    502,
                    "The model engine failed on this request on two replicas, so its content "
                    "is the likely cause; no output is billed.",
                    code="upstream_error",
                    error_type="server_error",
                ) from error
        self._suspect = None  # another kind of failure: the first one's cause stays unknown
        refused_gateway = error.status in REPLICA_REFUSALS
        gateway.record_failure(endpoint, "refused" if refused_gateway else error.kind)
        if last_try and refused_gateway:
            raise _no_capacity(
                f"No replica of '{self.model}' accepted the request right now; retry shortly."
            ) from error
        if last_try:
            raise replica_failed() from error

    def _served_elsewhere(self, tried: set[str]) -> bool:
        """Whether a replica not yet tried would take the request (asked of the router)."""
        return self.gateway.choose(self.route_request(), frozenset(tried)).replica is not None

    def _not_loaded(self) -> ApiError:
        # Not the engine's 404: the model exists and the node agent is loading it again.
        return ApiError(
            503,
            f"The model '{self.model}' is not loaded on a replica right now; retry shortly.",
            code="model_not_loaded",
            headers={"Retry-After": "2"},
        )

    def _finish_on_replica(self, *, first_token_seen: bool) -> None:
        """Give back the replica's in-flight count, once per `request_started`."""
        if self._started_on is not None:
            self.gateway.request_finished(
                self._started_on,
                self.prefill_tokens(),
                first_token_seen=first_token_seen,
                context_tokens=self.prompt_estimate,
                tpot_objective_s=self._started_objective,
            )
            self._started_on = None

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        """The OpenAI chunks for the client, then `END_OF_STREAM` once everything is
        delivered. Settles exactly once in `finally`."""
        try:
            chunks, chunk = await self._start_stream()
            labels = self._labels()
            try:
                while chunk is not None:
                    if self._take_chunk(chunk, labels):
                        yield chunk
                    chunk = await anext(chunks, None)
            except UpstreamError as error:
                # The replica died mid-stream, or its engine sent an error event: the client
                # gets an error event (the engine's own, if it sent one); what was delivered
                # is still settled and metered.
                self._cut_off(error)
                if error.kind == "error_event":
                    raise failed_in_engine(error, streamed=self.streams) from error
                raise
            self._delivered()
            yield END_OF_STREAM
        except (asyncio.CancelledError, GeneratorExit):
            if not self._complete:
                self.outcome.status = "client_cancelled"
            raise
        except (ApiError, UpstreamError):
            raise
        except Exception as error:
            self.outcome.status = "error"
            self.outcome.error = repr(error)
            self._nothing_delivered_unless_streamed()
            log.exception("generation %s failed", self.request_id)
            raise
        finally:
            await self._end_stream()

    async def _start_stream(
        self,
    ) -> tuple[AsyncIterator[dict[str, Any]], dict[str, Any] | None]:
        """The replica's chunk iterator and its first chunk (None for an empty stream)."""
        try:
            self._upstream, chunks, first = await self._open_upstream()
        except ApiError as error:
            self.outcome.status = (
                "refused"
                if isinstance(error, RefusedByEngine)
                else "upstream_failed"
                if error.status >= 500
                else "error"
            )
            self.outcome.error = error.message
            raise
        return chunks, first

    def _take_chunk(self, chunk: dict[str, Any], labels: tuple[str, str, str]) -> bool:
        """Count a chunk's usage, finish reason and token; whether the client gets it (the
        usage-only chunk it does not: it gets ours at the end)."""
        usage = chunk.get("usage")
        if usage:
            self._take_usage(usage)
        choices = chunk.get("choices") or []
        if not choices:
            return False
        choice = choices[0]
        if choice.get("finish_reason"):
            self.outcome.finish_reason = choice["finish_reason"]
        if self._has_content(choice):
            self._took_token(labels)
            self.outcome.completion_tokens += 1 if not usage else 0
        return True

    def _took_token(self, labels: tuple[str, str, str]) -> None:
        """A generated token arrived: renew the stream's lease when due, and time it."""
        now = time.monotonic()
        if now >= self._renew_lease_at:
            self._renew_lease_at = now + self.gateway.lease_renewal_s
            self.gateway.renew_lease_soon(self._reservation())
        if self.outcome.first_token_at is None:
            self.outcome.first_token_at = now
            if self.trace is not None:
                self._first_token()
            if self._started_on is not None:
                self.gateway.request_first_token(self._started_on, self.prefill_tokens())
                if self._predicted_by is not None:
                    self.gateway.observe_ttft(
                        self._started_on, now - self._started_at, self._predicted_by
                    )
            metrics.TIME_TO_FIRST_TOKEN.labels(*labels).observe(now - self.started_mono)
        elif self._last_token_at is not None:
            metrics.INTER_TOKEN_LATENCY.labels(*labels).observe(now - self._last_token_at)
        self._last_token_at = now

    def _cut_off(self, error: UpstreamError) -> None:
        """The stream broke after it started: the outcome, and the replica's verdict."""
        at_fault = replica_at_fault(error)
        self.outcome.status = "upstream_failed" if at_fault else "refused"
        self.outcome.error = str(error)
        self._nothing_delivered_unless_streamed()
        if at_fault and self.outcome.replica is not None:
            kind = "mid_stream" if error.kind == "stream_broken" else error.kind
            self.gateway.record_failure(self.outcome.replica, kind)
            self._verdict = True

    def _nothing_delivered_unless_streamed(self) -> None:
        """A non-streamed response is all or nothing: one that fails midway reaches the
        client as an error with none of the tokens generated so far, so none is billed
        (completion_tokens 0). Its prompt still is, as the engine read it (the settle takes
        the engine's count or the estimate): the rule of a stream cut before its first token.
        Metering prices an event from its tokens whatever its status, so this is the charge."""
        if not self.streams:
            self.outcome.completion_tokens = 0

    def _delivered(self) -> None:
        """Everything is delivered: the transport may finish the response now, and the
        settle (a Redis round trip) no longer delays the client's end of stream."""
        if self.outcome.replica is not None:
            self.gateway.record_success(self.outcome.replica)
            self._verdict = True
        self._complete = True

    async def _end_stream(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
        if self.trace is not None:
            self._end_upstream_spans()
        if not self._verdict and self.outcome.replica is not None:
            # A half-open breaker's probe that ended without a verdict (the client left)
            # must not keep its replica blocked.
            self.gateway.abandon_probe(self.outcome.replica.replica_id)
        self._finish_on_replica(first_token_seen=self.outcome.first_token_at is not None)
        await asyncio.shield(self.settle())

    def _take_usage(self, usage: dict[str, Any]) -> None:
        self.outcome.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        self.outcome.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        self.outcome.cached_prompt_tokens = int(details.get("cached_tokens") or 0)
        if self._prefill_cached is not None:
            # The decode engine counts the prompt it received over the KV link as cached:
            # the tenant's cached tokens are those the prefill replica's cache held.
            self.outcome.cached_prompt_tokens = self._prefill_cached

    @staticmethod
    def _has_content(choice: dict[str, Any]) -> bool:
        """Whether the chunk carries a generated token. vLLM sends one chunk per token, and a
        token that ends inside a UTF-8 sequence comes as empty text: it counts all the same
        (a stream cut before its usage chunk is billed by these), as do tool-call and
        reasoning deltas. A chat stream's opening role chunk carries none."""
        if "text" in choice:
            return choice["text"] is not None
        delta = choice.get("delta") or {}
        return "role" not in delta and bool(delta)

    def _labels(self) -> tuple[str, str, str]:
        pool = self.outcome.replica.pool if self.outcome.replica else ""
        return (self.model, pool, self.tier)

    def usage_payload(self) -> dict[str, int]:
        prompt = self.outcome.prompt_tokens or self.prompt_estimate
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.outcome.completion_tokens,
            "total_tokens": prompt + self.outcome.completion_tokens,
        }

    # --- settle --------------------------------------------------------------------------------

    async def settle(self) -> None:
        if self._settled:
            return
        self._settled = True
        outcome = self.outcome
        if not outcome.prompt_tokens:
            # The engine's own count when it reported one; the estimate when it took the
            # request but was cut before its usage chunk; nothing when no engine took it.
            outcome.prompt_tokens = self.prompt_estimate if self._accepted else 0
        ended = time.time()
        total_s = time.monotonic() - self.started_mono
        self._observe_settled(total_s)
        replica = outcome.replica
        span = self.trace.start("gateway.settle") if self.trace is not None else None
        try:
            await self.gateway.settle(
                self.usage_event(ended_at=ended, total_ms=total_s * 1000),
                self._reservation(),
                rollout_deployment_id=(
                    replica.deployment_id if replica is not None and self._accepted else None
                ),
            )
        finally:
            end(span)

    def span_attributes(self) -> dict[str, str | int]:
        """What the root span records once the request is settled."""
        outcome = self.outcome
        return {
            "gen_ai.request.model": self.model,
            "tenant.id": self.principal.tenant_id,
            "replica.id": outcome.replica.replica_id if outcome.replica else "",
            "replica.prefill_id": (
                outcome.prefill_replica.replica_id if outcome.prefill_replica else ""
            ),
            "gen_ai.usage.prompt_tokens": outcome.prompt_tokens,
            "gen_ai.usage.completion_tokens": outcome.completion_tokens,
            "request.status": outcome.status,
            "request.id": self.request_id,
        }

    def _observe_settled(self, total_s: float) -> None:
        outcome = self.outcome
        labels = self._labels()
        metrics.REQUEST_TIME.labels(*labels).observe(total_s)
        tpot_s = self._tpot_s(total_s)
        if tpot_s is not None:
            metrics.TIME_PER_OUTPUT_TOKEN.labels(*labels).observe(tpot_s)
        judged = self._slo_outcome(tpot_s)
        if judged is not None:
            metrics.SLO_REQUESTS.labels(*labels, judged).inc()
        metrics.QUEUE_TIME.labels(*labels).observe(outcome.queue_s)
        metrics.REQUESTS.labels(self.model, outcome.status).inc()
        slug = self.principal.tenant_slug
        metrics.TOKENS.labels(slug, self.model, "prompt").inc(outcome.prompt_tokens)
        metrics.TOKENS.labels(slug, self.model, "completion").inc(outcome.completion_tokens)

    def _tpot_s(self, total_s: float) -> float | None:
        outcome = self.outcome
        end = self.started_mono + total_s
        return time_per_output_token(outcome.first_token_at, end, outcome.completion_tokens)

    def _slo_outcome(self, tpot_s: float | None) -> str | None:
        """met, ttft, tpot or failed against the tier's objectives; None when not judged
        (a tier without objectives, a client that hung up)."""
        first = self.outcome.first_token_at
        ttft_s = None if first is None else first - self.started_mono
        return slo_outcome(self.gateway.slo_tier(self.tier), self.outcome.status, ttft_s, tpot_s)

    def usage_event(self, *, ended_at: float, total_ms: float) -> UsageEvent:
        """The usage event that bills this request (what the gateway's settle writes)."""
        outcome = self.outcome
        principal = self.principal
        replica = outcome.replica
        prefill = outcome.prefill_replica if replica is not None else None
        # The decision that sent the request to `replica` (a retry's replaces the first's).
        baseline = (
            self.decision.baseline_replica
            if replica is not None and self.decision is not None
            else None
        )
        ttft_ms = (
            (outcome.first_token_at - self.started_mono) * 1000
            if outcome.first_token_at is not None
            else None
        )
        charged = self.gateway.price(
            self.base_model,
            self.adapter,
            self.tier,
            principal.tenant_id,
            self.started_at,
            prompt_tokens=outcome.prompt_tokens,
            cached_prompt_tokens=outcome.cached_prompt_tokens,
            completion_tokens=outcome.completion_tokens,
        )
        return UsageEvent(
            request_id=self.request_id,
            tenant_id=principal.tenant_id,
            key_id=principal.key_id,
            model=self.model,
            version_id=int(replica.version_id) if replica and replica.version_id else None,
            adapter=self.adapter or "",
            deployment_id=int(replica.deployment_id) if replica else None,
            pool=replica.pool if replica else "",
            replica_id=replica.replica_id if replica else "",
            priority=self.tier,
            prompt_tokens=outcome.prompt_tokens,
            cached_prompt_tokens=outcome.cached_prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            status=outcome.status,
            finish_reason=outcome.finish_reason or "",
            queue_ms=outcome.queue_s * 1000,
            ttft_ms=ttft_ms,
            total_ms=total_ms,
            started_at=self.started_at,
            ended_at=ended_at,
            price_charged_usd_micros=charged,
            baseline_replica_id=baseline.replica_id if baseline else "",
            baseline_pool=baseline.pool if baseline else "",
            trace_id=self.trace.trace_id if self.trace is not None else "",
            prefill_replica_id=prefill.replica_id if prefill else "",
            prefill_pool=prefill.pool if prefill else "",
        )

    def _reservation(self) -> Reservation | None:
        return self.admission.reservation if self.admission is not None else None


def _no_capacity(message: str, *, retry_s: int = 2) -> ApiError:
    return ApiError(503, message, code="no_capacity", headers={"Retry-After": str(retry_s)})
