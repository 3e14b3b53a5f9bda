"""Console pages of billing and routing (staff) and the portal's usage and invoices."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib.auth.decorators import login_required
from django.db.models import ExpressionWrapper, F, FloatField
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from prometheus_client import REGISTRY

from config.views import staff_required
from metering import actions
from metering.console_queries import (
    daily_series,
    decisions_by_reason,
    margin_by_model_and_pool,
    router_saving,
)
from tenants.views import budget_figures, portal_context, portal_tenant

WINDOW = timedelta(days=30)
RECENT_REQUESTS = 50
# Under this revenue (over the window) a margin percentage measures how little traffic there
# was, not pricing: GPUs kept warm for a few demo requests read as -40,000 %.
MARGIN_PCT_MIN_REVENUE_USD = 10.0


def margin_as_shown(row: dict[str, Any]) -> dict[str, Any]:
    """A margin row as the billing page shows it: the dollars always (sign apart, so a loss
    reads -$12.34), the percentage only from MARGIN_PCT_MIN_REVENUE_USD of revenue up."""
    shown_pct = row["revenue_usd"] >= MARGIN_PCT_MIN_REVENUE_USD
    return {
        **row,
        "margin_pct": row["margin_pct"] if shown_pct else None,
        "margin_abs_usd": abs(row["margin_usd"]),
    }


@staff_required
def billing(request: HttpRequest) -> HttpResponse:
    since = timezone.now() - WINDOW
    context = {
        "invoices": actions.access_invoices(request.user)[:100],
        "margins": [margin_as_shown(row) for row in margin_by_model_and_pool(since)],
        "margin_pct_min_revenue_usd": MARGIN_PCT_MIN_REVENUE_USD,
        "sheets": actions.access_price_sheets(request.user).select_related("tenant"),
    }
    return render(request, "console/billing.html", context)


def _router_counter() -> list[dict[str, object]]:
    """This process's router decisions (the gateway runs in the same ASGI process)."""
    rows: list[dict[str, object]] = []
    for family in REGISTRY.collect():
        if family.name != "platform_router_decisions":
            continue
        for item in family.samples:
            if item.name.endswith("_total"):
                rows.append({**item.labels, "count": int(item.value)})
    return sorted(rows, key=lambda row: -int(row["count"]))  # type: ignore[call-overload]


@staff_required
def router(request: HttpRequest) -> HttpResponse:
    since = timezone.now() - WINDOW
    savings = router_saving(since)
    context = {
        "decisions": _router_counter(),
        "by_pool": decisions_by_reason(since),
        "savings": savings,
        "total_saving": sum(row["saving_usd"] for row in savings),
    }
    return render(request, "console/router.html", context)


@login_required
def portal_usage(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = portal_tenant(request, slug)
    recent = (
        actions.access_usage(request.user)
        .filter(tenant_id=tenant.pk)
        .annotate(price_usd=ExpressionWrapper(F("price_charged_usd_micros") / 1e6, FloatField()))
    )
    context = portal_context(
        request,
        tenant,
        recent=recent.order_by("-started_at")[:RECENT_REQUESTS],
        series=daily_series(tenant.pk),
        **budget_figures(tenant),
    )
    return render(request, "portal/usage.html", context)


@login_required
def portal_invoices(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = portal_tenant(request, slug)
    invoices = actions.access_invoices(request.user).filter(tenant=tenant).prefetch_related("lines")
    return render(
        request, "portal/invoices.html", portal_context(request, tenant, invoices=invoices)
    )
