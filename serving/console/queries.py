"""Read-only figures for the admin console: the live fleet snapshot and its parts.

The snapshot is what the `fleet-live` WebSocket group receives every two seconds and what the
overview page renders first, so both show the same numbers.

- GPUs by class and state: every inventoried GPU of every node, in the state of the replica
  holding it (ready, starting, draining, failed), else `idle`, or `unavailable` when its node
  is NotReady.
- Utilization: mean GPU utilization the agents last reported (NVML), over GPUs that report it.
- KV use: mean KV-cache use over ready replicas with fresh telemetry.
- Queue depth: requests waiting in the engines (sum over replicas).
- Tokens per second: generated tokens, from the change of the engines' counters between two
  snapshots (the previous totals are kept in Redis).
- TTFT and TPOT p50/p99, and per tier with objectives the share of requests within both
  clocks (TTFT and TPOT within the tier's objectives; failed ones missed, client-cancelled
  ones not judged): over requests that ended in the last five minutes (metering's usage rows).
- Cost per hour: every GPU of a Ready node at its pool's price (idle GPUs cost money too);
  cost per million tokens is that divided by the current token rate.

The overview's chart (tokens per second and queue depth) starts from the recent history: the
broadcaster appends each snapshot's point to a capped Redis list, and the page embeds that list,
so the chart is drawn on load and the WebSocket only extends it.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from datetime import timedelta
from typing import Any

import orjson
import redis
from django.db import connection
from django.utils import timezone

from config.redis import get_many, redis_client
from serving import telemetry
from serving.models import Gpu, Node, Replica
from serving.router.contracts import DEFAULT_SLO_TIERS, NOT_JUDGED_STATUSES

PREVIOUS_TOTALS_KEY = "console:fleet:previous_totals"
HISTORY_KEY = "console:fleet:history"
# As many points as the page keeps: ten minutes of the broadcaster's 2 s beat.
HISTORY_POINTS = 300
# A history nobody has extended for this long is no longer "recent".
HISTORY_TTL_S = 3600
LATENCY_WINDOW = timedelta(minutes=5)
GPU_STATES = ("ready", "starting", "draining", "failed", "idle", "unavailable")


def _live_replicas() -> list[Replica]:
    return list(
        Replica.objects.exclude(state=Replica.State.STOPPED)
        .select_related("node__pool__gpu_class", "deployment__model_version__model")
        .order_by("pk")
    )


def _replica_telemetry(client: redis.Redis, replica_ids: list[str]) -> dict[str, dict[str, Any]]:
    if not replica_ids:
        return {}
    raw = get_many(client, [telemetry.replica_key(rid) for rid in replica_ids])
    return {rid: orjson.loads(row) for rid, row in zip(replica_ids, raw, strict=True) if row}


def _node_utilizations(client: redis.Redis, node_ids: list[int]) -> list[float]:
    if not node_ids:
        return []
    values: list[float] = []
    for row in get_many(client, [telemetry.node_key(nid) for nid in node_ids]):
        if not row:
            continue
        for gpu in orjson.loads(row).get("gpus") or []:
            if gpu.get("utilization_pct") is not None:
                values.append(float(gpu["utilization_pct"]))
    return values


def _gpu_states(replicas: list[Replica]) -> dict[str, dict[str, int]]:
    holder: dict[tuple[int, int], str] = {}
    for replica in replicas:
        for index in replica.gpu_indices or []:
            holder[(replica.node_id, int(index))] = replica.state
    by_class: dict[str, Counter[str]] = defaultdict(Counter)
    for gpu in Gpu.objects.select_related("node__pool__gpu_class"):
        state = holder.get((gpu.node_id, gpu.index), "idle")
        if gpu.node.health == Node.Health.NOT_READY:
            state = "unavailable"
        by_class[gpu.node.pool.gpu_class.name][state] += 1
    return {name: {s: counts[s] for s in GPU_STATES} for name, counts in sorted(by_class.items())}


def _cost_per_hour() -> float:
    total = 0.0
    for node in Node.objects.filter(health=Node.Health.READY).select_related("pool__gpu_class"):
        total += float(node.pool.price_per_gpu_hour) * node.gpus.count()
    return total


# The tiers with objectives: the overview shows each one's share within both clocks.
JUDGED_TIERS = tuple(
    name
    for name, tier in DEFAULT_SLO_TIERS.items()
    if tier.ttft_s is not None or tier.tpot_s is not None
)


LATENCY_FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


# Each answer of the window with its TPOT, the SLO's second clock, as
# `metering.models.UsageEvent.tpot_ms` computes it.
_EVENTS_SQL = (
    "WITH e AS (SELECT priority, status, ttft_ms,"
    " CASE WHEN ttft_ms IS NOT NULL AND completion_tokens >= 2"
    " THEN greatest(total_ms - ttft_ms, 0) / (completion_tokens - 1) END AS tpot_ms"
    " FROM metering_usageevent WHERE ended_at >= %s) "
)

_PERCENTILES_SQL = (
    "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ttft_ms),"
    " percentile_cont(0.99) WITHIN GROUP (ORDER BY ttft_ms),"
    " percentile_cont(0.5) WITHIN GROUP (ORDER BY tpot_ms),"
    " percentile_cont(0.99) WITHIN GROUP (ORDER BY tpot_ms) FROM e"
)
# Per tier, the answers judged (not client-cancelled, not refused by the engine) and those
# within both of its objectives (`serving.router.contracts.slo_outcome`'s rule); {} takes one
# VALUES row per tier, the last placeholder the statuses not judged.
_ATTAINMENT_SQL = (
    "SELECT e.priority, count(*), count(*) FILTER (WHERE e.status = 'ok'"
    " AND e.ttft_ms IS NOT NULL AND (o.ttft_ms IS NULL OR e.ttft_ms <= o.ttft_ms)"
    " AND (e.tpot_ms IS NULL OR o.tpot_ms IS NULL OR e.tpot_ms <= o.tpot_ms))"
    " FROM e JOIN (VALUES {}) AS o(tier, ttft_ms, tpot_ms)"
    " ON e.priority = o.tier WHERE NOT e.status = ANY(%s) GROUP BY e.priority"
)


def latency_figures(window: timedelta = LATENCY_WINDOW) -> dict[str, float | None]:
    """TTFT and TPOT p50 and p99 (ms) of the requests that ended within `window`, and per
    tier with objectives the share judged that met both clocks (`slo_<tier>`), judged as
    `serving.router.contracts.slo_outcome` judges one answer: failed ones count as missed,
    client-cancelled ones and the engine's refusals not at all. None where there were none."""
    since = timezone.now() - window
    judged_tiers = [
        (name, _ms(DEFAULT_SLO_TIERS[name].ttft_s), _ms(DEFAULT_SLO_TIERS[name].tpot_s))
        for name in JUDGED_TIERS
    ]
    figures: dict[str, float | None] = {f"slo_{name}": None for name, _, _ in judged_tiers}
    with connection.cursor() as cursor:
        cursor.execute(_EVENTS_SQL + _PERCENTILES_SQL, [since])  # nosec B608: constants
        row = cursor.fetchone()
        for name, value in zip(LATENCY_FIGURES, row, strict=True):
            figures[name] = None if value is None else float(value)
        if not judged_tiers:
            return figures
        objectives = ", ".join(["(%s, %s::float8, %s::float8)"] * len(judged_tiers))
        sql = _EVENTS_SQL + _ATTAINMENT_SQL.format(objectives)  # nosec B608: placeholders only
        objectives_values = [value for tier in judged_tiers for value in tier]
        cursor.execute(sql, [since, *objectives_values, list(NOT_JUDGED_STATUSES)])
        for tier, judged, met in cursor.fetchall():
            figures[f"slo_{tier}"] = met / judged if judged else None
    return figures


