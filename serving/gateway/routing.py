"""The gateway's in-memory routing state, refreshed in the background from Redis.

The control plane publishes one versioned routing-table document (`{routing}:table`, version
announced on `routing:updates`) and the latest replica telemetry (`routing:telemetry`, a hash
of replica id -> compact JSON). This module turns them into the router's `RouterState`; the
hot path only reads memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import orjson
import redis.asyncio as aioredis

from serving.engine.link import load_link_specs
from serving.engine.perf import PerfModel
from serving.engine.specs import find_model_spec, load_gpu_specs
from serving.gateway.background import cancel_all, follow_channel
from serving.redis_contracts import (
    ROUTING_TABLE_KEY,
    ROUTING_TELEMETRY_KEY,
    ROUTING_UPDATES_CHANNEL,
)
from serving.router import (
    COLOCATED,
    DeploymentRoute,
    KvLink,
    ModelRoute,
    PrefixIndex,
    ReplicaPerf,
    ReplicaState,
    RouterState,
)
from serving.router.coefficients import coefficients_from_perf

log = logging.getLogger(__name__)


# A conservative stand-in when a replica's GPU or model is unknown to the engine model.
FALLBACK_PERF = ReplicaPerf(
    prefill_s_per_token=0.0002,
    prefill_base_s=0.02,
    compute_base_s=0.02,
    decode_base_s=0.02,
    decode_s_per_seq=0.0005,
    kv_capacity_tokens=100_000,
    max_num_seqs=256,
)


# This gateway's own view of each replica (the in-flight counts, its own and the other
# gateways'), which a new routing-table version must keep.
CARRIED_ACROSS_VERSIONS = (
    "inflight",
    "inflight_prompt_tokens",
    "inflight_context_tokens",
    "prefill_pending_tokens",
    "unsynced",
    "unsynced_prefill_tokens",
    "prompt_rate",
    "prompt_rate_at",
    "prefill_rate",
    "finish_rate",
    "finish_rate_at",
    "finish_rate_since",
    "inflight_tpot_objectives",
    "tightest_tpot_s",
    "breaker_open_until",
    "ttft_scale",
)


@dataclass(frozen=True, slots=True)
class ReplicaEndpoint:
    """What the gateway needs to send a request to a replica and to meter it."""

    replica_id: str
    deployment_id: str
    endpoint: str
    pool: str
    gpu_class: str
    model: str
    served_model_name: str
    version: str
    version_id: str | None
    price_per_hour: float
    max_model_len: int = 0
    # Colocated, or the phase of a disaggregated deployment it serves (prefill or decode).
    phase: str = COLOCATED
    # The replica's engine key, sent as its Bearer token (vLLM's --api-key).
    api_key: str | None = field(default=None, repr=False)


@dataclass(slots=True)
class RoutingSnapshot:
    version: int
    state: RouterState
    endpoints: dict[str, ReplicaEndpoint]
    deployment_tiers: dict[str, str] = field(default_factory=dict)
    served_models: frozenset[str] = frozenset()
    # Models with prefill or decode replicas: routed by the disaggregated policy, which also
    # weighs their colocated replicas (the other policies know no phases).
    disaggregated_models: frozenset[str] = frozenset()


@lru_cache(maxsize=512)
def replica_perf(
    gpu_class: str,
    model_spec: str,
    quantization: str,
    tensor_parallel: int,
    max_num_seqs: int,
    kv_cache_dtype: str,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int | None = None,
) -> ReplicaPerf:
    gpu = load_gpu_specs().get(gpu_class)
    model = find_model_spec(model_spec)
    if gpu is None or model is None:
        return FALLBACK_PERF
    try:
        perf = PerfModel(
            gpu,
            model,
            quantization=quantization or "bf16",
            tensor_parallel=tensor_parallel,
            kv_cache_dtype=kv_cache_dtype or "auto",
            gpu_memory_utilization=gpu_memory_utilization,
        )
        return coefficients_from_perf(
            perf, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        )
    except ValueError:
        return FALLBACK_PERF


def _replica_state(model: str, deployment: dict[str, Any], row: dict[str, Any]) -> ReplicaState:
    perf = replica_perf(
        str(row.get("gpu_class", "")),
        str(row.get("model_spec") or model),
        str(row.get("quantization") or "bf16"),
        int(row.get("tensor_parallel") or 1),
        int(row.get("max_num_seqs") or 256),
        str(row.get("kv_cache_dtype") or "auto"),
        float(row.get("gpu_memory_utilization") or 0.9),
        int(row["max_num_batched_tokens"]) if row.get("max_num_batched_tokens") else None,
    )
    return ReplicaState(
        replica_id=str(row["replica_id"]),
        deployment_id=str(deployment["deployment_id"]),
        model=model,
        version=str(deployment.get("version", "")),
        pool=str(row.get("pool", "")),
        gpu_class=str(row.get("gpu_class", "")),
        region=str(row.get("region", "")),
        price_per_hour=float(row.get("price_per_hour") or 0.0),
        perf=perf,
        adapters_loaded=frozenset(row.get("adapters") or ()),
        max_loras=int(row.get("max_loras") or 0),
        telemetry_at=time.monotonic(),
        role=str(row.get("phase") or COLOCATED),
        kv_link=_kv_link(row.get("kv_link")),
    )


def _kv_link(name: object) -> KvLink | None:
    """The replica's end of its KV hand-over (links.csv); None for a colocated replica or a
    link this gateway's data does not know (the router then pairs it with nothing)."""
    spec = load_link_specs().get(str(name)) if name else None
    return KvLink(spec.gbytes_per_s, spec.latency_s) if spec is not None else None


