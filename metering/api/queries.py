"""The figures the metering API answers with, read from querysets the caller may see.

Usage is aggregated from the usage events, not the hourly rollups: rollups have no key
dimension (the API filters by key), they are hourly (a range that starts or ends mid-hour
could not be cut exactly), and the current hour's rollup lags ingest until the next
recompute. The (tenant_id, started_at) index makes one tenant's range a B-tree range scan, so
the event table's size does not matter, only the range's.

Margin is read from the rollups: cost to serve exists only after an hour is attributed and
rolled up, and a platform-wide figure over months would otherwise scan every event.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.db.models import Count, Q, QuerySet, Sum
from django.db.models.functions import Trunc

from metering.models import HourlyRollup, UsageEvent, micros_to_usd
from metering.rollups import ERROR_STATUSES


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


def margin_rows(
    rollups: QuerySet[HourlyRollup], start: datetime, end: datetime, by: str
) -> list[dict[str, Any]]:
    """Revenue, cost to serve and margin per model or per pool over the hours in [start, end)."""
    rows = (
        rollups.filter(hour__gte=start, hour__lt=end)
        .values(by)
        .annotate(
            requests=Sum("requests"),
            gpu_seconds=Sum("gpu_seconds"),
            revenue_micros=Sum("revenue_usd_micros"),
            cost_micros=Sum("cost_to_serve_usd_micros"),
        )
        .order_by(by)
    )
    return [
        margin_row(
            row[by], row["requests"], row["gpu_seconds"], row["revenue_micros"], row["cost_micros"]
        )
        for row in rows
    ]


def margin_row(
    key: str, requests: int | None, gpu_seconds: float | None, revenue: int | None, cost: int | None
) -> dict[str, Any]:
    revenue, cost = revenue or 0, cost or 0
    return {
        "key": key,
        "requests": requests or 0,
        "gpu_seconds": gpu_seconds or 0.0,
        "revenue_usd": micros_to_usd(revenue),
        "cost_usd": micros_to_usd(cost),
        "margin_usd": micros_to_usd(revenue - cost),
        "margin_pct": (revenue - cost) / revenue * 100 if revenue else None,
    }


def margin_totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def micros(name: str) -> int:
        return sum(int(row[name] * 1_000_000) for row in rows)

    return margin_row(
        "total",
        sum(row["requests"] for row in rows),
        sum(row["gpu_seconds"] for row in rows),
        micros("revenue_usd"),
        micros("cost_usd"),
    )
