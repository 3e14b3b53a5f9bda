"""Read-only figures for the console and the portal: spend against budget, daily series,
margin by model and pool, and the router's estimated saving.

Estimated saving against the cheapest homogeneous choice (per model, over the window):
for each pool that served the model, its observed cost to serve per token (cost / (prompt +
completion tokens)) prices the model's whole token volume as if that one pool had served
all of it; the cheapest such pool is the homogeneous alternative. Saving = that cost minus
what was actually spent. It is an estimate: it assumes a pool's cost per token would not
change with more load (it would fall while the pool has idle GPUs and rise past its
capacity) and it ignores latency objectives, which are why the router may choose a dearer
pool; so the figure can be negative, and that is shown as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any, TypedDict

from django.db.models import Count, F, Sum
from django.db.models.functions import TruncDay
from django.utils import timezone

from metering.models import UsageEvent, micros_to_usd


def month_start(today: date | None = None) -> datetime:
    now = timezone.now()
    day = today or now.date()
    return now.replace(
        year=day.year, month=day.month, day=1, hour=0, minute=0, second=0, microsecond=0
    )


@dataclass(frozen=True)
class MonthToDate:
    requests: int
    tokens: int
    spend_usd: float
    cost_usd: float


def month_to_date(tenant_id: int) -> MonthToDate:
    totals = UsageEvent.objects.filter(
        tenant_id=tenant_id, started_at__gte=month_start()
    ).aggregate(
        requests=Count("request_id"),
        prompt=Sum("prompt_tokens"),
        completion=Sum("completion_tokens"),
        spend=Sum("price_charged_usd_micros"),
        cost=Sum("cost_to_serve_usd_micros"),
    )
    return MonthToDate(
        requests=totals["requests"] or 0,
        tokens=(totals["prompt"] or 0) + (totals["completion"] or 0),
        spend_usd=float(micros_to_usd(totals["spend"] or 0)),
        cost_usd=float(micros_to_usd(totals["cost"] or 0)),
    )


def daily_series(tenant_id: int, days: int = 30) -> dict[str, list[Any]]:
    """Per day: epoch seconds, tokens, spend in USD, and cumulative spend this month."""
    since = timezone.now() - timedelta(days=days)
    rows = (
        UsageEvent.objects.filter(tenant_id=tenant_id, started_at__gte=since)
        .annotate(day=TruncDay("started_at"))
        .values("day")
        .annotate(
            tokens=Sum(F("prompt_tokens") + F("completion_tokens")),
            spend=Sum("price_charged_usd_micros"),
        )
        .order_by("day")
    )
    # Per day: (tokens, spend in micros); a day without events has none of either.
    by_day: dict[date, tuple[int, int]] = {
        row["day"].date(): (row["tokens"] or 0, row["spend"] or 0) for row in rows
    }
    series: dict[str, list[Any]] = {"at": [], "tokens": [], "spend": [], "cumulative": []}
    running, this_month = 0.0, month_start()
    # Every day of the window, empty ones too: a chart of one point has no time axis.
    first = since.replace(hour=0, minute=0, second=0, microsecond=0)
    for offset in range(days + 1):
        day = first + timedelta(days=offset)
        tokens, spend_micros = by_day.get(day.date(), (0, 0))
        spend = float(micros_to_usd(spend_micros))
        running = running + spend if day >= this_month else 0.0
        series["at"].append(day.timestamp())
        series["tokens"].append(tokens)
        series["spend"].append(spend)
        series["cumulative"].append(running)
    return series


class PoolRequests(TypedDict):
    model: str
    pool: str
    status: str
    requests: int


def decisions_by_reason(since: datetime) -> list[PoolRequests]:
    """Requests per model and pool the router sent them to, from the usage rows."""
    return list(
        UsageEvent.objects.filter(started_at__gte=since)
        .values("model", "pool", "status")
        .annotate(requests=Count("request_id"))
        .order_by("model", "pool", "status")
    )
