"""The gateway's per-process state and the steps of the hot path that touch it.

One `Gateway` per process, started lazily on the first request: a Redis client with short
timeouts, the key authenticator, the limiter, the routing cache, the catalog and price book,
circuit breakers, the admission queue, an upstream connection pool and the usage spool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import aiohttp
import redis.asyncio as aioredis
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.trace import Tracer
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

from metering.pricing import PRICE_BOOK_KEY, PriceBook, PriceNotFound, charge_usd_micros
from metering.usage import UsageEvent, UsageSpool, add_usage_event
from registry.rollout_metrics import add_request
from serving.gateway import metrics
from serving.gateway.background import cancel_all
from serving.gateway.catalog import Catalog, load_catalog
from serving.gateway.errors import ApiError
from serving.gateway.guardrails import DEFAULT_CHAIN, Guardrail, load_chain
from serving.gateway.inflight_sync import InflightSync
from serving.gateway.peers import GatewayPeers
from serving.gateway.prefix_sync import PrefixSync
from serving.gateway.routing import ReplicaEndpoint, RoutingCache
from serving.gateway.tracing import TracingConfig, build_provider
from serving.gateway.upstream import UpstreamTimeouts, make_session
from serving.redis_contracts import CONTROL_LOOPS, LOOP_FAILURES_KEY, LOOP_PASSES_KEY
from serving.redis_contracts import text as redis_text
from serving.router import (
    POLICIES,
    AdmissionQueue,
    CircuitBreaker,
    Decision,
    Disaggregated,
    Policy,
    QueueFull,
    RouterConfig,
    RouteRequest,
    SloTier,
)
from tenants.keys import DatabaseLoader, KeyAuthenticator, KeyPrincipal
from tenants.limiter import Admission, LimiterUnavailable, RateLimiter, Reservation

log = logging.getLogger(__name__)

# A replica that answered 404 for an adapter is not sent that adapter again for this long
# (the node agent reloads adapters within a reconcile or two; the routing table follows).
ADAPTER_MISS_S = 15.0


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    redis_url: str
    # REDIS_URL names one node of a Redis Cluster, which the client discovers from it.
    redis_cluster: bool = False
    redis_timeout_s: float = 0.5
    redis_max_connections: int = 512
    policy: str = "cost_aware"
    default_max_tokens: int = 1024
    queue_max: int = 1024
    queue_aging_s: float = 10.0
    queue_timeout_s: float = 20.0
    # RouterConfig.defer_looser_after: hold a looser tier's request while every replica has
    # a queue the tightest tier cannot bear (None: never, the default).
    defer_looser_after: float | None = None
    upstream: UpstreamTimeouts = field(default_factory=UpstreamTimeouts)
    breaker_failures: int = 3
    breaker_base_s: float = 2.0
    breaker_max_s: float = 60.0
    refresh_s: float = 1.0
    spool_path: str = "var/usage-spool.jsonl"
    guardrails: tuple[str, ...] = DEFAULT_CHAIN
    max_body_bytes: int = 4 * 1024 * 1024
    stream_lease_ttl_s: int = 600
    tracing: TracingConfig = field(default_factory=TracingConfig)


class Gateway:
    """`load_principal` finds a key PostgreSQL knows and Redis does not (the composition
    root's; see `tenants.keys.DatabaseLoader`). `span_processor` replaces the OTLP exporter
    of `config.tracing` (and turns tracing on by itself: tests pass an in-memory one)."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        load_principal: DatabaseLoader,
        span_processor: SpanProcessor | None = None,
    ) -> None:
        self.config = config
        self.tracer_provider = build_provider(config.tracing, span_processor)
        # None when tracing is off: the one test the hot path makes.
        self.tracer: Tracer | None = (
            self.tracer_provider.get_tracer(__name__) if self.tracer_provider else None
        )
        self.redis: aioredis.Redis | aioredis.RedisCluster = _redis_client(config)
        self.authenticator = KeyAuthenticator(
            self.redis, load_from_database=load_principal, timeout_s=config.redis_timeout_s
        )
        self.limiter = RateLimiter(
            self.redis, timeout_s=config.redis_timeout_s, lease_ttl_s=config.stream_lease_ttl_s
        )
        self.routing = RoutingCache(self.redis, telemetry_interval_s=config.refresh_s)
        self.catalog = Catalog()
        self.price_book = PriceBook([])
        self.guardrails: list[Guardrail] = load_chain(config.guardrails)
        self.router_config = RouterConfig(defer_looser_after=config.defer_looser_after)
        # The gateways sharing the traffic: the router takes what this one sent that the
        # others do not know of yet this many times over.
        self.peers = GatewayPeers(self.redis)
        # Every gateway's requests in flight, counted by every gateway.
        self.inflight_sync = InflightSync(
            self.redis, self.peers.gateway_id, lambda: self.routing.snapshot.state
        )
        # Where the other gateways send each prefix, recorded into this one's index too.
        self.prefix_sync = PrefixSync(
            self.redis, self.peers.gateway_id, lambda: self.routing.snapshot.state.prefix_index
        )
        self.queue = AdmissionQueue(config.queue_max, config.queue_aging_s)
        self.breakers: dict[str, CircuitBreaker] = {}
        # (replica id, adapter) -> monotonic time until which the replica is not sent it
        self._adapter_misses: dict[tuple[str, str], float] = {}
        self.spool = UsageSpool(config.spool_path)
        self.session: aiohttp.ClientSession = None  # type: ignore[assignment]  # set in start
        self._policy: Policy | None = None
        self._policy_version = -1
        self._disaggregated: Disaggregated | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._loops_seen: set[str] = set(CONTROL_LOOPS)

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self.session = make_session(self.config.upstream)
        if isinstance(self.redis, aioredis.RedisCluster):
            # The slot map first: a cluster client's pub/sub subscribe fails on an empty one
            # (KeyError), where commands would fetch it themselves. If the cluster is away,
            # the first command that reaches it loads the map and the subscribers retry.
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await self.redis.initialize()
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self.authenticator.start()
        await self.routing.start()
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self.refresh_reference_data()
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self.limiter.load_scripts()
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self.count_gateways()
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self.read_control_loops()
        await self.prefix_sync.start()
        await self.inflight_sync.start()
        self._tasks.append(asyncio.create_task(self._refresh_forever(), name="gateway-refresh"))

    async def close(self) -> None:
        await cancel_all(self._tasks)
        await self.routing.close()
        await self.prefix_sync.close()
        await self.inflight_sync.close()
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self.peers.leave()
        # Releases of admissions whose answer was lost are in flight: let them land.
        await self.limiter.close()
        with contextlib.suppress(Exception):
            await self.authenticator.close()
        if self.session is not None:
            await self.session.close()
        await self.redis.aclose()
        if self.tracer_provider is not None:
            # Exports what is batched; off the event loop, as the exporter's HTTP call blocks.
            await asyncio.to_thread(self.tracer_provider.shutdown)
        # The spool's file lock goes with this gateway: a next one in this process (tests
        # start several, on the same per-process spool) would otherwise wait for it forever.
        self.spool.release()

    async def refresh_reference_data(self) -> None:
        self.catalog = await load_catalog(self.redis)
        raw = await self.redis.get(PRICE_BOOK_KEY)
        if raw:
            self.price_book = PriceBook.from_json(raw)

    async def count_gateways(self) -> None:
        """Stamp this gateway alive and take the number alive into the router's config."""
        gateways = await self.peers.beat()
        if gateways != self.router_config.gateways:
            log.info("%d gateway processes share the traffic", gateways)
            self.configure_router(replace(self.router_config, gateways=gateways))

    async def read_control_loops(self) -> None:
        """How many rows each control loop fails on now (config/loops.py), into
        `platform_control_loop_failures` for the ControlLoopFailing alert, and when each
        loop's last pass ended, for ControlLoopStalled."""
        names = await self.redis.hkeys(LOOP_FAILURES_KEY)
        counts = Counter(redis_text(name).rsplit(":", 2)[0] for name in names)
        self._loops_seen |= set(counts)
        for loop in self._loops_seen:
            metrics.CONTROL_LOOP_FAILURES.labels(loop).set(counts.get(loop, 0))
        for name, ended in (await self.redis.hgetall(LOOP_PASSES_KEY)).items():
            with contextlib.suppress(ValueError):
                metrics.CONTROL_LOOP_LAST_PASS.labels(redis_text(name)).set(
                    float(redis_text(ended))
                )

    def configure_router(self, config: RouterConfig) -> None:
        """Route with `config` from the next request on (the policy is built again)."""
        self.router_config = config
        self._policy = None

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_s * 2)
            try:
                await self.count_gateways()
                if self.limiter.deferred:
                    sent = await self.limiter.retry_deferred()
                    if sent:
                        log.info("sent %d deferred limiter settles and releases", sent)
                await self.refresh_reference_data()
                if self.spool.has_pending():
                    sent = await self.spool.replay(self.redis)
                    log.info("replayed %d spooled usage events", sent)
                # Spools left next to ours by gateway processes that exited (crash, restart).
                await self.spool.adopt_orphans(self.redis)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("gateway refresh failed: %s", error)
            # On its own: a count left stale by another step's failure would keep the alert
            # firing after the loop recovered.
            try:
                await self.read_control_loops()
            except (RedisError, OSError, TimeoutError) as error:
                log.warning("counting the control loops' failures failed: %s", error)

    # --- admit ---------------------------------------------------------------------------

    async def admit(
        self,
        principal: KeyPrincipal,
        *,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
    ) -> Admission:
        try:
            admission = await self.limiter.admit(
                principal,
                request_id=request_id,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
            )
        except LimiterUnavailable as error:
            raise ApiError(
                503,
                str(error),
                code="limiter_unavailable",
                error_type="service_unavailable_error",
                headers={"Retry-After": "2"},
            ) from error
        if admission.allowed:
            return admission
        if admission.error == "insufficient_quota":
            message = (
                "You exceeded your current quota: your tenant's monthly "
                f"{(admission.limit or 'budget').replace('_', ' ')} is used up. Ask your tenant "
                "owner to raise it, or wait for the next month."
            )
        elif admission.limit == "concurrent_streams":
            message = (
                "Rate limit reached for concurrent requests: the concurrent_streams quota counts "
                "every request in flight, streamed or not. Retry after the time in Retry-After."
            )
        else:
            message = (
                f"Rate limit reached for {(admission.limit or 'requests').replace('_', ' ')}. "
                "Retry after the time in Retry-After."
            )
        raise ApiError(
            429, message, code=admission.error or "rate_limit_exceeded", headers=admission.headers
        )

    # --- reference data --------------------------------------------------------------------

    @property
    def default_max_tokens(self) -> int:
        return self.config.default_max_tokens

    def slo_tier(self, tier: str) -> SloTier | None:
        return self.router_config.slo_tiers.get(tier)

    def resolve_model(self, name: str, principal: KeyPrincipal) -> tuple[str, str | None] | None:
        return self.catalog.resolve(name, principal)

    def is_deployed(self, base_model: str) -> bool:
        return base_model in self.routing.snapshot.served_models

    def endpoint(self, replica_id: str) -> ReplicaEndpoint | None:
        return self.routing.snapshot.endpoints.get(replica_id)

    async def reread_routing_table(self) -> None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self.routing.reload()

    # --- route ---------------------------------------------------------------------------

    def check_loaded(self) -> None:
        """A model absent from the catalog or the routing table is known to be absent only
        once both were read from Redis at least once; until then (at start, or while Redis
        has not answered since) the answer is a 503 to retry, not a 404."""
        if self.catalog.loaded and self.routing.loaded.is_set():
            return
        raise ApiError(
            503,
            "The gateway has not loaded its model catalog and routing table yet; retry shortly.",
            code="routing_not_loaded",
            headers={"Retry-After": "2"},
        )

    def policy(self, model: str = "") -> Policy:
        """The configured policy, or for a model with prefill and decode replicas the
        disaggregated one (the others know no phases), both over the current snapshot."""
        snapshot = self.routing.snapshot
        if (
            self._policy is None
            or self._policy_version != snapshot.version
            or (self._policy.state is not snapshot.state)
        ):
            self._policy = POLICIES[self.config.policy](snapshot.state, self.router_config)
            self._disaggregated = Disaggregated(snapshot.state, self.router_config)
            self._policy_version = snapshot.version
        if model in snapshot.disaggregated_models and self._disaggregated is not None:
            return self._disaggregated
        return self._policy

    def choose(self, request: RouteRequest, exclude: frozenset[str]) -> Decision:
        if request.adapter is not None and self._adapter_misses:
            exclude = exclude | self._replicas_without(request.adapter)
        state = self.routing.snapshot.state
        hidden: list[tuple[str, float]] = []
        # Exclusion (a retry after a failure) reuses the breaker field: the router already
        # skips a replica whose breaker is open.
        far_future = time.monotonic() + 3600
        for replica_id in exclude:
            replica = state.replica(replica_id)
            if replica is not None:
                hidden.append((replica_id, replica.breaker_open_until))
                replica.breaker_open_until = far_future
        try:
            decision = self.policy(request.model).choose(request, time.monotonic())
        finally:
            for replica_id, until in hidden:
                state.set_breaker(replica_id, until)
        metrics.ROUTER_DECISIONS.labels(decision.policy, str(decision.reason)).inc()
        holder = decision.prefill_replica or decision.replica
        if holder is not None and request.prefix_hashes:
            # The policy recorded the prefix against the replica that computes it (a
            # disaggregated request's prefill replica); the other gateways learn it too.
            self.prefix_sync.recorded(request.tenant, request.prefix_hashes, holder.replica_id)
        return decision

    async def wait_in_queue(
        self, tier: str, request: RouteRequest, exclude: frozenset[str]
    ) -> Decision:
        """Wait in the admission queue; return the decision to send the request with.

        A request of this gateway finishing releases the best waiter. Capacity that appears
        otherwise (requests of other gateway processes finishing, a replica added) shows
        only in the telemetry, so on every telemetry refresh each waiter asks the router
        again and leaves the queue as soon as it would be sent without queueing. A waiter
        given a slot is sent wherever the router then chooses, unless the router still
        advises waiting and it is a looser tier's request held less than its tier's
        `RouterConfig.deferral_s`: it then goes back to its place in the queue."""
        enqueued_at = time.monotonic()
        deferral_s = self.router_config.deferral_s(tier)
        while True:
            waited = time.monotonic() - enqueued_at
            decision = await self._wait_for_slot(
                tier,
                request,
                exclude,
                enqueued_at,
                self.config.queue_timeout_s - waited,
                deferral_s,
            )
            if decision is not None:
                return decision
            decision = self.choose(request, exclude)
            held = time.monotonic() - enqueued_at
            if decision.replica is None or not decision.queue_advised or held >= deferral_s:
                return decision

    async def _wait_for_slot(
        self,
        tier: str,
        request: RouteRequest,
        exclude: frozenset[str],
        enqueued_at: float,
        timeout_s: float,
        deferral_s: float,
    ) -> Decision | None:
        """Wait for a slot (None when it came) or a refresh at which the router no longer
        advises waiting, or a looser tier's request has been held its tier's deferral (that
        decision); a 429 when the queue is full, a 503 past the wait."""
        slot = asyncio.ensure_future(
            self.queue.wait_for_slot(tier, timeout_s=max(0.0, timeout_s), enqueued_at=enqueued_at)
        )
        try:
            while True:
                refreshed = asyncio.ensure_future(self.routing.next_refresh())
                try:
                    await asyncio.wait({slot, refreshed}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    refreshed.cancel()
                if slot.done():
                    slot.result()  # QueueFull or TimeoutError
                    return None
                decision = self.choose(request, exclude)
                deferred = 0 < deferral_s <= time.monotonic() - enqueued_at
                if decision.replica is not None and (deferred or not decision.queue_advised):
                    return decision
        except QueueFull as full:
            raise ApiError(
                429,
                "Every replica is at its latency limit and the queue is full; retry later.",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(max(1, round(full.retry_after_s)))},
            ) from None
        except TimeoutError:
            raise ApiError(
                503,
                "Every replica is at its latency limit; the request waited too long.",
                code="no_capacity",
                headers={"Retry-After": str(max(1, round(self.queue.retry_after_s())))},
            ) from None
        finally:
            # Leaving without the slot (capacity seen in telemetry, or the client left):
            # the queue forgets this waiter, or hands a slot released meanwhile to the next.
            slot.cancel()

    def request_started(
        self,
        replica_id: str,
        prefill_tokens: int,
        context_tokens: int = 0,
        *,
        tpot_objective_s: float | None = None,
    ) -> None:
        state = self.routing.snapshot.state
        state.request_started(
            replica_id,
            prefill_tokens,
            time.monotonic(),
            context_tokens=context_tokens,
            tpot_objective_s=tpot_objective_s,
            unsynced=True,
        )
        self.inflight_sync.started(replica_id, prefill_tokens, context_tokens, tpot_objective_s)
        breaker = self.breakers.get(replica_id)
        if breaker is not None and breaker.allow_request():
            # Half-open: this request is the probe; nothing else goes until it reports.
            state.set_breaker(replica_id, breaker.blocked_until)

    @property
    def lease_renewal_s(self) -> float:
        return self.limiter.lease_ttl_s / 2

    def renew_lease_soon(self, reservation: Reservation | None) -> None:
        """Renew a long stream's concurrency lease in the background (off the token path)."""
        if reservation is None or reservation.degraded or not reservation.lease_keys:
            return
        task = asyncio.create_task(self._renew(reservation))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _renew(self, reservation: Reservation) -> None:
        try:
            await self.limiter.renew_lease(reservation)
        except (RedisError, OSError, TimeoutError) as error:
            log.warning("could not renew the stream lease of %s: %s", reservation.request_id, error)

    def request_first_token(self, replica_id: str, prefill_tokens: int) -> None:
        self.routing.snapshot.state.request_first_token(replica_id, prefill_tokens)
        self.inflight_sync.first_token(replica_id, prefill_tokens)

    def observe_ttft(self, replica_id: str, ttft_s: float, decision: Decision) -> None:
        """The first token came `ttft_s` after the request was sent where `decision` sent
        it: the replica's TTFT calibration learns from it (`RouterState.observe_ttft`)."""
        self.routing.snapshot.state.observe_ttft(
            replica_id,
            ttft_s,
            decision.predicted_ttft_s,
            decision.ttft_scale,
            self.router_config,
        )

    def request_finished(
        self,
        replica_id: str,
        prefill_tokens: int,
        *,
        first_token_seen: bool,
        context_tokens: int = 0,
        tpot_objective_s: float | None = None,
    ) -> None:
        unsynced = self.inflight_sync.finished(
            replica_id, prefill_tokens, context_tokens, tpot_objective_s, first_token_seen
        )
        self.routing.snapshot.state.request_finished(
            replica_id,
            prefill_tokens,
            first_token_seen=first_token_seen,
            context_tokens=context_tokens,
            now=time.monotonic(),
            tpot_objective_s=tpot_objective_s,
            unsynced=unsynced,
        )
        if len(self.queue):
            self.queue.release()

    def _breaker(self, replica_id: str) -> CircuitBreaker:
        breaker = self.breakers.get(replica_id)
        if breaker is None:
            breaker = CircuitBreaker(
                failure_threshold=self.config.breaker_failures,
                base_open_s=self.config.breaker_base_s,
                max_open_s=self.config.breaker_max_s,
            )
            self.breakers[replica_id] = breaker
        return breaker

    def abandon_probe(self, replica_id: str) -> None:
        breaker = self.breakers.get(replica_id)
        if breaker is not None:
            breaker.abandon_probe()
            self.routing.snapshot.state.set_breaker(replica_id, breaker.blocked_until)

    def record_failure(self, replica: ReplicaEndpoint, kind: str) -> None:
        metrics.UPSTREAM_FAILURES.labels(replica.pool, kind).inc()
        breaker = self._breaker(replica.replica_id)
        breaker.record_failure()
        self.routing.snapshot.state.set_breaker(replica.replica_id, breaker.blocked_until)

    def record_not_loaded(self, replica: ReplicaEndpoint, adapter: str | None) -> None:
        """The replica answered 404 for the model name it was sent: keep that adapter away
        from it for a while (a base model missing is the routing table's to correct)."""
        metrics.UPSTREAM_FAILURES.labels(replica.pool, "not_loaded").inc()
        if adapter is not None:
            until = time.monotonic() + ADAPTER_MISS_S
            self._adapter_misses[(replica.replica_id, adapter)] = until

    def _replicas_without(self, adapter: str) -> frozenset[str]:
        now = time.monotonic()
        missing: set[str] = set()
        for (replica_id, name), until in list(self._adapter_misses.items()):
            if until <= now:
                del self._adapter_misses[(replica_id, name)]
            elif name == adapter:
                missing.add(replica_id)
        return frozenset(missing)

    def record_success(self, replica: ReplicaEndpoint) -> None:
        breaker = self.breakers.get(replica.replica_id)
        if breaker is not None:
            breaker.record_success()
            self.routing.snapshot.state.set_breaker(replica.replica_id, breaker.blocked_until)

    # --- settle --------------------------------------------------------------------------

    def price(
        self,
        model: str,
        adapter: str | None,
        tier: str,
        tenant_id: int,
        at: float,
        *,
        prompt_tokens: int,
        cached_prompt_tokens: int,
        completion_tokens: int,
    ) -> int:
        try:
            price = self.price_book.price_for(model, adapter, tier, tenant_id, at)
        except PriceNotFound:
            return 0
        return charge_usd_micros(price, prompt_tokens, cached_prompt_tokens, completion_tokens)

    async def settle(
        self,
        event: UsageEvent,
        reservation: Reservation | None,
        *,
        rollout_deployment_id: str | None,
    ) -> None:
        """ONE Redis round trip: limiter refund/charge and slot release, the usage event,
        the rollout counters. If Redis refuses, the usage event goes to the local spool and
        the limiter's settle waits in memory; both are sent again once Redis is back.
        On a Redis Cluster, whose pipelines refuse EVALSHA, the limiter's settle goes first
        on its own (its script is reloaded if lost, and it waits in memory the same way)."""
        if reservation is not None and isinstance(self.redis, aioredis.RedisCluster):
            await self._settle_limiter_alone(event, reservation)
            reservation = None
        pipeline = await self._settle_pipeline(event, reservation, rollout_deployment_id)
        try:
            await pipeline.execute()
        except NoScriptError:
            # Redis restarted and lost the settle script. Every other command of the pipeline
            # ran; load the script and send the limiter's settle again, alone.
            await self._settle_limiter_again(event, reservation)
        except (RedisError, OSError, TimeoutError) as error:
            log.error("settle of %s could not reach Redis (%s); spooling", event.request_id, error)
            metrics.SPOOLED_EVENTS.inc()
            # The refund and the stream slot are retried (idempotently: the pipeline may have
            # run in part) rather than left to the lease's expiry.
            self._defer_limiter_settle(event, reservation)
            await self.spool.append_async(event)
        if event.key_id is not None:
            self.authenticator.touch(event.key_id)

    async def _settle_limiter_alone(self, event: UsageEvent, reservation: Reservation) -> None:
        try:
            # An unreachable Redis is handled inside: the settle waits in memory.
            await self.limiter.settle(
                reservation,
                prompt_tokens=event.prompt_tokens,
                completion_tokens=event.completion_tokens,
                charged_usd_micros=event.price_charged_usd_micros,
            )
        except RedisError as error:
            log.error("limiter settle of %s failed: %s", event.request_id, error)
            self._defer_limiter_settle(event, reservation)

    def _defer_limiter_settle(self, event: UsageEvent, reservation: Reservation | None) -> None:
        if reservation is None:
            return
        self.limiter.defer_settle(
            reservation,
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
            charged_usd_micros=event.price_charged_usd_micros,
        )

    async def _settle_limiter_again(
        self, event: UsageEvent, reservation: Reservation | None
    ) -> None:
        if reservation is None or reservation.degraded:
            return
        try:
            await self.limiter.load_scripts()
            pipeline = self.redis.pipeline(transaction=False)
            await self._queue_limiter_settle(pipeline, event, reservation)
            await pipeline.execute()
        except (RedisError, OSError, TimeoutError) as error:
            # The usage event, which bills, was written; the refund is retried later.
            log.error("limiter settle of %s failed again: %s", event.request_id, error)
            self._defer_limiter_settle(event, reservation)

    async def _settle_pipeline(
        self, event: UsageEvent, reservation: Reservation | None, rollout_deployment_id: str | None
    ) -> Pipeline | ClusterPipeline:
        pipeline = self.redis.pipeline(transaction=False)
        if reservation is not None and not reservation.degraded:
            await self._queue_limiter_settle(pipeline, event, reservation)
        add_usage_event(pipeline, event)
        if rollout_deployment_id is not None:
            tier = self.slo_tier(event.priority)
            objective = tier.ttft_s if tier is not None else None
            _count_for_rollout(pipeline, rollout_deployment_id, event, objective)
        return pipeline

    async def _queue_limiter_settle(
        self, pipeline: Pipeline | ClusterPipeline, event: UsageEvent, reservation: Reservation
    ) -> None:
        # Never a Cluster's pipeline, which refuses EVALSHA: there the settle went alone.
        assert isinstance(pipeline, Pipeline)
        await self.limiter.settle_commands(
            pipeline,
            reservation,
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
            charged_usd_micros=event.price_charged_usd_micros,
        )


