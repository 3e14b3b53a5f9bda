"""The discrete-event loop: the real router and the real autoscaler over engine models.

Virtual time moves from event to event: an arrival, a telemetry scrape, an autoscaler tick, a
replica finishing its cold start. Before anything happens at time t, every busy engine is
advanced to t with `Engine.advance`, which fast-forwards runs of identical decode steps, so
finishes are known (the router's in-flight counts drop) before the next decision.

The router sees what the gateway sees: telemetry (running, waiting, KV use) as of the last
scrape, every `telemetry_interval_s` (None: the policy's own `refresh_interval_s`), plus its
in-flight counts: a request's start, first token and finish are counted when they happen
(an engine step that began before an arrival and ends after it has not yet given its
tokens to the gateway deciding then). With `gateways` N > 1 the arrivals are dealt round
robin to N gateways, as a load balancer in front of them would; each has its own copy of
every replica's `ReplicaState`, its own `RouterState` (prefix index, random draws) and its
own policy. Every scrape reaches every gateway's copy. The gateway that routed a request
counts it at once; the others count it `inflight_sync_delay_s` later where the counts are
shared (`SimConfig.share_inflight`, as our gateways do), never where not (as the peers'
routers ship). Gateway 0 draws the random numbers one gateway always drew, so N = 1 is the
single-gateway simulation unchanged. The
autoscaler sees windowed samples of the same scrapes; a replica it adds pays for its cold
start before it takes traffic, and one it removes drains (leaves the router at once, stops
when its engine is empty), paying until then.

A fleet whose pools serve several models (`PoolSpec.model`) publishes one route per model,
each over its own deployment (the fleet's own model keeps the one deployment a one-model
fleet has), and a request is routed by its model (`SimRequest.model`, else the fleet's): the
policy sees only that model's replicas, and a model no pool serves fails as no_candidates.

Disaggregated fleets (pools with role prefill and decode) run through the disaggregated
policy (`SimConfig(policy="disaggregated")`), which may also pick a colocated pool's
replica. A disaggregated request is prefilled on its prefill replica (asked for one token,
as vLLM's proxy does); at that finish its KV is booked on the link (`link.schedule_transfer`:
the prefill replica's port and the decode replica's, first come first served) and the
request is added to the decode engine with the landing time. Its TTFT is the decode
engine's first token, the one the client sees. Prefill engines are advanced first at every
event, so each hand-off reaches its decode engine at its own time, before that engine runs
past it.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from serving.capacity.autoscaler import (
    AutoscalerConfig,
    FleetSample,
    ReplicaBounds,
    daily_forecast,
    recommend,
)
from serving.clustersim.fleet import FleetSpec, PoolSpec
from serving.clustersim.workloads import SimRequest
from serving.engine.core import (
    DECODE,
    FINISHED,
    FIRST_TOKEN,
    PREEMPTED,
    Engine,
    EngineEvent,
    EngineRequest,
)
from serving.engine.link import LinkPort, load_link_specs, schedule_transfer
from serving.router import (
    OWN_POLICIES,
    DeploymentRoute,
    ModelRoute,
    Policy,
    PrefixIndex,
    ReplicaState,
    RouterConfig,
    RouteRequest,
    RouterState,
)
from serving.router.coefficients import coefficients_from_perf
from serving.router.contracts import Decision, KvLink, time_per_output_token
from serving.router.disaggregated import Disaggregated
from serving.router.external import policy_class
from serving.router.queue import queue_key

DEPLOYMENT = "sim"
# Why a gateway refused a request from its admission queue: full (429), or waited too long (503).
REFUSED = ("queue_full", "queue_timeout")
DISAGGREGATED = Disaggregated.name
# Our policies read telemetry the gateway refreshes from Redis; peers name their own interval.
DEFAULT_REFRESH_INTERVAL_S = 2.0


@dataclass(frozen=True, slots=True)
class SimConfig:
    policy: str = "cost_aware"
    router: RouterConfig = field(default_factory=RouterConfig)
    # None: the policy class's own `refresh_interval_s` (DEFAULT_REFRESH_INTERVAL_S if none).
    telemetry_interval_s: float | None = 2.0
    # Gateway processes, each with only its own in-flight counts and prefix index ...
    gateways: int = 1
    # ... each told how many they are (RouterConfig.gateways), as a deployment's gateways
    # count each other through Redis (serving/gateway/peers.py); False: each routes as if
    # it were the only one.
    count_gateways: bool = True
    # Whether the gateways' prefix indexes are one: None, as the product does it (our
    # gateways keep theirs in step through Redis, serving/gateway/prefix_sync.py, modelled
    # as instant; the peers' routers each keep their own, as they ship).
    share_prefix_index: bool | None = None
    # Whether each gateway counts the others' requests in flight: None, as the product
    # does it (our gateways publish every start, first token and finish through Redis,
    # serving/gateway/inflight_sync.py, and apply the others'; here each reaches the other
    # gateways `inflight_sync_delay_s` later: the wait for the publish before it, the hop
    # and both event loops, a Redis round trip being well under a millisecond on a LAN;
    # the peers' routers each count only their own, as they ship). Until then the
    # sender takes it once per gateway (`ReplicaState.unsynced`); never, when not shared.
    share_inflight: bool | None = None
    inflight_sync_delay_s: float = 0.005
    autoscaler: AutoscalerConfig | None = None
    autoscale_interval_s: float = 15.0
    cold_start_s: float = 90.0
    # The daily pattern the autoscaler's forecast looks back over; None: no forecast.
    forecast_period_s: float | None = None
    seed: int = 0
    # Whether a gateway holds a request the router advises queueing (`Decision.queue_advised`)
    # in its admission queue, as the product's gateway does (serving/gateway/service.py,
    # `wait_in_queue`): None, as the product does it (our policies; the peers' routers ship
    # no such queue). The queue's size, aging and wait limit are `GatewayConfig`'s defaults.
    admission_queue: bool | None = None
    queue_max: int = 1024
    queue_aging_s: float = 10.0
    queue_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if self.policy != DISAGGREGATED:
            try:
                policy_class(self.policy)
            except ValueError as error:
                raise ValueError(f"{error} (or {DISAGGREGATED})") from None
        if self.gateways < 1:
            raise ValueError(f"gateways must be at least 1, not {self.gateways}")
        if not self.inflight_sync_delay_s >= 0:
            raise ValueError(
                f"inflight_sync_delay_s must be at least 0, not {self.inflight_sync_delay_s}"
            )
        if self.queue_max < 1 or not self.queue_aging_s > 0 or not self.queue_timeout_s > 0:
            raise ValueError(
                "the admission queue needs queue_max >= 1, queue_aging_s > 0 and "
                "queue_timeout_s > 0"
            )
        if self.telemetry_interval_s is not None and not self.telemetry_interval_s > 0:
            raise ValueError(
                f"telemetry_interval_s must be positive, not {self.telemetry_interval_s}"
            )

    @property
    def policy_class(self) -> Callable[[RouterState, RouterConfig], Policy]:
        return Disaggregated if self.policy == DISAGGREGATED else policy_class(self.policy)

    @property
    def shares_prefix_index(self) -> bool:
        if self.share_prefix_index is not None:
            return self.share_prefix_index
        return self.policy in OWN_POLICIES or self.policy == DISAGGREGATED

    @property
    def holds_advised(self) -> bool:
        if self.admission_queue is not None:
            return self.admission_queue
        return self.policy in OWN_POLICIES

    @property
    def shares_inflight(self) -> bool:
        if self.gateways == 1:
            return False
        if self.share_inflight is not None:
            return self.share_inflight
        return self.policy in OWN_POLICIES or self.policy == DISAGGREGATED

    @property
    def scrape_interval_s(self) -> float:
        """Seconds between telemetry scrapes: the explicit interval, else the policy's own."""
        if self.telemetry_interval_s is not None:
            return self.telemetry_interval_s
        interval = getattr(self.policy_class, "refresh_interval_s", None)
        return float(interval) if interval else DEFAULT_REFRESH_INTERVAL_S


