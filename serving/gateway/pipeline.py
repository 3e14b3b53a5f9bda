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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from serving.engine.tokens import estimate_prompt_tokens, prompt_block_hashes
from serving.gateway import metrics
from serving.gateway.access import PRIORITY_HEADER
from serving.gateway.errors import ApiError
from serving.gateway.guardrails import GuardrailInput, run_guardrails
from serving.gateway.routing import ReplicaEndpoint
from serving.gateway.schemas import ChatCompletionRequest, CompletionRequest
from serving.gateway.upstream import UpstreamError, UpstreamStream, open_stream
from serving.router import Decision, RouteRequest

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


def engine_cache_salt(tenant_id: object) -> str:
    return f"tenant-{tenant_id}"


def refused_by_engine(error: UpstreamError) -> ApiError:
    """The engine's refusal of the request (longer than its context, a parameter it does
    not accept) in OpenAI's shape, with the engine's own message and param."""
    status = error.status if error.status in CLIENT_ERROR_STATUSES else 400
    message = error.engine_message or (
        f"The model engine refused the request with HTTP {error.status} and gave no reason; "
        "check the request's parameters against the model's limits."
    )
    return ApiError(status, message, code="invalid_request", param=error.param)


def replica_at_fault(error: UpstreamError) -> bool:
    """Whether the failure is the replica's (it counts toward its breaker), not the
    request's: no status (unreachable, cut off), a server error, or a refusal of the
    gateway itself."""
    status = error.status
    return status is None or not 400 <= status < 500 or status in REPLICA_REFUSALS


def failed_in_engine(error: UpstreamError) -> ApiError:
    """An error the engine reported in a stream it had already started, in OpenAI's shape
    with the engine's own message."""
    if not replica_at_fault(error):
        return refused_by_engine(error)
    message = error.engine_message or (
        "The model engine failed mid-generation and gave no reason; the tokens received so "
        "far are billed."
    )
    return ApiError(502, message, code="upstream_error", error_type="server_error")


@dataclass(slots=True)
class Outcome:
    """What happened, filled in as the exchange runs; settle reads it."""

    status: str = "ok"
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    queue_s: float = 0.0
    replica: ReplicaEndpoint | None = None
    error: str | None = None