def _count_for_rollout(
    pipeline: Pipeline | ClusterPipeline,
    deployment_id: str,
    event: UsageEvent,
    ttft_objective_s: float | None,
) -> None:
    """The request's counters for its deployment's rollout and autoscaler
    (registry.rollout_metrics); `ttft_objective_s`: its tier's, None where it has none."""
    ttft_ms, tpot_ms = event.ttft_ms, event.tpot_ms
    add_request(
        pipeline,
        deployment_id,
        # The engine's refusals count against a version, unlike the SLO's judgement: a
        # canary that refuses what its baseline serves (a shorter context) must roll back.
        ok=event.status in ("ok", "client_cancelled"),
        ttft_s=None if ttft_ms is None else ttft_ms / 1000,
        tpot_s=None if tpot_ms is None else tpot_ms / 1000,
        output_tokens=event.completion_tokens,
        finish_reason=event.finish_reason or None,
        ttft_objective_s=ttft_objective_s,
    )


def _redis_client(config: GatewayConfig) -> aioredis.Redis | aioredis.RedisCluster:
    # A pooled connection to a Redis that restarted fails on first use: once, on a new
    # connection. Timeouts are not retried (the command may have run); the admission script
    # answers a second run of the same request as the first.
    retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
    if config.redis_cluster:
        # One pool per node, of at most `redis_max_connections`; a command beyond that fails
        # (MaxConnectionsError) where the plain pool below would wait. The cluster client's
        # one retry also follows a timeout (redis-py retries its own error list there), which
        # the scripts and the usage event's unique request id make harmless.
        return aioredis.RedisCluster.from_url(
            config.redis_url,
            max_connections=config.redis_max_connections,
            socket_timeout=config.redis_timeout_s,
            socket_connect_timeout=config.redis_timeout_s,
            health_check_interval=10,
            retry=retry,
        )
    # A bounded pool that makes a burst wait briefly for a connection rather than fail:
    # every in-flight request holds one during admission and settle.
    pool = aioredis.BlockingConnectionPool.from_url(
        config.redis_url,
        max_connections=config.redis_max_connections,
        timeout=config.redis_timeout_s * 4,
        socket_timeout=config.redis_timeout_s,
        socket_connect_timeout=config.redis_timeout_s,
        health_check_interval=10,
        retry=retry,
    )
    return aioredis.Redis(connection_pool=pool)


_gateway: Gateway | None = None
_gateway_lock: asyncio.Lock | None = None


async def process_gateway(build: Callable[[], Gateway]) -> Gateway:
    """The process's gateway, made by `build` and started on first use (uvicorn runs without
    lifespan here)."""
    global _gateway, _gateway_lock
    if _gateway is not None:
        return _gateway
    if _gateway_lock is None:
        _gateway_lock = asyncio.Lock()
    async with _gateway_lock:
        if _gateway is None:
            gateway = build()
            await gateway.start()
            _gateway = gateway
    return _gateway
