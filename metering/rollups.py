"""Hourly rollups and cost-to-serve attribution of an hour.

`recompute_hour(hour)` is idempotent: it attributes the hour's replica cost to its events, then
replaces the hour's rollup rows with fresh aggregates. Running it twice, or after late events
arrived, leaves the same rows a single run over the same events would.

A disaggregated request (one with a prefill replica) is work on two replicas: its prompt's
prefill on the prefill replica, its decode on the decode replica (`replica_id`). Each replica's
split charges it for its own part, and the event's cost to serve is the sum of both.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from django.db import connection, transaction
from django.db.backends.utils import CursorWrapper
from django.utils import timezone

from metering import cost, ledger
from metering.models import HourlyRollup, ReplicaHour, UsageEvent

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
ERROR_STATUSES = ("error", "refused", "upstream_failed")


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


@dataclass(frozen=True, slots=True)
class _Priced:
    """A replica of the ledger with its hour's window, work weights and requests."""

    ledger: ledger.ReplicaLedger
    window: cost.ReplicaWindow
    weights: cost.WorkWeights | None
    served: list[cost.ServedRequest]


@dataclass(frozen=True, slots=True)
class _Charge:
    request_id: str
    gpu_seconds: float
    cost_usd_micros: int
    baseline_usd_micros: int


Served = dict[str, list[tuple[cost.ServedRequest, str]]]


def attribute_hour(hour: datetime, now: datetime | None = None) -> int:
    """Split each replica's ready GPU time of the hour (metering.ledger) over the requests it
    served there, the rest idle (metering.cost.split); price each request's work where least
    load would have sent it; replace the hour's ReplicaHour rows. A disaggregated request is
    charged the sum of its parts on its prefill and decode replicas. Returns how many events
    were updated. Work on a replica with no ready time in the hour is charged nothing."""
    now = now or timezone.now()
    end = hour + timedelta(hours=1)
    events = _served_in(hour, end)
    priced = {
        replica.replica_id: _priced(replica, hour, end, events)
        for replica in ledger.replicas_ready_in(hour, end, now)
    }
    charges: list[_Charge] = []
    rows: list[ReplicaHour] = []
    for replica_id, served_events in events.items():
        item = priced.get(replica_id)
        if item is None:
            charges.extend(_Charge(served.request_id, 0.0, 0, 0) for served, _ in served_events)
    for replica_id, item in priced.items():
        share = cost.split(item.window, item.served, item.weights or cost.WorkWeights(0.0, 0.0))
        for attribution, (served, baseline) in zip(
            share.requests, events.get(replica_id, []), strict=True
        ):
            moved = _baseline_difference(served, item, priced.get(baseline))
            charges.append(
                _Charge(
                    attribution.request_id,
                    attribution.gpu_seconds,
                    attribution.cost_usd_micros,
                    attribution.cost_usd_micros + moved,
                )
            )
        rows.append(_replica_hour(hour, item, share, now))
    totals = _per_request(charges)
    _write_charges(totals)
    ReplicaHour.objects.filter(hour=hour).delete()
    ReplicaHour.objects.bulk_create(rows)
    return len(totals)


def _priced(
    replica: ledger.ReplicaLedger, start: datetime, end: datetime, events: Served
) -> _Priced:
    window = cost.ReplicaWindow(
        replica.replica_id,
        replica.ready_us(start, end),
        replica.gpus,
        replica.usd_micros_per_gpu_hour,
    )
    served = [request for request, _ in events.get(replica.replica_id, [])]
    if replica.perf is None:
        logger.warning("no engine model for replica %s: its time is idle", replica.replica_id)
        return _Priced(replica, window, None, served)
    return _Priced(replica, window, cost.weights_for_window(replica.perf, window, served), served)


def _served_in(start: datetime, end: datetime) -> Served:
    """The period's events by replica: each as work to price, with its baseline replica. A
    disaggregated request is listed on both of its replicas, with its work on each."""
    rows = (
        UsageEvent.objects.filter(started_at__gte=start, started_at__lt=end)
        .exclude(replica_id="", prefill_replica_id="")
        .order_by("started_at", "request_id")
        .values_list(
            "request_id",
            "replica_id",
            "prefill_replica_id",
            "baseline_replica_id",
            "prompt_tokens",
            "cached_prompt_tokens",
            "completion_tokens",
            "ttft_ms",
            "total_ms",
        )
    )
    by_replica: Served = defaultdict(list)
    for rid, replica, prefill_replica, baseline, prompt, cached, completion, ttft, total in rows:
        decode_ms = max(0.0, (total or 0.0) - (ttft or total or 0.0))
        if not prefill_replica:
            by_replica[replica].append(
                (cost.ServedRequest(rid, prompt, cached, completion, decode_ms), baseline)
            )
            continue
        # Its prefill (the one token the prefill phase generates is not worth a decode step);
        # no baseline: least load's choice is priced on the decode part.
        by_replica[prefill_replica].append((cost.ServedRequest(rid, prompt, cached, 0, 0.0), ""))
        if replica:
            # The whole prompt arrived over the KV link, so it counts as cached here. The decode
            # engine's recompute of the prompt's last partial block (under one KV block of
            # tokens) is not charged.
            by_replica[replica].append(
                (cost.ServedRequest(rid, prompt, prompt, completion, decode_ms), baseline)
            )
    return by_replica


