"""Hourly rollups and cost-to-serve attribution of an hour.

`recompute_hour(hour)` is idempotent: it attributes the hour's replica cost to its events, then
replaces the hour's rollup rows with fresh aggregates. Running it twice, or after late events
arrived, leaves the same rows a single run over the same events would.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta
from decimal import Decimal

from django.db import connection, transaction
from django.db.backends.utils import CursorWrapper
from django.utils import timezone

from metering import cost
from metering.models import HourlyRollup, UsageEvent
from metering.prices import usd_to_micros
from serving.engine.perf import PerfModel
from serving.engine.specs import find_model_spec, load_gpu_specs
from serving.models import GpuPool

logger = logging.getLogger(__name__)

# Upper bounds (ms) of latency buckets; the last bucket is everything above the last bound.
LATENCY_BUCKETS_MS: tuple[float, ...] = (
    25,
    50,
    100,
    200,
    300,
    500,
    750,
    1000,
    1500,
    2000,
    3000,
    5000,
    7500,
    10_000,
    20_000,
    30_000,
    60_000,
    120_000,
)
ERROR_STATUSES = ("error", "upstream_failed")


def hour_floor(at: datetime) -> datetime:
    return at.replace(minute=0, second=0, microsecond=0)


def empty_buckets() -> list[int]:
    return [0] * (len(LATENCY_BUCKETS_MS) + 1)


def percentile_ms(buckets: Sequence[int], q: float) -> float | None:
    """The upper bound of the bucket holding the q-th quantile (an over-estimate by at most one
    bucket width); None for no requests. The open last bucket reports its lower bound."""
    total = sum(buckets)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(buckets):
        seen += count
        if seen >= rank and count:
            return LATENCY_BUCKETS_MS[min(index, len(LATENCY_BUCKETS_MS) - 1)]
    return LATENCY_BUCKETS_MS[-1]


# --- cost to serve ----------------------------------------------------------------------


def attribute_hour(hour: datetime, now: datetime | None = None) -> int:
    """Split each replica's GPU cost of the hour over the requests it served there; returns
    how many events were updated. Replicas are assumed up for the whole hour (or up to now for
    the current hour): replica lifetimes are not recorded yet."""
    now = now or timezone.now()
    end = min(hour + timedelta(hours=1), max(now, hour + timedelta(seconds=1)))
    window_s = (end - hour).total_seconds()
    events = list(
        UsageEvent.objects.filter(started_at__gte=hour, started_at__lt=hour + timedelta(hours=1))
        .exclude(replica_id="")
        .values_list(
            "request_id",
            "replica_id",
            "pool",
            "model",
            "prompt_tokens",
            "cached_prompt_tokens",
            "completion_tokens",
            "ttft_ms",
            "total_ms",
        )
    )
    by_replica: dict[tuple[str, str, str], list[cost.ServedRequest]] = defaultdict(list)
    for rid, replica, pool, model, prompt, cached, completion, ttft, total in events:
        decode_ms = max(0.0, (total or 0.0) - (ttft or total or 0.0))
        by_replica[(replica, pool, model)].append(
            cost.ServedRequest(rid, prompt, cached, completion, decode_ms)
        )
    pools = {p.name: p for p in GpuPool.objects.select_related("gpu_class")}
    updates: list[cost.Attribution] = []
    for (replica, pool_name, model), served in by_replica.items():
        perf = _perf_model(pools.get(pool_name), model)
        gpu_pool = pools.get(pool_name)
        if perf is None or gpu_pool is None:
            logger.warning("no engine model for %s on pool %s; cost left at 0", model, pool_name)
            continue
        window = cost.ReplicaWindow(
            replica, window_s, perf.tensor_parallel, usd_to_micros(gpu_pool.price_per_gpu_hour)
        )
        weights = cost.weights_for_window(perf, window, served)
        updates.extend(cost.attribute(window, served, weights))
    _write_attributions(updates)
    return len(updates)


def _perf_model(pool: GpuPool | None, model: str) -> PerfModel | None:
    if pool is None:
        return None
    gpu = load_gpu_specs().get(pool.gpu_class.name)
    spec = find_model_spec(model)
    if gpu is None or spec is None:
        return None
    # The deployment's TP and quantization are not in the event; a model too big for one GPU
    # in bf16 is assumed spread over the fewest GPUs (1, 2, 4, 8) that hold its weights.
    for tp in (1, 2, 4, 8):
        perf = PerfModel(gpu, spec, tensor_parallel=tp)
        if perf.kv_capacity_tokens > 0:
            return perf
    return PerfModel(gpu, spec, tensor_parallel=8)


def _write_attributions(updates: Sequence[cost.Attribution]) -> None:
    if not updates:
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE metering_usageevent AS e SET gpu_seconds = u.g, cost_to_serve_usd_micros = u.c "
            "FROM unnest(%s::text[], %s::float8[], %s::bigint[]) AS u(id, g, c) "
            "WHERE e.request_id = u.id",
            [
                [u.request_id for u in updates],
                [u.gpu_seconds for u in updates],
                [u.cost_usd_micros for u in updates],
            ],
        )


# --- rollups ----------------------------------------------------------------------------

_ROLLUP_SQL = """
SELECT tenant_id, model, adapter, pool, priority,
       count(*), count(*) FILTER (WHERE status = ANY(%(errors)s)),
       sum(prompt_tokens), sum(cached_prompt_tokens), sum(completion_tokens),
       sum(gpu_seconds), sum(cost_to_serve_usd_micros), sum(price_charged_usd_micros)