@dataclass(slots=True)
class RequestRecord:
    request: SimRequest
    replica_id: str | None = None
    gpu_class: str | None = None
    # Where least load would have sent it at the same moment (the decision's baseline).
    baseline_replica_id: str | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    output_tokens: int = 0
    preemptions: int = 0
    # The prefill the router's in-flight accounting was told about (prompt less expected cache).
    prefill_tokens: int = 0
    # Why it never ran: "no_candidates", "too_long", "queue_full" (the gateway's 429),
    # "queue_timeout" (its 503 after `queue_timeout_s` in the queue); None when it was served.
    failed: str | None = None
    # When the gateway put it in its admission queue, and when it sent it on (None: never
    # held; sent at arrival).
    queued_s: float | None = None
    sent_s: float | None = None
    # The gateway that routed it, and the replicas its start is counted on there that the
    # other gateways do not know of yet.
    gateway: int = 0
    unsynced_on: list[str] = field(default_factory=list)
    # What the router predicted for it on the replica it chose (None: the policy predicts
    # nothing, as round robin); the report compares them with what the engine model did.
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    # The replica's TTFT scale in `predicted_ttft_s` (`Decision.ttft_scale`).
    ttft_scale: float | None = None
    # The objective the router protects its decode with (`Decision.tpot_objective_s`).
    tpot_objective_s: float | None = None
    # Disaggregated: where it was prefilled (replica_id then decoded it), when the prefill
    # handed its KV off, and when the KV landed on the decode replica.
    prefill_replica_id: str | None = None
    prefill_gpu_class: str | None = None
    handoff_s: float | None = None
    kv_ready_s: float | None = None

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.request.arrival_s

    @property
    def sent_ttft_s(self) -> float | None:
        """From the moment the gateway sent it to its first token: what the router predicted
        and learns from (`ttft_s` less its wait in the admission queue)."""
        if self.first_token_s is None:
            return None
        sent = self.sent_s if self.sent_s is not None else self.request.arrival_s
        return self.first_token_s - sent

    @property
    def tpot_s(self) -> float | None:
        return time_per_output_token(self.first_token_s, self.finished_s, self.output_tokens)


