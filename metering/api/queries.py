"""The figures the metering API answers with, read from querysets the caller may see.

Usage is aggregated from the usage events, not the hourly rollups: rollups have no key
dimension (the API filters by key), they are hourly (a range that starts or ends mid-hour
could not be cut exactly), and the current hour's rollup lags ingest until the next
recompute. The (tenant_id, started_at) index makes one tenant's range a B-tree range scan, so
the event table's size does not matter, only the range's.

Margin is read from the rollups and the GPU-time ledger (ReplicaHour): cost to serve exists
only after an hour is attributed and rolled up (every minute for the current hour), and a
platform-wide figure over months would otherwise scan every event.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.db.models import Count, Max, Q, QuerySet, Sum
from django.db.models.functions import Trunc

from metering.models import HourlyRollup, ReplicaHour, UsageEvent, micros_to_usd
from metering.prices import usd_to_micros
from metering.rollups import ERROR_STATUSES, hour_floor
from tenants.models import Tenant


def usage_buckets(
    events: QuerySet[UsageEvent], start: datetime, end: datetime, granularity: str
) -> list[dict[str, Any]]:
    """Requests, errors, tokens and spend per hour, day or month (UTC) of [start, end);
    periods without requests are left out."""
    rows = (
        events.filter(started_at__gte=start, started_at__lt=end)
        .annotate(period=Trunc("started_at", granularity, tzinfo=UTC))
        .values("period")
        .annotate(
            requests=Count("request_id"),
            errors=Count("request_id", filter=Q(status__in=ERROR_STATUSES)),
            spend_micros=Sum("price_charged_usd_micros"),
            prompt_tokens=Sum("prompt_tokens"),
            cached_prompt_tokens=Sum("cached_prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
        )
        .order_by("period")
    )
    return [
        {
            "period": row["period"],
            "requests": row["requests"],
            "errors": row["errors"],
            "prompt_tokens": row["prompt_tokens"] or 0,
            "cached_prompt_tokens": row["cached_prompt_tokens"] or 0,
            "completion_tokens": row["completion_tokens"] or 0,
            "spend_micros": row["spend_micros"] or 0,
        }
        for row in rows
    ]


def usage_totals(buckets: list[dict[str, Any]]) -> dict[str, int]:
    names = (
        "requests",
        "errors",
        "prompt_tokens",
        "cached_prompt_tokens",
        "completion_tokens",
        "spend_micros",
    )
    return {name: sum(bucket[name] for bucket in buckets) for name in names}


def with_spend_usd(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "spend_usd": micros_to_usd(row.pop("spend_micros"))}


# Under this revenue a margin percentage measures how little traffic there was, not pricing:
# GPUs kept warm for a few demo requests read as -40,000 %. The report leaves it null.
MARGIN_PCT_MIN_REVENUE_MICROS = 10_000_000
IDLE_KEY = "idle"
MARGIN_DIMENSIONS = {"model": "model", "pool": "pool", "tenant": "tenant_id"}


def margin_rows(
    rollups: QuerySet[HourlyRollup],
    ledger: QuerySet[ReplicaHour],
    start: datetime,
    end: datetime,
    by: str,
) -> list[dict[str, Any]]:
    """Revenue, cost to serve and margin per model, pool or tenant over the hours that overlap
    [start, end). Cost to serve is the ledger's: the requests' charges plus the idle GPU time
    of the replicas behind them (by model or pool: the idle time of that model's or pool's
    replicas; by tenant: idle is a row of its own, `idle`, since no tenant caused it)."""
    first = hour_floor(start)
    column = MARGIN_DIMENSIONS[by]
    usage = (
        rollups.filter(hour__gte=first, hour__lt=end)
        .values(column)
        .annotate(
            requests=Sum("requests"),
            gpu_seconds=Sum("gpu_seconds"),
            revenue=Sum("revenue_usd_micros"),
            cost=Sum("cost_to_serve_usd_micros"),
            baseline=Sum("baseline_cost_usd_micros"),
        )
    )
    figures: dict[str, MarginFigures] = defaultdict(MarginFigures)
    names = _tenant_slugs() if by == "tenant" else {}
    for row in usage:
        key = names.get(row[column], str(row[column])) if by == "tenant" else row[column]
        figures[key].add_usage(row)
    idle_column = column if by != "tenant" else None
    idle = ledger.filter(hour__gte=first, hour__lt=end)
    idle_rows = (
        idle.values(idle_column).annotate(
            gpu=Sum("idle_gpu_seconds"), micros=Sum("idle_usd_micros")
        )
        if idle_column
        else [idle.aggregate(gpu=Sum("idle_gpu_seconds"), micros=Sum("idle_usd_micros"))]
    )
    for row in idle_rows:
        if row["gpu"] is None:
            continue
        figures[row[idle_column] if idle_column else IDLE_KEY].add_idle(row["gpu"], row["micros"])
    return [figures[key].row(key) for key in sorted(figures)]


def margin_report(
    rollups: QuerySet[HourlyRollup],
    ledger: QuerySet[ReplicaHour],
    start: datetime,
    end: datetime,
    by: str,
) -> dict[str, Any]:
    rows = margin_rows(rollups, ledger, start, end, by)
    return {
        "start": start,
        "end": end,
        "by": by,
        "totals": margin_totals(rows, ledger, start, end),
        "rows": rows,
    }


def margin_csv(report: dict[str, Any], columns: Sequence[str]) -> str:
    """The report's rows, then its total, one line each, in `columns` order."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([report["by"], *columns[1:]])
    for row in [*report["rows"], report["totals"]]:
        writer.writerow([row[name] for name in columns])
    return out.getvalue()