def _token_rate(client: redis.Redis, generated_total: int, now: float) -> float | None:
    """Tokens per second since the previous snapshot; None on the first one or after a reset."""
    previous = client.get(PREVIOUS_TOTALS_KEY)
    client.set(PREVIOUS_TOTALS_KEY, orjson.dumps({"at": now, "generated": generated_total}), ex=60)
    if previous is None:
        return None
    before = orjson.loads(previous)
    elapsed = now - float(before["at"])
    delta = generated_total - int(before["generated"])
    # A replica that stopped takes its counter with it: the sum drops, which is not a rate.
    if elapsed <= 0 or delta < 0:
        return None
    return delta / elapsed


def _replica_row(replica: Replica, seen: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "id": replica.pk,
        "deployment": replica.deployment.name,
        "model": replica.deployment.model_version.model.name,
        "node": replica.node.hostname,
        "pool": replica.node.pool.name,
        "gpu_class": replica.node.pool.gpu_class.name,
        "state": replica.state,
        "running": int((seen or {}).get("num_requests_running") or 0),
        "waiting": int((seen or {}).get("num_requests_waiting") or 0),
        "kv": float((seen or {}).get("kv_cache_usage_perc") or 0.0),
    }


def fleet_snapshot(client: redis.Redis | None = None, *, rate: bool = True) -> dict[str, Any]:
    """The overview's numbers, as plain JSON. `rate=False` leaves the token-rate memory alone
    (a page render must not steal the broadcaster's previous totals)."""
    client = client or redis_client()
    now = time.time()
    replicas = _live_replicas()
    seen = _replica_telemetry(client, [r.replica_id for r in replicas])
    utilizations = _node_utilizations(client, sorted({r.node_id for r in replicas}))
    generated = sum(int(t.get("generation_tokens_total") or 0) for t in seen.values())
    tokens_per_s = _token_rate(client, generated, now) if rate else None
    return _snapshot(now, replicas, seen, utilizations, tokens_per_s)