def _baseline_difference(
    served: cost.ServedRequest, chosen: _Priced, baseline: _Priced | None
) -> int:
    """What the request's work would have cost more (or less) on the baseline's replica than
    on its own, at its own replica's batch and context (metering.cost.moved_work_usd_micros)."""
    if baseline is None or baseline is chosen:
        return 0
    here, there = chosen.ledger.placement, baseline.ledger.placement
    if here is None or there is None:
        return 0
    return cost.moved_work_usd_micros(
        served,
        here,
        there,
        cost.mean_decode_batch(chosen.window, chosen.served),
        cost.mean_context(chosen.served),
    )


def _replica_hour(
    hour: datetime, item: _Priced, share: cost.WindowSplit, now: datetime
) -> ReplicaHour:
    replica = item.ledger
    return ReplicaHour(
        hour=hour,
        replica_id=replica.replica_id,
        deployment_id=replica.deployment_id,
        model=replica.model,
        pool=replica.pool,
        gpus=replica.gpus,
        usd_micros_per_gpu_hour=replica.usd_micros_per_gpu_hour,
        ready_us=item.window.ready_us,
        requests=len(item.served),
        gpu_seconds=item.window.gpu_seconds,
        idle_gpu_seconds=share.idle_gpu_seconds,
        cost_usd_micros=item.window.cost_usd_micros,
        idle_usd_micros=share.idle_usd_micros,
        as_of=min(now, hour + timedelta(hours=1)),
    )


def _per_request(charges: Sequence[_Charge]) -> list[_Charge]:
    """One charge per request: a disaggregated request's parts on its two replicas summed, since
    an UPDATE ... FROM with a request id twice would apply only one of them."""
    totals: dict[str, _Charge] = {}
    for charge in charges:
        seen = totals.get(charge.request_id)
        totals[charge.request_id] = (
            charge
            if seen is None
            else _Charge(
                charge.request_id,
                seen.gpu_seconds + charge.gpu_seconds,
                seen.cost_usd_micros + charge.cost_usd_micros,
                seen.baseline_usd_micros + charge.baseline_usd_micros,
            )
        )
    return list(totals.values())


def _write_charges(charges: Sequence[_Charge]) -> None:
    if not charges:
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE metering_usageevent AS e SET gpu_seconds = u.g, "
            "cost_to_serve_usd_micros = u.c, baseline_cost_usd_micros = u.b "
            "FROM unnest(%s::text[], %s::float8[], %s::bigint[], %s::bigint[]) AS u(id, g, c, b) "
            "WHERE e.request_id = u.id",
            [
                [c.request_id for c in charges],
                [c.gpu_seconds for c in charges],
                [c.cost_usd_micros for c in charges],
                [c.baseline_usd_micros for c in charges],
            ],
        )


# --- rollups ----------------------------------------------------------------------------

_ROLLUP_SQL = """
SELECT tenant_id, model, adapter, pool, priority,
       count(*), count(*) FILTER (WHERE status = ANY(%(errors)s)),
       sum(prompt_tokens), sum(cached_prompt_tokens), sum(completion_tokens),
       sum(gpu_seconds), sum(cost_to_serve_usd_micros), sum(price_charged_usd_micros),
       sum(baseline_cost_usd_micros)
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
# integer column: bigint), the GPU seconds (float8), then the three micros sums (sum of a
# bigint column: numeric, which psycopg reads as Decimal).
RollupRow = tuple[
    int,
    str,
    str,
    str,
    str,
    int,
    int,
    int,
    int,
    int,
    float | None,
    Decimal | None,
    Decimal | None,
    Decimal | None,
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
    prompt, cached, completion, gpu_s, cost_micros, revenue, baseline = g[7:]
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
        baseline_cost_usd_micros=int(baseline or 0),
        ttft_buckets=ttft_buckets,
        total_buckets=total_buckets,
    )