@dataclass(slots=True)
class SimReplica:
    replica_id: str
    pool: PoolSpec
    engine: Engine
    # Each gateway's view of the replica, by gateway index: the same telemetry, its own
    # in-flight counts.
    states: list[ReplicaState]
    started_s: float
    ready_s: float
    drain_s: float | None = None
    stopped_s: float | None = None
    busy_s: float = 0.0
    port: LinkPort | None = None

    @property
    def gpus(self) -> int:
        return self.pool.tensor_parallel

    @property
    def state(self) -> ReplicaState:
        """The first gateway's view (the only one when there is one gateway)."""
        return self.states[0]


@dataclass(slots=True)
class Gateway:
    """One gateway process's router: its own table over its own replica views."""

    index: int
    state: RouterState
    policy: Policy


@dataclass(slots=True)
class TimePoint:
    at_s: float
    ready: dict[str, int]
    running: int
    waiting: int
    kv_usage: float


@dataclass(slots=True)
class SimResult:
    fleet: FleetSpec
    config: SimConfig
    records: list[RequestRecord]
    replicas: list[SimReplica]
    timeline: list[TimePoint]
    ended_s: float
    cpu_s: float
    scaling_events: list[tuple[float, str, int, str]]
    queue_advised: int = 0


class ClusterSimulator:
    def __init__(self, fleet: FleetSpec, config: SimConfig | None = None) -> None:
        self.fleet = fleet
        self.config = config or SimConfig()
        self._perf = {pool.name: fleet.perf(pool) for pool in fleet.pools}
        # Each pool's step budget, decided once (the platform's is a search over the roofline).
        self._budgets = {pool.name: fleet.batched_tokens(pool) for pool in fleet.pools}
        self._coefficients = {
            pool.name: coefficients_from_perf(
                self._perf[pool.name],
                max_num_seqs=fleet.max_num_seqs,
                max_num_batched_tokens=self._budgets[pool.name],
            )
            for pool in fleet.pools
        }
        self._routes = [
            ModelRoute(model, (DeploymentRoute(self._deployment(model), "v1", 100),))
            for model in fleet.models or (fleet.model,)
        ]
        self._replicas: dict[str, SimReplica] = {}
        self._serial = 0
        if fleet.disaggregated and self.config.policy != DISAGGREGATED:
            raise ValueError(
                f"fleet {fleet.describe()} has prefill and decode pools: use policy "
                f"{DISAGGREGATED!r}, not {self.config.policy!r}"
            )
        self._link = load_link_specs()[fleet.kv_link]
        shared = PrefixIndex() if self.config.shares_prefix_index else None
        self._gateways = [
            self._gateway(
                g,
                RouterState(
                    self._routes,
                    [],
                    seed=self._seed(g, 0),
                    prefix_index=shared if shared is not None else PrefixIndex(),
                ),
            )
            for g in range(self.config.gateways)
        ]
        self._arrivals = 0
        # In-flight counts not yet known where they will be: (when they are, order, the
        # gateway that routed the request, whether to it or to the others, RouterState
        # method, replica id, its arguments).
        self._now = 0.0
        self._shares_inflight = self.config.shares_inflight
        self._deferred: list[
            tuple[float, int, RequestRecord, bool, str, str, tuple[int, ...], dict[str, Any]]
        ] = []
        self._deferred_made = 0
        # Disaggregated requests waiting on their prefill: request id -> decode replica; and
        # the prefills finished, (time, request id), to hand off when the loop reaches them.
        self._handoff_to: dict[str, str] = {}
        self._handoffs: list[tuple[float, str]] = []
        self._records: dict[str, RequestRecord] = {}
        self._samples: dict[str, deque[FleetSample]] = {p.name: deque() for p in fleet.pools}
        self._raw: dict[str, deque[tuple[float, int]]] = {p.name: deque() for p in fleet.pools}
        self._history: dict[str, list[tuple[float, int]]] = {p.name: [] for p in fleet.pools}
        # Per pool, each first token's TTFT over its tier's objective since the last sample.
        self._recent_ttft: dict[str, list[float]] = {p.name: [] for p in fleet.pools}
        self._timeline: list[TimePoint] = []
        self._scaling: list[tuple[float, str, int, str]] = []
        self._queue_advised = 0
        # Each gateway's admission queue: a heap of (tier rank x aging + enqueued at, order,
        # record), as `serving.router.queue.AdmissionQueue` keys it; the same records in
        # the order they came, for their wait limit; and the slots released by the
        # gateway's requests finishing, (when, gateway), to hand out when the loop gets there.
        self._held: list[list[tuple[float, int, RequestRecord]]] = [
            [] for _ in range(self.config.gateways)
        ]
        self._held_order: list[deque[RequestRecord]] = [
            deque() for _ in range(self.config.gateways)
        ]
        self._held_made = 0
        self._waiting = [0] * self.config.gateways
        self._releases: list[tuple[float, int]] = []
        self._dirty = False

    # --- replicas ----------------------------------------------------------------------

    def _add_replica(self, pool: PoolSpec, now_s: float, ready_s: float) -> SimReplica:
        perf = self._perf[pool.name]
        replica_id = f"{pool.name}-{self._serial}"
        self._serial += 1
        engine = Engine(
            perf,
            max_model_len=self.fleet.max_model_len(perf),
            max_num_seqs=self.fleet.max_num_seqs,
            max_num_batched_tokens=self._budgets[pool.name],
            enable_prefix_caching=self.fleet.enable_prefix_caching,
            clock_s=now_s,
            role=pool.role,
        )
        model = self.fleet.pool_model(pool)
        deployment_id = self._deployment(model)
        kv_link = KvLink(self._link.gbytes_per_s, self._link.latency_s)

        def view() -> ReplicaState:
            return ReplicaState(
                replica_id=replica_id,
                deployment_id=deployment_id,
                model=model,
                version="v1",
                pool=pool.name,
                gpu_class=pool.gpu_class,
                region=pool.region,
                price_per_hour=pool.price_per_replica_hour,
                perf=self._coefficients[pool.name],
                telemetry_at=ready_s,
                role=pool.role,
                kv_link=kv_link,
            )

        # Each gateway's own view, built afresh: a copy (`dataclasses.replace`) would share
        # its dict of TPOT objectives in flight, so that every start counted once per
        # gateway and the tightest objective went stale on all but one gateway.
        states = [view() for _ in range(self.config.gateways)]
        replica = SimReplica(
            replica_id, pool, engine, states, now_s, ready_s, port=LinkPort(self._link)
        )
        self._replicas[replica_id] = replica
        self._dirty = True
        return replica

    def _deployment(self, model: str) -> str:
        return DEPLOYMENT if model == self.fleet.model else f"{DEPLOYMENT}-{model}"

    def _routable(self, now_s: float) -> list[SimReplica]:
        return [r for r in self._replicas.values() if r.drain_s is None and r.ready_s <= now_s]

    def _republish(self, now_s: float) -> None:
        """A new routing-table version on every gateway: each one's prefix index and
        in-flight counts carry over."""
        routable = self._routable(now_s)
        for g, gateway in enumerate(self._gateways):
            version = gateway.state.version + 1
            state = RouterState(
                self._routes,
                [r.states[g] for r in routable],
                version=version,
                prefix_index=gateway.state.prefix_index,
                seed=self._seed(g, version),
            )
            self._gateways[g] = self._gateway(g, state)
        self._dirty = False

    def _seed(self, gateway: int, version: int) -> int:
        # Gateway 0 keeps the single gateway's seeds; the others draw apart from it.
        return self.config.seed + version + gateway * 1_000_003

    def _gateway(self, index: int, state: RouterState) -> Gateway:
        router = self.config.router
        if self.config.count_gateways:
            router = replace(router, gateways=self.config.gateways)
        return Gateway(index, state, self.config.policy_class(state, router))

    def _count(
        self,
        record: RequestRecord,
        at_s: float,
        method: str,
        replica_id: str,
        *args: int,
        **kwargs: Any,
    ) -> None:
        """Count a start, first token or finish of `record` (a `RouterState` method's name
        and arguments) that happened at `at_s`: on the gateway that routed it when the loop
        reaches `at_s` (an engine step that began before now ends after it, and its events
        are not yet known), and, with the counts shared, on every other gateway
        `inflight_sync_delay_s` later (`now`, where the method takes one, is when each
        gateway applies it). A start stays unsynced on the routing gateway until the others
        have it, for ever where they never will."""
        if method == "request_started":
            record.unsynced_on.append(replica_id)
            own = {**kwargs, "unsynced": True}
        elif method == "request_finished" and replica_id in record.unsynced_on:
            record.unsynced_on.remove(replica_id)
            own = {**kwargs, "unsynced": True}
        else:
            own = kwargs
        if at_s <= self._now:
            getattr(self._gateways[record.gateway].state, method)(replica_id, *args, **own)
        else:
            self._defer(at_s, record, True, method, replica_id, args, own)
        if self._shares_inflight:
            delay = self.config.inflight_sync_delay_s
            self._defer(at_s + delay, record, False, method, replica_id, args, kwargs)

    def _observe_ttft(
        self, record: RequestRecord, at_s: float, replica_id: str, ttft_s: float
    ) -> None:
        """The routing gateway learns the request's TTFT against its prediction
        (`RouterState.observe_ttft`) when the loop reaches `at_s`."""
        kwargs: dict[str, Any] = {
            "observed_s": ttft_s,
            "predicted_s": record.predicted_ttft_s,
            "scale": record.ttft_scale,
            "config": self.config.router,
        }
        if at_s <= self._now:
            self._gateways[record.gateway].state.observe_ttft(replica_id, **kwargs)
        else:
            self._defer(at_s, record, True, "observe_ttft", replica_id, (), kwargs)

    def _defer(
        self,
        at_s: float,
        record: RequestRecord,
        own: bool,
        method: str,
        replica_id: str,
        args: tuple[int, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self._deferred_made += 1
        entry = (at_s, self._deferred_made, record, own, method, replica_id, args, kwargs)
        heapq.heappush(self._deferred, entry)

    def _apply_deferred(self, now_s: float) -> None:
        """The counts that have reached their gateways by `now_s`: the routing gateway's
        own (`own`), or those on their way from it to the others."""
        deferred = self._deferred
        gateways = self._gateways
        while deferred and deferred[0][0] <= now_s:
            at_s, _, record, own, method, replica_id, args, kwargs = heapq.heappop(deferred)
            if "now" in kwargs:
                kwargs = {**kwargs, "now": at_s}
            origin = record.gateway
            if own:
                getattr(gateways[origin].state, method)(replica_id, *args, **kwargs)
                continue
            for gateway in gateways:
                if gateway.index != origin:
                    getattr(gateway.state, method)(replica_id, *args, **kwargs)
            if method == "request_started" and replica_id in record.unsynced_on:
                record.unsynced_on.remove(replica_id)
                gateways[origin].state.request_synced(replica_id, *args)

    # --- engines -----------------------------------------------------------------------

    def _advance_all(self, now_s: float) -> None:
        if not self._handoff_to:
            for replica in self._replicas.values():
                if replica.engine.has_work:
                    self._advance(replica, now_s)
            return
        # Prefill engines first: their hand-offs reach decode engines at their own times. A
        # prefill step that ends after `now_s` hands off later, when the loop gets there, so
        # the link is booked in the order the prefills finished.
        handoffs = self._handoffs
        for replica in self._replicas.values():
            if replica.pool.role != DECODE and replica.engine.has_work:
                for handoff in self._advance(replica, now_s):
                    heapq.heappush(handoffs, handoff)
        while handoffs and handoffs[0][0] <= now_s:
            at_s, request_id = heapq.heappop(handoffs)
            decode = self._replicas[self._handoff_to.pop(request_id)]
            if decode.engine.has_work:
                self._advance(decode, at_s)
            self._hand_off(request_id, at_s, decode)
        for replica in self._replicas.values():
            if replica.pool.role == DECODE and replica.engine.has_work:
                self._advance(replica, now_s)

    def _hand_off(self, request_id: str, at_s: float, decode: SimReplica) -> None:
        """The prefill finished at `at_s`: book the KV on the link, queue it at the decode."""
        record = self._records[request_id]
        request = record.request
        assert record.prefill_replica_id is not None
        prefill = self._replicas[record.prefill_replica_id]
        assert prefill.port is not None and decode.port is not None
        nbytes = request.prompt_tokens * self._perf[decode.pool.name].kv_bytes_per_token
        start, landed = schedule_transfer(at_s, nbytes, prefill.port, decode.port)
        record.handoff_s, record.kv_ready_s = at_s, landed
        decode.engine.add_request(
            EngineRequest(request.request_id, request.prompt_tokens, request.output_tokens, at_s),
            kv_ready_s=landed,
            kv_transfer_s=landed - start,
        )

    def _advance(self, replica: SimReplica, now_s: float) -> list[tuple[float, str]]:
        """Advance one engine to `now_s`; the prefill hand-offs it made, (time, request)."""
        records = self._records
        engine = replica.engine
        handoffs: list[tuple[float, str]] = []
        started = engine.clock_s
        events = engine.advance(now_s)
        last = started
        for event in events:
            record = records[event.request_id]
            kind = event.kind
            if record.prefill_replica_id == replica.replica_id:
                self._prefill_event(replica, record, event, handoffs)
                last = event.time_s if kind == FINISHED else last
                continue
            # A decode replica did none of the prefill the router was told about.
            prompt = record.prefill_tokens if record.prefill_replica_id is None else 0
            if kind == FIRST_TOKEN:
                record.first_token_s = event.time_s
                self._count(record, event.time_s, "request_first_token", replica.replica_id, prompt)
                ttft = event.time_s - record.request.arrival_s
                if record.ttft_scale is not None:
                    sent_ttft = record.sent_ttft_s
                    assert sent_ttft is not None
                    self._observe_ttft(record, event.time_s, replica.replica_id, sent_ttft)
                tier = self.config.router.slo_tiers.get(record.request.tier)
                if tier is not None and tier.ttft_s:
                    self._recent_ttft[replica.pool.name].append(ttft / tier.ttft_s)
            elif kind == FINISHED:
                record.finished_s = event.time_s
                record.output_tokens = event.output_tokens
                if self._waiting[record.gateway]:
                    # The gateway that streamed it hands its slot to the best waiter.
                    heapq.heappush(self._releases, (event.time_s, record.gateway))
                self._count(
                    record,
                    event.time_s,
                    "request_finished",
                    replica.replica_id,
                    prompt,
                    context_tokens=record.request.prompt_tokens,
                    now=event.time_s,
                    tpot_objective_s=record.tpot_objective_s,
                )
                last = event.time_s
            elif kind == PREEMPTED:
                record.preemptions += 1
        replica.busy_s += (engine.clock_s if engine.has_work else last) - started
        if replica.drain_s is not None and not engine.has_work:
            replica.stopped_s = max(last, replica.drain_s)
        return handoffs

    def _prefill_event(
        self,
        replica: SimReplica,
        record: RequestRecord,
        event: EngineEvent,
        handoffs: list[tuple[float, str]],
    ) -> None:
        if event.kind == FIRST_TOKEN:
            self._count(
                record,
                event.time_s,
                "request_first_token",
                replica.replica_id,
                record.prefill_tokens,
            )
        elif event.kind == FINISHED:
            self._count(
                record,
                event.time_s,
                "request_finished",
                replica.replica_id,
                record.prefill_tokens,
            )
            handoffs.append((event.time_s, record.request.request_id))
        elif event.kind == PREEMPTED:
            record.preemptions += 1

    # --- routing -----------------------------------------------------------------------

    def _route_request(self, request: SimRequest) -> None:
        # Round robin over the gateways, as the load balancer in front of them deals.
        gateway = self._gateways[self._arrivals % len(self._gateways)]
        self._arrivals += 1
        record = RequestRecord(request, gateway=gateway.index)
        self._records[request.request_id] = record
        self._dispatch(record, request.arrival_s, may_hold=True)

    def _dispatch(self, record: RequestRecord, at_s: float, *, may_hold: bool) -> bool:
        """Ask the record's gateway where to send it at `at_s` and send it there; with
        `may_hold`, hold it in the gateway's admission queue instead where the router advises
        queueing (`SimConfig.holds_advised`). Whether it left the gateway (sent or failed)."""
        request = record.request
        gateway = self._gateways[record.gateway]
        decision = gateway.policy.choose(
            RouteRequest(
                model=request.model or self.fleet.model,
                tenant=request.tenant,
                tier=request.tier,  # type: ignore[arg-type]
                prompt_tokens=request.prompt_tokens,
                max_tokens=request.output_tokens,
                request_id=request.request_id,
                prefix_hashes=request.block_hashes,
            ),
            at_s,
        )
        if decision.replica is None:
            record.failed = "no_candidates"
            return True
        if decision.queue_advised:
            self._queue_advised += 1
            if may_hold and self.config.holds_advised:
                if record.queued_s is None:
                    self._hold(record, at_s)
                return record.failed is not None
            # Not held (a queue-less gateway, or a slot handed to it): the least-bad choice
            # the router made, as the gateway sends it.
        self._send(record, decision, at_s)
        return True

    def _send(self, record: RequestRecord, decision: Decision, at_s: float) -> None:
        request = record.request
        record.sent_s = at_s
        assert decision.replica is not None
        replica = self._replicas[decision.replica.replica_id]
        engine = replica.engine
        if request.prompt_tokens + request.output_tokens > engine.max_model_len:
            record.failed = "too_long"
            return
        record.predicted_ttft_s = decision.predicted_ttft_s
        record.predicted_tpot_s = decision.predicted_tpot_s
        record.ttft_scale = decision.ttft_scale
        record.tpot_objective_s = decision.tpot_objective_s
        if decision.prefill_replica is not None:
            self._route_disaggregated(record, decision.prefill_replica.replica_id, replica)
            record.prefill_tokens = max(0, request.prompt_tokens - decision.cached_tokens)
            prefill = self._replicas[decision.prefill_replica.replica_id]
            self._count(
                record,
                at_s,
                "request_started",
                prefill.replica_id,
                record.prefill_tokens,
                now=at_s,
            )
            self._count(
                record,
                at_s,
                "request_started",
                replica.replica_id,
                0,
                now=at_s,
                context_tokens=request.prompt_tokens,
                tpot_objective_s=decision.tpot_objective_s,
            )
            prefill.engine.add_request(
                EngineRequest(
                    request.request_id,
                    request.prompt_tokens,
                    1,
                    at_s,
                    request.block_hashes,
                )
            )
            return
        record.replica_id = replica.replica_id
        record.gpu_class = replica.pool.gpu_class
        baseline = decision.baseline_replica
        record.baseline_replica_id = baseline.replica_id if baseline is not None else None
        record.prefill_tokens = max(0, request.prompt_tokens - decision.cached_tokens)
        self._count(
            record,
            at_s,
            "request_started",
            replica.replica_id,
            record.prefill_tokens,
            now=at_s,
            context_tokens=request.prompt_tokens,
            tpot_objective_s=decision.tpot_objective_s,
        )
        engine.add_request(
            EngineRequest(
                request.request_id,
                request.prompt_tokens,
                request.output_tokens,
                at_s,
                request.block_hashes,
            )
        )

    # --- the gateways' admission queues -------------------------------------------------

    def _hold(self, record: RequestRecord, at_s: float) -> None:
        """Put the record in its gateway's admission queue; full, the gateway refuses it
        (429). Keyed as `AdmissionQueue.wait_for_slot` keys it (`queue_key`): a batch request
        that has waited two agings goes first."""
        g = record.gateway
        if self._waiting[g] >= self.config.queue_max:
            record.failed = REFUSED[0]
            return
        record.queued_s = at_s
        self._held_made += 1
        key = queue_key(record.request.tier, at_s, self.config.queue_aging_s)
        heapq.heappush(self._held[g], (key, self._held_made, record))
        self._held_order[g].append(record)
        self._waiting[g] += 1

    @staticmethod
    def _is_waiting(record: RequestRecord) -> bool:
        return record.queued_s is not None and record.sent_s is None and record.failed is None

    def _leave(self, record: RequestRecord) -> None:
        """The record left its gateway's queue (sent or failed); its heap entry goes lazily."""
        self._waiting[record.gateway] -= 1

    def _expire(self, now_s: float) -> None:
        """The waiters whose wait limit has passed leave with the gateway's 503."""
        limit = self.config.queue_timeout_s
        for order in self._held_order:
            while order and (
                not self._is_waiting(order[0]) or order[0].queued_s + limit <= now_s  # type: ignore[operator]
            ):
                record = order.popleft()
                if self._is_waiting(record):
                    record.failed = REFUSED[1]
                    self._leave(record)

    def _next_expiry(self) -> float:
        """When the first waiter of any gateway reaches its wait limit (inf: none waits)."""
        limit = self.config.queue_timeout_s
        first = math.inf
        for order in self._held_order:
            while order and not self._is_waiting(order[0]):
                order.popleft()
            if order:
                first = min(first, order[0].queued_s + limit)  # type: ignore[operator]
        return first

    def _pop_waiter(self, g: int) -> RequestRecord | None:
        heap = self._held[g]
        while heap:
            record = heapq.heappop(heap)[2]
            if self._is_waiting(record):
                return record
        return None

    def _deferred_for(self, record: RequestRecord, now_s: float) -> tuple[float, float]:
        """How long the waiter has waited, and its tier's `RouterConfig.deferral_s`."""
        assert record.queued_s is not None
        return now_s - record.queued_s, self.config.router.deferral_s(record.request.tier)

    def _release(self, now_s: float) -> None:
        """The slots the gateways' finished requests released by `now_s`: each goes to its
        gateway's best waiter, sent wherever the router then chooses, as
        `wait_in_queue` sends a request whose slot came (advised to queue or not)."""
        releases = self._releases
        while releases and releases[0][0] <= now_s:
            _, g = heapq.heappop(releases)
            record = self._pop_waiter(g) if self._waiting[g] else None
            if record is None:
                continue
            # Given a slot, it goes, unless the router still advises waiting and it is a
            # looser tier's request held less than its tier's deferral.
            waited, deferral = self._deferred_for(record, now_s)
            if self._dispatch(record, now_s, may_hold=waited < deferral):
                self._leave(record)
            else:  # still advised to wait: back in its place (a new order breaks ties)
                assert record.queued_s is not None
                key = queue_key(record.request.tier, record.queued_s, self.config.queue_aging_s)
                self._held_made += 1
                heapq.heappush(self._held[g], (key, self._held_made, record))

    def _retry_held(self, now_s: float) -> None:
        """At a telemetry refresh every waiter asks the router again, best first, and leaves
        the queue where it would now be sent without queueing, or where it is a looser
        tier's request held its tier's deferral (`wait_in_queue`)."""
        for g, heap in enumerate(self._held):
            if not self._waiting[g]:
                continue
            for _, _, record in sorted(heap):
                if not self._is_waiting(record):
                    continue
                # A looser tier's request held its tier's deferral goes now; another waits
                # for a slot while the router advises waiting.
                waited, deferral = self._deferred_for(record, now_s)
                if self._dispatch(record, now_s, may_hold=not 0 < deferral <= waited):
                    self._leave(record)

    # --- telemetry and autoscaling -----------------------------------------------------

    def _scrape(self, now_s: float) -> None:
        ready: dict[str, int] = {}
        running = waiting = 0
        kv_total = 0.0
        per_pool: dict[str, list[SimReplica]] = {p.name: [] for p in self.fleet.pools}
        for replica in self._routable(now_s):
            engine = replica.engine
            for gateway in self._gateways:
                gateway.state.update_telemetry(
                    replica.replica_id,
                    running=engine.num_running,
                    waiting=engine.num_waiting,
                    kv_usage=engine.kv_usage,
                    telemetry_at=now_s,
                )
            per_pool[replica.pool.name].append(replica)
            running += engine.num_running
            waiting += engine.num_waiting
            kv_total += engine.kv_usage
        count = sum(len(members) for members in per_pool.values())
        for name, members in per_pool.items():
            ready[name] = len(members)
            self._sample_pool(name, members, now_s)
        self._timeline.append(
            TimePoint(now_s, ready, running, waiting, kv_total / count if count else 0.0)
        )

    def _sample_pool(self, pool: str, members: list[SimReplica], now_s: float) -> None:
        ttfts = self._recent_ttft[pool]
        p95 = None
        if ttfts:
            ttfts.sort()
            p95 = ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))]  # of the objectives
            self._recent_ttft[pool] = []
        samples = self._samples[pool]
        samples.append(
            FleetSample(
                now_s,
                len(members),
                sum(r.engine.num_running for r in members),
                sum(r.engine.num_waiting for r in members),
                sum(r.engine.kv_usage for r in members) / len(members) if members else 0.0,
                p95,
            )
        )
        window = self.config.autoscaler.window_s if self.config.autoscaler else 60.0
        while samples and samples[0].at_s < now_s - window:
            samples.popleft()

    def _autoscale(self, now_s: float) -> None:
        config = self.config.autoscaler
        if config is None:
            return
        for pool in self.fleet.pools:
            if pool.autoscale is None:
                continue
            live = [
                r for r in self._replicas.values() if r.pool.name == pool.name and r.drain_s is None
            ]
            raw_log = self._raw[pool.name]
            while raw_log and raw_log[0][0] < now_s - config.scale_down_stabilization_s:
                raw_log.popleft()
            forecast = None
            if self.config.forecast_period_s:
                forecast = daily_forecast(
                    self._history[pool.name],
                    now_s=now_s,
                    period_s=self.config.forecast_period_s,
                    lead_s=self.config.cold_start_s * 2,
                    spread_s=self.config.autoscale_interval_s * 4,
                )
            decision = recommend(
                list(self._samples[pool.name]),
                now_s=now_s,
                current=len(live),
                bounds=ReplicaBounds(pool.autoscale.minimum, pool.autoscale.maximum),
                config=config,
                recent_raw=list(raw_log),
                forecast=forecast,
                starting=sum(1 for r in live if r.ready_s > now_s),
            )
            raw_log.append((now_s, decision.raw))
            self._history[pool.name].append((now_s, decision.reactive))
            self._apply(pool, live, decision.desired, decision.reason, now_s)

    def _apply(
        self, pool: PoolSpec, live: list[SimReplica], desired: int, reason: str, now_s: float
    ) -> None:
        if desired == len(live):
            return
        self._scaling.append((now_s, pool.name, desired, reason))
        if desired > len(live):
            for _ in range(desired - len(live)):
                self._add_replica(pool, now_s, now_s + self.config.cold_start_s)
            return
        # Replicas still starting go first (nothing to drain), then the least busy.
        victims = sorted(
            live, key=lambda r: (r.ready_s <= now_s, r.engine.num_running + r.engine.num_waiting)
        )
        for replica in victims[: len(live) - desired]:
            replica.drain_s = now_s
            if not replica.engine.has_work:
                replica.stopped_s = now_s
        self._dirty = True

    # --- the loop ----------------------------------------------------------------------

    def run(self, requests: list[SimRequest]) -> SimResult:
        started_cpu = time.process_time()
        for pool in self.fleet.pools:
            for _ in range(pool.replicas):
                self._add_replica(pool, 0.0, 0.0)
        self._republish(0.0)
        tick = self.config.scrape_interval_s
        scale_every = self.config.autoscale_interval_s
        next_scrape = 0.0
        next_scale = scale_every
        index = 0
        total = len(requests)
        now = 0.0
        while True:
            arrival = requests[index].arrival_s if index < total else math.inf
            pending = [r.ready_s for r in self._replicas.values() if r.ready_s > now]
            next_ready = min(pending) if pending else math.inf
            if index >= total and not self._busy():
                break
            next_handoff = self._handoffs[0][0] if self._handoffs else math.inf
            next_release = self._releases[0][0] if self._releases else math.inf
            now = min(arrival, next_scrape, next_ready, next_handoff, next_release)
            now = min(now, self._next_expiry())
            self._now = now
            self._advance_all(now)
            if next_ready <= now or self._dirty:
                self._republish(now)
            if any(self._waiting):
                self._apply_deferred(now)
                self._expire(now)
            if self._releases:
                self._release(now)
            if now == next_scrape:
                self._scrape(now)
                if any(self._waiting):
                    self._apply_deferred(now)
                    self._retry_held(now)
                next_scrape += tick
                if next_scale <= now:
                    self._autoscale(now)
                    next_scale += scale_every
                    if self._dirty:
                        self._republish(now)
            if now == arrival:
                self._apply_deferred(now)
                self._route_request(requests[index])
                index += 1
        self._apply_deferred(math.inf)  # the counts after the last arrival, for the record
        ended = max(
            [now] + [r.finished_s for r in self._records.values() if r.finished_s is not None]
        )
        for replica in self._replicas.values():
            if replica.stopped_s is None:
                replica.stopped_s = ended
        return SimResult(
            self.fleet,
            self.config,
            list(self._records.values()),
            list(self._replicas.values()),
            self._timeline,
            ended,
            time.process_time() - started_cpu,
            self._scaling,
            self._queue_advised,
        )

    def _route_disaggregated(
        self, record: RequestRecord, prefill_id: str, decode: SimReplica
    ) -> None:
        prefill = self._replicas[prefill_id]
        record.replica_id = decode.replica_id
        record.gpu_class = decode.pool.gpu_class
        record.baseline_replica_id = decode.replica_id
        record.prefill_replica_id = prefill_id
        record.prefill_gpu_class = prefill.pool.gpu_class
        self._handoff_to[record.request.request_id] = decode.replica_id

    def _busy(self) -> bool:
        return (
            bool(self._handoffs)
            or any(self._waiting)
            or any(r.engine.has_work for r in self._replicas.values())
        )


def simulate(
    fleet: FleetSpec, requests: list[SimRequest], config: SimConfig | None = None
) -> SimResult:
    return ClusterSimulator(fleet, config).run(requests)