def margin_totals(
    rows: list[dict[str, Any]], ledger: QuerySet[ReplicaHour], start: datetime, end: datetime
) -> dict[str, Any]:
    """The rows added up, and the fleet's ready GPU time over the same hours: the two GPU-second
    figures are equal unless some request ran on a replica the ledger has no time for."""
    total = MarginFigures()
    for row in rows:
        total.merge(row)
    fleet = ledger.filter(hour__gte=hour_floor(start), hour__lt=end).aggregate(
        gpu=Sum("gpu_seconds"), micros=Sum("cost_usd_micros"), as_of=Max("as_of")
    )
    return {
        **total.row("total"),
        "fleet_gpu_seconds": fleet["gpu"] or 0.0,
        "fleet_cost_usd": micros_to_usd(int(fleet["micros"] or 0)),
        "as_of": fleet["as_of"],
    }


@dataclass(slots=True)
class MarginFigures:
    """One row of the margin report, in integer micro-USD until it is shown."""

    requests: int = 0
    gpu_seconds: float = 0.0
    idle_gpu_seconds: float = 0.0
    revenue: int = 0
    request_cost: int = 0
    idle_cost: int = 0
    baseline: int = 0

    def add_usage(self, row: dict[str, Any]) -> None:
        self.requests += row["requests"] or 0
        self.gpu_seconds += row["gpu_seconds"] or 0.0
        self.revenue += int(row["revenue"] or 0)
        self.request_cost += int(row["cost"] or 0)
        self.baseline += int(row["baseline"] or 0)

    def add_idle(self, gpu_seconds: float, micros: int | Decimal | None) -> None:
        self.gpu_seconds += gpu_seconds
        self.idle_gpu_seconds += gpu_seconds
        self.idle_cost += int(micros or 0)

    def merge(self, row: dict[str, Any]) -> None:
        self.requests += row["requests"]
        self.gpu_seconds += row["gpu_seconds"]
        self.idle_gpu_seconds += row["idle_gpu_seconds"]
        self.revenue += usd_to_micros(row["revenue_usd"])
        self.request_cost += usd_to_micros(row["request_cost_usd"])
        self.idle_cost += usd_to_micros(row["idle_cost_usd"])
        self.baseline += usd_to_micros(row["least_load_request_cost_usd"])

    def row(self, key: str) -> dict[str, Any]:
        cost = self.request_cost + self.idle_cost
        margin = self.revenue - cost
        shown_pct = self.revenue >= MARGIN_PCT_MIN_REVENUE_MICROS
        return {
            "key": key,
            "requests": self.requests,
            "gpu_seconds": self.gpu_seconds,
            "idle_gpu_seconds": self.idle_gpu_seconds,
            "revenue_usd": micros_to_usd(self.revenue),
            "request_cost_usd": micros_to_usd(self.request_cost),
            "idle_cost_usd": micros_to_usd(self.idle_cost),
            "cost_usd": micros_to_usd(cost),
            "margin_usd": micros_to_usd(margin),
            "margin_pct": margin / self.revenue * 100 if shown_pct else None,
            "least_load_request_cost_usd": micros_to_usd(self.baseline),
            "saving_vs_least_load_usd": micros_to_usd(self.baseline - self.request_cost),
        }


def _tenant_slugs() -> dict[int, str]:
    return dict(Tenant.objects.values_list("pk", "slug"))