def carry_over(previous: RoutingSnapshot, snapshot: RoutingSnapshot) -> None:
    """Keep this gateway's own view of each replica in both versions (`CARRIED_ACROSS_VERSIONS`):
    requests in flight stay counted. The TTFT scale calibrates the replica's perf as the
    router models it, so a replica whose perf changed (another engine budget, another
    class under the same id) starts it over."""
    for replica_id in previous.endpoints:
        old = previous.state.replica(replica_id)
        new = snapshot.state.replica(replica_id)
        if old is not None and new is not None:
            for name in CARRIED_ACROSS_VERSIONS:
                setattr(new, name, getattr(old, name))
            if new.perf != old.perf:
                new.ttft_scale = 1.0


def build_snapshot(
    table: dict[str, Any], prefix_index: PrefixIndex | None = None
) -> RoutingSnapshot:
    routes: list[ModelRoute] = []
    replicas: list[ReplicaState] = []
    endpoints: dict[str, ReplicaEndpoint] = {}
    tiers: dict[str, str] = {}
    for model, entry in (table.get("models") or {}).items():
        deployments = entry.get("deployments") or []
        routes.append(
            ModelRoute(
                model=model,
                deployments=tuple(
                    DeploymentRoute(
                        deployment_id=str(d["deployment_id"]),
                        version=str(d.get("version", "")),
                        weight=int(d.get("weight", 0)),
                    )
                    for d in deployments
                ),
                cohort_by_tenant=bool(entry.get("cohort_by_tenant", False)),
            )
        )
        for deployment in deployments:
            tiers[str(deployment["deployment_id"])] = str(deployment.get("slo_tier") or "standard")
            for row in deployment.get("replicas") or []:
                replica = _replica_state(model, deployment, row)
                replicas.append(replica)
                endpoints[replica.replica_id] = ReplicaEndpoint(
                    replica_id=replica.replica_id,
                    deployment_id=replica.deployment_id,
                    endpoint=str(row["endpoint"]).rstrip("/"),
                    pool=replica.pool,
                    gpu_class=replica.gpu_class,
                    model=model,
                    served_model_name=str(row.get("served_model_name") or model),
                    version=replica.version,
                    version_id=(
                        str(deployment["version_id"]) if deployment.get("version_id") else None
                    ),
                    price_per_hour=replica.price_per_hour,
                    max_model_len=int(row.get("max_model_len") or 0),
                    phase=replica.role,
                    api_key=str(row["api_key"]) if row.get("api_key") else None,
                )
    state = RouterState(
        routes, replicas, version=int(table.get("version", 0)), prefix_index=prefix_index
    )
    served = frozenset(
        route.model for route in routes if any(d.weight > 0 for d in route.deployments)
    )
    disaggregated = frozenset(replica.model for replica in replicas if replica.role != COLOCATED)
    return RoutingSnapshot(
        int(table.get("version", 0)), state, endpoints, tiers, served, disaggregated
    )