def fleet_snapshot_without_telemetry() -> dict[str, Any]:
    """The snapshot's PostgreSQL half, for a page to show while Redis is away: replicas, GPU
    states, cost and TTFT; no engine telemetry, utilization or token rate."""
    return _snapshot(time.time(), _live_replicas(), {}, [], None)


def unavailable_snapshot() -> dict[str, Any]:
    """The snapshot's shape with no figures, for a page to show while PostgreSQL is away."""
    return {
        "at": time.time(),
        "gpus": {},
        "replicas_by_state": {},
        "replicas_ready": 0,
        "replicas": [],
        "utilization_pct": None,
        "kv_use": None,
        "queue_depth": 0,
        "running": 0,
        "tokens_per_s": None,
        "ttft_p50_ms": None,
        "ttft_p99_ms": None,
        "tpot_p50_ms": None,
        "tpot_p99_ms": None,
        **{f"slo_{name}": None for name in JUDGED_TIERS},
        "cost_per_hour": None,
        "cost_per_mtok": None,
    }


def _snapshot(
    now: float,
    replicas: list[Replica],
    seen: dict[str, dict[str, Any]],
    utilizations: list[float],
    tokens_per_s: float | None,
) -> dict[str, Any]:
    rows = [_replica_row(r, seen.get(r.replica_id)) for r in replicas]
    ready = [row for row in rows if row["state"] == Replica.State.READY]
    kv_values = [row["kv"] for row in ready if str(row["id"]) in seen]
    cost_per_hour = _cost_per_hour()
    latency = latency_figures()
    per_mtok = None
    if tokens_per_s:
        per_mtok = cost_per_hour / (tokens_per_s * 3600 / 1_000_000)
    return {
        "at": now,
        "gpus": _gpu_states(replicas),
        "replicas_by_state": dict(Counter(row["state"] for row in rows)),
        "replicas_ready": len(ready),
        "replicas": rows,
        "utilization_pct": sum(utilizations) / len(utilizations) if utilizations else None,
        "kv_use": sum(kv_values) / len(kv_values) if kv_values else None,
        "queue_depth": sum(row["waiting"] for row in rows),
        "running": sum(row["running"] for row in rows),
        "tokens_per_s": tokens_per_s,
        **latency,
        "cost_per_hour": cost_per_hour,
        "cost_per_mtok": per_mtok,
    }


def record_fleet_history(client: redis.Redis, snapshot: dict[str, Any]) -> None:
    """Append the snapshot's chart point to the capped history (one round trip)."""
    point = {key: snapshot[key] for key in ("at", "tokens_per_s", "queue_depth")}
    pipe = client.pipeline(transaction=False)
    pipe.rpush(HISTORY_KEY, orjson.dumps(point))
    pipe.ltrim(HISTORY_KEY, -HISTORY_POINTS, -1)
    pipe.expire(HISTORY_KEY, HISTORY_TTL_S)
    pipe.execute()


def empty_history() -> dict[str, list[Any]]:
    return {"at": [], "tokens_per_s": [], "queue_depth": []}


def fleet_history(client: redis.Redis | None = None) -> dict[str, list[Any]]:
    """The recent chart points as columns (uPlot's layout), oldest first."""
    client = client or redis_client()
    points = sorted(
        (orjson.loads(raw) for raw in client.lrange(HISTORY_KEY, 0, -1)),
        key=lambda point: point["at"],
    )
    return {
        "at": [point["at"] for point in points],
        "tokens_per_s": [point["tokens_per_s"] for point in points],
        "queue_depth": [point["queue_depth"] for point in points],
    }