FROM metering_usageevent
WHERE started_at >= %(start)s AND started_at < %(end)s
GROUP BY tenant_id, model, adapter, pool, priority
"""

# Histograms are counted in PostgreSQL: an hour may hold millions of events.
_BUCKETS_SQL = """
SELECT tenant_id, model, adapter, pool, priority, width_bucket({column}, %(bounds)s), count(*)
FROM metering_usageevent
WHERE started_at >= %(start)s AND started_at < %(end)s AND {column} IS NOT NULL
GROUP BY 1, 2, 3, 4, 5, 6
"""

Dims = tuple[int, str, str, str, str]
# A row of _ROLLUP_SQL: the dimensions, count(*), the error count, the token sums (sum of an
# integer column: bigint), the GPU seconds (float8), then the two micros sums (sum of a bigint
# column: numeric, which psycopg reads as Decimal).
RollupRow = tuple[
    int, str, str, str, str, int, int, int, int, int, float | None, Decimal | None, Decimal | None
]
SqlParams = dict[str, list[str] | list[float] | datetime]


def _histograms(cursor: CursorWrapper, column: str, params: SqlParams) -> dict[Dims, list[int]]:
    histograms: dict[Dims, list[int]] = defaultdict(empty_buckets)
    cursor.execute(_BUCKETS_SQL.format(column=column), params)
    rows: list[tuple[int, str, str, str, str, int, int]] = cursor.fetchall()
    for tenant_id, model, adapter, pool, tier, bucket, count in rows:
        histograms[(tenant_id, model, adapter, pool, tier)][bucket] += count
    return histograms


def recompute_hour(hour: datetime, now: datetime | None = None) -> int:
    """Attribute the hour's cost, then replace its rollup rows; returns the number of rows."""
    hour = hour_floor(hour)
    with transaction.atomic():
        attribute_hour(hour, now)
        params: SqlParams = {
            "errors": list(ERROR_STATUSES),
            "start": hour,
            "end": hour + timedelta(hours=1),
            "bounds": [float(b) for b in LATENCY_BUCKETS_MS],
        }
        with connection.cursor() as cursor:
            cursor.execute(_ROLLUP_SQL, params)
            groups: list[RollupRow] = cursor.fetchall()
            ttft = _histograms(cursor, "ttft_ms", params)
            total = _histograms(cursor, "total_ms", params)
        HourlyRollup.objects.filter(hour=hour).delete()
        HourlyRollup.objects.bulk_create(
            [_rollup(hour, g, ttft[g[:5]], total[g[:5]]) for g in groups]
        )
    return len(groups)


def _rollup(
    hour: datetime, g: RollupRow, ttft_buckets: list[int], total_buckets: list[int]
) -> HourlyRollup:
    tenant_id, model, adapter, pool, tier, requests, errors = g[:7]
    prompt, cached, completion, gpu_s, cost_micros, revenue = g[7:]
    return HourlyRollup(
        hour=hour,
        tenant_id=tenant_id,
        model=model,
        adapter=adapter,
        pool=pool,
        tier=tier,
        requests=requests,
        errors=errors,
        prompt_tokens=prompt,
        cached_prompt_tokens=cached,
        completion_tokens=completion,
        gpu_seconds=gpu_s or 0.0,
        cost_to_serve_usd_micros=int(cost_micros or 0),
        revenue_usd_micros=int(revenue or 0),
        ttft_buckets=ttft_buckets,
        total_buckets=total_buckets,
    )