@dataclass(slots=True)
class Exchange:
    gateway: Any  # serving.gateway.service.Gateway (typed loosely to avoid an import cycle)
    kind: str  # "chat" or "completion"
    body: ChatCompletionRequest | CompletionRequest
    principal: Any
    tier: str
    # A WebSocket generation streams whatever its body says, so it holds a stream slot too.
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
    admission: Any = None
    decision: Decision | None = None
    headers: dict[str, str] = field(default_factory=dict)
    outcome: Outcome = field(default_factory=Outcome)
    response_id: str | None = None
    _upstream: UpstreamStream | None = None
    _settled: bool = False
    _complete: bool = False
    # The replica whose in-flight count this request holds (between started and finished).
    _started_on: str | None = None
    # True once a replica accepted the request and produced its first chunk.
    _accepted: bool = False
    # A stream longer than its concurrency lease renews it, so the slot is not reclaimed
    # from under a healthy stream (the lease still expires if this gateway dies).
    _renew_lease_at: float = math.inf

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"

    # --- before the first byte -------------------------------------------------------------

    async def prepare(self) -> None:
        gateway = self.gateway
        principal = self.principal
        self.model = self.body.model
        entry = gateway.catalog.resolve(self.model, principal)
        if entry is None:
            gateway.check_loaded()
            raise ApiError(
                404,
                f"The model '{self.model}' does not exist or you do not have access to it.",
                code="model_not_found",
                param="model",
            )
        self.base_model, self.adapter = entry
        if self.base_model not in gateway.routing.snapshot.served_models:
            gateway.check_loaded()
            raise ApiError(
                404,
                f"The model '{self.model}' is not deployed right now; GET /v1/models lists "
                "the models you can call.",
                code="model_not_deployed",
                param="model",
            )
        if principal.model_allowlist and not (
            self.model in principal.model_allowlist or self.base_model in principal.model_allowlist
        ):
            raise ApiError(
                403,
                f"This API key may not use the model '{self.model}'.",
                code="model_not_allowed",
                param="model",
            )
        limits = principal.limits
        texts = self.body.prompt_texts()
        self.prompt_text = self.body.prompt_text()
        self.prompt_estimate = estimate_prompt_tokens(self.prompt_text)
        requested = self.body.requested_max_tokens()
        cap = limits.max_tokens_cap
        if requested is not None and cap is not None and requested > cap:
            raise ApiError(
                400,
                f"max_tokens is {requested}, over this key's cap of {cap}.",
                code="max_tokens_exceeded",
                param="max_tokens",
            )
        self.max_tokens = requested or cap or gateway.config.default_max_tokens
        await run_guardrails(
            gateway.guardrails,
            GuardrailInput(
                tenant_slug=principal.tenant_slug,
                model=self.model,
                prompt_texts=texts,
                prompt_tokens=self.prompt_estimate,
                max_prompt_tokens=limits.max_context_tokens,
                blocked_patterns=tuple(getattr(principal, "blocked_patterns", ()) or ()),
            ),
        )
        if principal.allowed_tiers and self.tier not in principal.allowed_tiers:
            raise ApiError(
                403,
                f"This key may not use the '{self.tier}' priority tier.",
                code="tier_not_allowed",
                param=PRIORITY_HEADER,
            )
        self.admission = await gateway.admit(self)
        self.headers.update(self.admission.headers)
        self._renew_lease_at = time.monotonic() + gateway.lease_renewal_s
        try:
            await self._choose_replica(exclude=frozenset())
        except BaseException as error:
            # Admitted, then refused (no replica, queue full or timed out) or the client left.
            self.outcome.status = "error" if isinstance(error, Exception) else "client_cancelled"
            await asyncio.shield(self.settle())
            raise

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
            tier=self.tier,  # type: ignore[arg-type]
            prompt_tokens=self.prompt_estimate,
            max_tokens=self.max_tokens,
            request_id=self.request_id,
            adapter=self.adapter,
            prefix_hashes=hashes,
            allowed_regions=frozenset(regions) if regions else None,
        )

    async def _choose_replica(self, exclude: frozenset[str]) -> None:
        gateway = self.gateway
        request = self.route_request()
        decision = gateway.choose(request, exclude)
        if decision.replica is None:
            raise ApiError(
                503,
                f"No replica of '{self.model}' is available right now; retry shortly.",
                code="no_capacity",
                headers={"Retry-After": "2"},
            )
        if decision.queue_advised:
            # Nothing meets the SLO: wait for capacity in the bounded priority queue.
            queued_at = time.monotonic()
            try:
                decision = await gateway.wait_in_queue(self.tier, request, exclude)
            finally:
                self.outcome.queue_s += time.monotonic() - queued_at
            if decision.replica is None:
                raise ApiError(503, "No replica is available right now.", code="no_capacity",
                               headers={"Retry-After": "2"})  # fmt: skip
        self.decision = decision
        self.outcome.replica = gateway.routing.snapshot.endpoints.get(decision.replica.replica_id)

    # --- the stream --------------------------------------------------------------------------

    @property
    def streams(self) -> bool:
        return self.over_websocket or bool(self.body.stream)

    @property
    def accepted(self) -> bool:
        """Whether a replica took the request (only then does it count for rollouts)."""
        return self._accepted

    def prefill_tokens(self) -> int:
        """The prefill this request puts on its replica: the prompt less what the router
        expects that replica to hold in its prefix cache."""
        cached = self.decision.cached_tokens if self.decision is not None else 0
        return max(0, self.prompt_estimate - cached)

    def upstream_payload(self, endpoint: ReplicaEndpoint) -> dict[str, Any]:
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
        return payload

    async def _open_upstream(self) -> tuple[UpstreamStream, AsyncIterator[dict[str, Any]], Any]:
        """Open the replica's stream and wait for its first chunk, retrying once on another
        replica if this one fails before producing anything (connect error, an error status,
        a crash or a silence during prefill). Returns the stream, its chunk iterator and the
        first chunk (None for an empty stream)."""
        gateway = self.gateway
        tried: set[str] = set()
        for attempt in range(2):
            assert self.decision is not None and self.decision.replica is not None
            replica = self.decision.replica
            endpoint = gateway.routing.snapshot.endpoints.get(replica.replica_id)
            self.outcome.replica = endpoint
            if endpoint is None:
                raise ApiError(503, "The chosen replica left the routing table; retry.",
                               code="no_capacity", headers={"Retry-After": "1"})  # fmt: skip
            gateway.request_started(replica.replica_id, self.prefill_tokens())
            self._started_on = replica.replica_id
            stream: UpstreamStream | None = None
            try:
                stream = await open_stream(
                    gateway.session,
                    endpoint.endpoint,
                    self.path,
                    self.upstream_payload(endpoint),
                    api_key=endpoint.api_key,
                )
                chunks = stream.chunks()
                first = await anext(chunks, None)
                self._accepted = True
                return stream, chunks, first
            except UpstreamError as error:
                if stream is not None:
                    stream.close()
                self._finish_on_replica(first_token_seen=False)
                not_loaded = error.status == 404
                refused_gateway = error.status in REPLICA_REFUSALS
                if not_loaded:
                    # The engine does not know the name it was sent (vLLM: 404 "The model
                    # `x` does not exist."): the adapter was unloaded or the replica restarted
                    # without it, ahead of the routing table. Another replica may serve it;
                    # this one is healthy, so no verdict for its breaker.
                    gateway.abandon_probe(replica.replica_id)
                    gateway.record_not_loaded(endpoint, self.adapter)
                elif not replica_at_fault(error):
                    # The engine refused the request itself (e.g. longer than its context):
                    # the client's doing, not the replica's; no verdict for its breaker.
                    gateway.abandon_probe(replica.replica_id)
                    raise refused_by_engine(error) from error
                else:
                    gateway.record_failure(endpoint, "refused" if refused_gateway else error.kind)
                tried.add(replica.replica_id)
                if not_loaded and (
                    attempt == 1
                    or gateway.choose(self.route_request(), frozenset(tried)).replica is None
                ):
                    raise self._not_loaded() from error
                if attempt == 1 and refused_gateway:
                    raise ApiError(503, f"No replica of '{self.model}' accepted the request "
                                   "right now; retry shortly.", code="no_capacity",
                                   headers={"Retry-After": "2"}) from error  # fmt: skip
                if attempt == 1:
                    raise ApiError(502, "The model replica failed; please retry.",
                                   code="upstream_error", error_type="server_error") from error  # fmt: skip
                await self._choose_replica(exclude=frozenset(tried))
            except BaseException:
                # Cancelled (the client left) or a bug while connecting: undo what was taken.
                if stream is not None:
                    stream.close()
                self._finish_on_replica(first_token_seen=False)
                gateway.abandon_probe(replica.replica_id)
                raise
        raise AssertionError("unreachable")

    def _not_loaded(self) -> ApiError:
        # Not the engine's 404: the model exists and the node agent is loading it again.
        return ApiError(503, f"The model '{self.model}' is not loaded on a replica right now; "
                        "retry shortly.", code="model_not_loaded", headers={"Retry-After": "2"})  # fmt: skip

    def _finish_on_replica(self, *, first_token_seen: bool) -> None:
        """Give back the replica's in-flight count, once per `request_started`."""
        if self._started_on is not None:
            self.gateway.request_finished(
                self._started_on, self.prefill_tokens(), first_token_seen=first_token_seen
            )
            self._started_on = None

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The OpenAI chunks for the client. Settles exactly once in `finally`."""
        gateway = self.gateway
        labels = self._labels()
        last_chunk_at: float | None = None
        verdict = False
        try:
            try:
                self._upstream, chunks, first = await self._open_upstream()
            except ApiError as error:
                self.outcome.status = "upstream_failed" if error.status >= 500 else "error"
                self.outcome.error = error.message
                raise
            labels = self._labels()
            try:
                pending = [first] if first is not None else []
                while True:
                    chunk = pending.pop() if pending else await anext(chunks, None)
                    if chunk is None:
                        break
                    usage = chunk.get("usage")
                    if usage:
                        self._take_usage(usage)
                    choices = chunk.get("choices") or []
                    if not choices:
                        continue  # the usage-only chunk; the client gets ours at the end
                    choice = choices[0]
                    if choice.get("finish_reason"):
                        self.outcome.finish_reason = choice["finish_reason"]
                    if self._has_content(choice):
                        now = time.monotonic()
                        if now >= self._renew_lease_at:
                            self._renew_lease_at = now + gateway.lease_renewal_s
                            gateway.renew_lease_soon(self.admission)
                        if self.outcome.first_token_at is None:
                            self.outcome.first_token_at = now
                            if self._started_on is not None:
                                gateway.request_first_token(self._started_on, self.prefill_tokens())
                            metrics.TIME_TO_FIRST_TOKEN.labels(*labels).observe(
                                now - self.started_mono
                            )
                        elif last_chunk_at is not None:
                            metrics.INTER_TOKEN_LATENCY.labels(*labels).observe(now - last_chunk_at)
                        last_chunk_at = now
                        self.outcome.completion_tokens += 1 if not usage else 0
                    yield chunk
            except UpstreamError as error:
                # The replica died mid-stream, or its engine sent an error event: the client
                # gets an error event (the engine's own, if it sent one); what was delivered
                # is still settled and metered.
                at_fault = replica_at_fault(error)
                self.outcome.status = "upstream_failed" if at_fault else "error"
                self.outcome.error = str(error)
                if at_fault and self.outcome.replica is not None:
                    kind = "mid_stream" if error.kind == "stream_broken" else error.kind
                    gateway.record_failure(self.outcome.replica, kind)
                    verdict = True
                if error.kind == "error_event":
                    raise failed_in_engine(error) from error
                raise
            if self.outcome.replica is not None:
                gateway.record_success(self.outcome.replica)
                verdict = True
            # Everything is delivered: the transport may finish the response now, and the
            # settle below (a Redis round trip) no longer delays the client's end of stream.
            self._complete = True
            yield END_OF_STREAM
        except (asyncio.CancelledError, GeneratorExit):
            if not self._complete:
                self.outcome.status = "client_cancelled"
            raise
        except ApiError:
            raise
        except UpstreamError:
            raise
        except Exception as error:
            self.outcome.status = "error"
            self.outcome.error = repr(error)
            log.exception("generation %s failed", self.request_id)
            raise
        finally:
            if self._upstream is not None:
                self._upstream.close()
            if not verdict and self.outcome.replica is not None:
                # A half-open breaker's probe that ended without a verdict (the client
                # left) must not keep its replica blocked.
                gateway.abandon_probe(self.outcome.replica.replica_id)
            self._finish_on_replica(first_token_seen=self.outcome.first_token_at is not None)
            await asyncio.shield(self.settle())

    def _take_usage(self, usage: dict[str, Any]) -> None:
        self.outcome.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        self.outcome.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        self.outcome.cached_prompt_tokens = int(details.get("cached_tokens") or 0)

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
        labels = self._labels()
        metrics.REQUEST_TIME.labels(*labels).observe(total_s)
        metrics.QUEUE_TIME.labels(*labels).observe(outcome.queue_s)
        metrics.REQUESTS.labels(self.model, outcome.status).inc()
        slug = self.principal.tenant_slug
        metrics.TOKENS.labels(slug, self.model, "prompt").inc(outcome.prompt_tokens)
        metrics.TOKENS.labels(slug, self.model, "completion").inc(outcome.completion_tokens)
        ttft_ms = (
            (outcome.first_token_at - self.started_mono) * 1000
            if outcome.first_token_at is not None
            else None
        )
        await self.gateway.settle(self, ended_at=ended, total_ms=total_s * 1000, ttft_ms=ttft_ms)