class RoutingCache:
    """Holds the current snapshot; a background task keeps it and its telemetry fresh."""

    def __init__(
        self, redis: aioredis.Redis | aioredis.RedisCluster, telemetry_interval_s: float = 1.0
    ) -> None:
        self.redis = redis
        self.telemetry_interval_s = telemetry_interval_s
        self.snapshot = build_snapshot({})
        self.loaded = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._refreshed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        with contextlib.suppress(Exception):
            await self.reload()
        self._tasks = [
            asyncio.create_task(self._follow_updates(), name="routing-updates"),
            asyncio.create_task(self._poll(), name="routing-poll"),
        ]

    async def close(self) -> None:
        await cancel_all(self._tasks)

    async def reload(self) -> None:
        # One reload at a time: two in flight (an update message and the poll) could
        # otherwise apply an older table after a newer one.
        async with self._reload_lock:
            await self._reload()

    async def _reload(self) -> None:
        raw = await self.redis.get(ROUTING_TABLE_KEY)
        table = orjson.loads(raw) if raw else {}
        version = int(table.get("version", 0))
        if version != self.snapshot.version or not self.loaded.is_set():
            previous = self.snapshot
            self.snapshot = build_snapshot(table, previous.state.prefix_index)
            carry_over(previous, self.snapshot)
        # The table is read: which models it serves is known, even if telemetry is not yet.
        self.loaded.set()
        await self.refresh_telemetry()

    async def refresh_telemetry(self) -> None:
        rows = await self.redis.hgetall(ROUTING_TELEMETRY_KEY)
        now_mono = time.monotonic()
        now_wall = time.time()
        state = self.snapshot.state
        for replica_id, raw in rows.items():
            item = orjson.loads(raw)
            scraped_at = float(item.get("scraped_at") or now_wall)
            state.update_telemetry(
                replica_id.decode() if isinstance(replica_id, bytes) else str(replica_id),
                running=int(item.get("running", 0)),
                waiting=int(item.get("waiting", 0)),
                kv_usage=float(item.get("kv", 0.0)),
                telemetry_at=now_mono - max(0.0, now_wall - scraped_at),
                adapters_loaded=frozenset(item.get("loras") or ()),
            )
        # Wake whoever waits for fresh telemetry (requests queued for capacity), then arm
        # a new event for the next refresh.
        self._refreshed.set()
        self._refreshed = asyncio.Event()

    async def next_refresh(self) -> None:
        """Return after the next telemetry refresh (about every `telemetry_interval_s`)."""
        await self._refreshed.wait()

    async def _follow_updates(self) -> None:
        await follow_channel(self.redis, ROUTING_UPDATES_CHANNEL, self._on_update)

    async def _on_update(self, _message: bytes) -> None:
        await self.reload()

    async def _poll(self) -> None:
        # Telemetry every interval; the table too, in case an update message was missed.
        while True:
            await asyncio.sleep(self.telemetry_interval_s)
            try:
                await self.reload()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("routing refresh failed: %s", error)
